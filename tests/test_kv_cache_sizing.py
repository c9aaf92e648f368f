"""How big the KV cache's pool is (model/memory.py, Llama.build): --kv_cache_memory where given; on a
CPU max_batch_size x max_seq_len positions; on a GPU --kv_cache_fraction of the memory free once
the weights are loaded, less a pass's activations, the same on every rank. There is no GPU here:
torch.cuda's answers and the choice of the device's rule are faked."""

import logging

import pytest
import torch

from llama_tp import Llama, generation
from llama_tp.model import memory
from llama_tp.model.args import ModelArgs
from llama_tp.model.kv_cache import BLOCK_POSITIONS, blocks_for
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, full_weights, write_checkpoint

GIB = memory.GIB


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("sizing") / "tp1", TINY_LLAMA2, full_weights(TINY_LLAMA2, 32000),
                            1, "dim")


def llama_2_7b(max_batch_size: int = 16, max_seq_len: int = 1024) -> memory.MemoryPlan:
    args = ModelArgs.load("params/llama-2-7b.json").with_vocab_size(32000)
    return memory.plan(args, 1, max_batch_size, max_seq_len, "bf16")


def test_free_gpu_memory_is_what_torch_cuda_says_after_emptying_its_cache(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: calls.append(device) or (70 * GIB, 80 * GIB))
    assert memory.free_memory(torch.device("cuda", 1)) == (70 * GIB, "GPU 1")
    assert calls == ["empty_cache", torch.device("cuda", 1)]
    assert memory.sizes_cache_from_free_memory(torch.device("cuda", 0))
    assert not memory.sizes_cache_from_free_memory(torch.device("cpu"))


def test_the_share_of_free_memory_is_whole_blocks_beside_the_activations_and_the_scratch_block():
    plan = llama_2_7b()
    assert plan.position_bytes == 2 * 32 * 32 * 128 * 2  # K and V, 32 layers, 32 heads of 128, bf16: 0.5 MiB
    assert plan.activation_bytes == 512 * (2 * 4 * 32000 + 3 * 2 * 11008)  # 165 MB
    free = 125 * GIB  # an H200 after 13.5 GB of weights
    positions = plan.positions_free(free, 0.9)
    assert positions % BLOCK_POSITIONS == 0
    sized = memory.cache_in_free_memory(plan, free, "GPU 0", 0.9)
    assert sized.kv_cache_positions == positions == 230_016  # 3594 blocks
    # the pool and its scratch block fit in the share, and another block would not
    assert sized.kv_cache_bytes + plan.activation_bytes <= 0.9 * free
    assert sized.kv_cache_bytes + plan.activation_bytes + BLOCK_POSITIONS * plan.position_bytes > 0.9 * free
    assert sized.describe_cache() == "230016 tokens of KV cache: about 224.6 conversations of max_seq_len 1024"
    assert plan.positions_free(free, 0.5) < positions


def test_free_memory_that_cannot_hold_one_sequence_is_refused_naming_the_numbers():
    plan = llama_2_7b(max_seq_len=4096)
    with pytest.raises(ValueError, match=r"^after loading the weights GPU 0 has 2.00 GiB free, whose share for the KV "
                                         r"cache \(--kv_cache_fraction 0.9, less 0.15 GiB for activations\) holds 3264 "
                                         r"tokens, fewer than one sequence of max_seq_len 4096; lower --max_seq_len, "
                                         r"quantize \(--quantize int8 or int4\), raise --kv_cache_fraction, or split "
                                         r"the model over more GPUs$"):
        memory.cache_in_free_memory(plan, 2 * GIB, "GPU 0", 0.9)


@pytest.mark.parametrize("fraction", [0, 1.5, -0.1, True, "0.9"])
def test_a_fraction_outside_zero_to_one_is_refused_before_loading(checkpoint, monkeypatch, fraction):
    monkeypatch.setattr(generation, "load_model", None)  # refused before loading: never called
    with pytest.raises(ValueError, match=r"kv_cache_fraction must be a number in \(0, 1\], the share of the GPU "
                                         rf"memory free after loading that the KV cache takes, found {fraction!r}"):
        Llama.build(str(checkpoint), str(LLAMA2_TOKENIZER), max_seq_len=64, max_batch_size=2,
                    kv_cache_fraction=fraction)


@pytest.fixture
def gpu_rule(monkeypatch):
    """Llama.build on this CPU sizing the cache as on a GPU, from free memory that is `free` bytes
    once the weights are loaded (and, before, the machine's, for the check that they fit)."""
    events = []
    load_model = generation.load_model

    def loading(*args, **kwargs):
        events.append("loaded")
        return load_model(*args, **kwargs)

    def free_memory(device):
        events.append("measured")
        return (state["free"] if "loaded" in events else 64 * GIB), "GPU 0"

    state = {"free": 0, "events": events}
    monkeypatch.setattr(generation, "sizes_cache_from_free_memory", lambda device: True)
    monkeypatch.setattr(generation, "load_model", loading)
    monkeypatch.setattr(generation, "free_memory", free_memory)
    monkeypatch.setattr(memory, "free_memory", free_memory)
    return state


def test_on_a_gpu_the_cache_takes_its_share_of_what_is_free_after_the_weights(checkpoint, gpu_rule, caplog):
    caplog.set_level(logging.INFO, "llama_tp")
    plan = memory.plan(ModelArgs.from_dict(TINY_LLAMA2).with_vocab_size(32000), 1, 2, 256, "fp32")
    gpu_rule["free"] = plan.activation_bytes + 100 * BLOCK_POSITIONS * plan.position_bytes  # 100 blocks, and the margin
    llama = Llama.build(str(checkpoint), str(LLAMA2_TOKENIZER), max_seq_len=256, max_batch_size=2,
                        kv_cache_fraction=1.0)
    assert gpu_rule["events"] == ["measured", "loaded", "measured"]  # checked before loading, sized after
    assert llama.model.cache_blocks == 99  # and the scratch block
    assert "6336 tokens of KV cache: about 24.8 conversations of max_seq_len 256" in caplog.messages
    gpu_rule["free"] = 2 * (plan.activation_bytes + 40 * BLOCK_POSITIONS * plan.position_bytes)
    half = Llama.build(str(checkpoint), str(LLAMA2_TOKENIZER), max_seq_len=256, max_batch_size=2, kv_cache_fraction=0.5)
    assert half.model.cache_blocks == 39
    # --kv_cache_memory says it all: free memory is not asked again
    gpu_rule["events"].clear()
    given = Llama.build(str(checkpoint), str(LLAMA2_TOKENIZER), max_seq_len=256, max_batch_size=2,
                        kv_cache_memory=10 * BLOCK_POSITIONS * plan.position_bytes / GIB)
    assert given.model.cache_blocks == 10 and gpu_rule["events"] == ["measured", "loaded"]


def test_on_a_gpu_too_little_free_after_the_weights_is_refused(checkpoint, gpu_rule):
    gpu_rule["free"] = 10**6
    with pytest.raises(ValueError, match=r"^after loading the weights GPU 0 has 0.00 GiB free, .* holds 0 tokens, "
                                         r"fewer than one sequence of max_seq_len 256"):
        Llama.build(str(checkpoint), str(LLAMA2_TOKENIZER), max_seq_len=256, max_batch_size=2)


def test_on_a_cpu_the_default_is_every_row_at_max_seq_len(checkpoint):
    llama = Llama.build(str(checkpoint), str(LLAMA2_TOKENIZER), max_seq_len=200, max_batch_size=3)
    assert llama.model.cache_blocks == 3 * blocks_for(200)
