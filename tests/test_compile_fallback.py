"""A decoding step that fails to compile is one warning and eager decoding, with eager's logits."""

import logging

import pytest
import torch

from llama_tp import Llama


def failing_backend(graph_module, example_inputs):
    raise RuntimeError("no compiler here")


class Kept(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_a_failure_to_compile_warns_once_and_decodes_eagerly(checkpoints, tokenizer_path):
    llama = Llama.build(str(checkpoints["llama3", 1]), tokenizer_path, max_seq_len=32, max_batch_size=2)
    prompts = [[1, 306, 763], [1, 450]]
    expected = llama.generate(prompts, max_gen_len=6, temperature=0, logprobs=True)
    llama.model.compile_decoding(graphs=True, backend=failing_backend)
    kept = Kept()
    logging.getLogger("llama_tp").addHandler(kept)
    try:
        got = llama.generate(prompts, max_gen_len=6, temperature=0, logprobs=True)
    finally:
        logging.getLogger("llama_tp").removeHandler(kept)
    warnings = [message for message in kept.messages if "compiling the decoding step failed" in message]
    assert len(warnings) == 1 and "no compiler here" in warnings[0]
    assert got[0] == expected[0]
    for row, expected_row in zip(got[1], expected[1]):
        assert row == pytest.approx(expected_row, abs=1e-5)
    assert llama.model.graphs is None and len(llama.model.decode_layer_groups) == 1


def test_compile_defaults_to_off_on_cpu(checkpoints, tokenizer_path):
    llama = Llama.build(str(checkpoints["llama3", 1]), tokenizer_path, max_seq_len=32, max_batch_size=1)
    assert llama.model.run_decode_layers.__name__ == "run_layers"
