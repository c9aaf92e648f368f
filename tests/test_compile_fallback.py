"""A decoding step that fails to compile is one warning and eager decoding, with eager's logits."""

import logging

import pytest
import torch

from distributed import run_world
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
    assert not llama.model.graphs and len(llama.model.decode_layer_groups) == 1


def test_compile_defaults_to_off_on_cpu(checkpoints, tokenizer_path):
    llama = Llama.build(str(checkpoints["llama3", 1]), tokenizer_path, max_seq_len=32, max_batch_size=1)
    assert llama.model.run_decode_layers.__name__ == "run_layers"


def fails_on_rank_1(graph_module, example_inputs):
    """torch.compile's backend on a world where compiling fails on rank 1 alone."""
    if torch.distributed.get_rank() == 1:
        raise RuntimeError("no compiler on rank 1")
    return graph_module.forward


def whole_steps_failing_on_rank_1(folder: str, tokenizer_path: str) -> tuple:
    """On each rank: a model whose whole steps compile on rank 0 and fail to on rank 1, warmed up
    (every rung compiled), then greedy answers; and whether it decodes eagerly afterwards."""
    llama = Llama.build(folder, tokenizer_path, max_seq_len=32, max_batch_size=3)
    llama.model.compile_decoding(graphs=True, backend=fails_on_rank_1)
    kept = Kept()
    logging.getLogger("llama_tp").addHandler(kept)
    llama.model.warm_up_decoding()
    answers = llama.generate(PROMPTS, max_gen_len=8, temperature=0)[0]
    return not llama.model.graphs, kept.messages, answers


PROMPTS = [[1, 306, 763], [1, 450, 4996, 17354], [1, 18637]]


@pytest.mark.slow
def test_a_failure_to_compile_on_one_rank_is_agreed_by_every_rank(wide_heads_checkpoint, tokenizer_path):
    """Rank 1's compiling fails while rank 0's succeeds: the warm-up's step goes on in step on
    both (rank 1 runs the failed part eagerly, with the same exchanges), the ranks agree, and
    every rank decodes eagerly from then on with the single process's answers."""
    folder = str(wide_heads_checkpoint)
    expected = Llama.build(folder, tokenizer_path, max_seq_len=32, max_batch_size=3).generate(
        PROMPTS, max_gen_len=8, temperature=0)[0]
    for eager, messages, answers in run_world(2, whole_steps_failing_on_rank_1, folder, tokenizer_path):
        assert eager and answers == expected
        warnings = [message for message in messages if "compiling the decoding step failed" in message]
        assert len(warnings) == 1 and "on rank 1: BackendCompilerFailed" in warnings[0]
        assert "no compiler on rank 1" in warnings[0]
