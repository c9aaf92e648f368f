"""Mistakes Llama.build catches before loading: a max_seq_len beyond the context the model was trained
for, and weights and a KV cache that do not fit in the memory this machine has free."""

import json
import subprocess
import sys

import pytest
import torch

from jobs import LAUNCH, PROJECT_ROOT, subprocess_env
from llama_tp import Llama, generation
from llama_tp.model import memory
from llama_tp.model.args import ModelArgs
from llama_tp.checkpoint.record import ModelRecord
from llama_tp.context import Context, trained_context
from llama_tp.text.tokenizer import load_tokenizer
from tiny_checkpoint import LLAMA2_TOKENIZER, SHARED_DATA, TINY_LLAMA2, TINY_LLAMA3, full_weights, write_checkpoint

LLAMA3_TOKENIZER = SHARED_DATA / "llama3-tokenizer.model"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("limits") / "tp1", TINY_LLAMA2, full_weights(TINY_LLAMA2, 32000),
                            1, "dim")


def test_the_trained_context_comes_from_the_record_else_from_metas_families():
    llama2, llama3 = load_tokenizer(str(LLAMA2_TOKENIZER)), load_tokenizer(str(LLAMA3_TOKENIZER))
    plain = ModelArgs.from_dict(TINY_LLAMA2)
    assert trained_context(plain, llama2, ModelRecord(context_length=128)) == Context(128, "its llama_tp.json's "
                                                                                           "context_length")
    assert trained_context(plain, llama2, ModelRecord()).tokens == 4096  # Llama 2
    assert trained_context(ModelArgs.from_dict({**TINY_LLAMA2, "rope_theta": 500000.0}), llama3,
                           ModelRecord()).tokens == 8192  # Llama 3
    assert trained_context(ModelArgs.from_dict(TINY_LLAMA3), llama3, ModelRecord()).tokens == 131072  # 3.1, 3.2
    # Code Llama's rotary base (16384 tokens): a SentencePiece model that is not Llama 2 is not guessed at
    assert trained_context(ModelArgs.from_dict({**TINY_LLAMA2, "rope_theta": 1e6}), llama2, ModelRecord()) is None


def test_max_seq_len_beyond_the_trained_context_is_refused_unless_asked_for(checkpoint, monkeypatch):
    monkeypatch.setattr(generation, "load_model", None)  # refused before loading: never called
    with pytest.raises(ValueError, match=r"^max_seq_len 5000 is beyond the 4096 tokens this model was trained for "
                                         r"\(Llama 2's\): past them its answers fall apart; pass --max_seq_len 4096 "
                                         r"or less, or set LLAMA_TP_ALLOW_LONG_CONTEXT=1 to take that risk$"):
        Llama.build(str(checkpoint), str(LLAMA2_TOKENIZER), max_seq_len=5000, max_batch_size=1)
    monkeypatch.undo()
    monkeypatch.setenv("LLAMA_TP_ALLOW_LONG_CONTEXT", "1")
    assert Llama.build(str(checkpoint), str(LLAMA2_TOKENIZER), max_seq_len=5000, max_batch_size=1).model


def test_a_converted_models_recorded_context_is_its_limit(checkpoint, tmp_path):
    converted = write_checkpoint(tmp_path / "converted", TINY_LLAMA2, full_weights(TINY_LLAMA2, 32000), 1, "dim")
    (converted / "llama_tp.json").write_text(json.dumps({"context_length": 64}))
    assert Llama.build(str(converted), str(LLAMA2_TOKENIZER), max_seq_len=64, max_batch_size=1).model
    with pytest.raises(ValueError, match=r"^max_seq_len 65 is beyond the 64 tokens this model was trained for \(its "
                                         r"llama_tp.json's context_length\)"):
        Llama.build(str(converted), str(LLAMA2_TOKENIZER), max_seq_len=65, max_batch_size=1)
    (converted / "llama_tp.json").write_text(json.dumps({"context_length": "long"}))
    with pytest.raises(ValueError, match="context_length must be a positive number of tokens or null, found 'long'"):
        Llama.build(str(converted), str(LLAMA2_TOKENIZER), max_seq_len=64, max_batch_size=1)


def test_weights_and_cache_that_do_not_fit_are_refused_before_loading_naming_the_numbers(checkpoint, monkeypatch):
    monkeypatch.setattr(generation, "load_model", None)  # refused before loading: never called
    monkeypatch.setattr(memory, "free_memory", lambda device: (10 * 2**20, "this machine"))  # 10 MiB free
    with pytest.raises(ValueError, match=r"^the weights and KV cache need 0.02 GiB \(0.02 \+ 0.00 for 64 tokens of "
                                         r"KV cache\), but this machine has 0.01 GiB free; lower --kv_cache_memory "
                                         r"\(or --max_seq_len or --max_batch_size, whose product it is by default\), "
                                         r"quantize \(--quantize int8 or int4\), or split the model over more machines$"):
        Llama.build(str(checkpoint), str(LLAMA2_TOKENIZER), max_seq_len=64, max_batch_size=1)


def test_on_cpu_the_processes_of_one_machine_share_its_memory(monkeypatch):
    plan = memory.plan(ModelArgs.from_dict(TINY_LLAMA2).with_vocab_size(32000), 1, 1, 64, "fp32")
    needed = plan.weight_bytes + plan.kv_cache_bytes
    monkeypatch.setattr(memory, "free_memory", lambda device: (3 * needed - 1, "this machine"))
    memory.check_fits(plan, torch.device("cpu"), processes_here=2)
    with pytest.raises(ValueError, match=r"need 3 processes x 0.02 GiB"):
        memory.check_fits(plan, torch.device("cpu"), processes_here=3)


def test_a_script_refuses_a_cache_larger_than_this_machine_before_loading(checkpoint):
    done = subprocess.run(
        [sys.executable, str(LAUNCH / "text_completion.py"), "--ckpt_dir", str(checkpoint), "--tokenizer_path",
         str(LLAMA2_TOKENIZER), "--max_seq_len", str(10**9)], cwd=PROJECT_ROOT, capture_output=True, text=True,
        env=subprocess_env(LLAMA_TP_ALLOW_LONG_CONTEXT="1", LLAMA_TP_LOG="warning"), timeout=120)
    assert done.returncode == 1
    assert done.stderr.startswith("llama_tp error on rank 0: the weights and KV cache need ")
    assert "GiB free; lower --kv_cache_memory (or --max_seq_len" in done.stderr and done.stderr.count("\n") == 1
