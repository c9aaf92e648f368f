"""params/ files and the memory planner: Meta's published sizes, and figures equal to what is allocated."""

import json
import runpy
import sys

import pytest
import torch

from llama_tp import Llama
from llama_tp.model.args import ModelArgs
from llama_tp.model.memory import params_per_rank, plan
from llama_tp.tools.plan import main as plan_main
from llama_tp.tools.reshard import reshard
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, TINY_LLAMA3, full_weights, write_checkpoint
from torchrun import ROOT

PARAMS = ROOT / "params"
# Parameter counts Meta and Hugging Face publish (Llama 3.2 counts its output matrix separately
# from the embedding, as Meta's checkpoints store both).
KNOWN_COUNTS = {
    "llama-2-7b": 6_738_415_616, "llama-2-13b": 13_015_864_320, "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248, "llama-3.1-8b": 8_030_261_248, "llama-3-70b": 70_553_706_496,
    "llama-3.1-70b": 70_553_706_496, "llama-3.1-405b": 405_853_388_800,
    "llama-3.2-1b": 1_235_814_400 + 128_256 * 2048, "llama-3.2-3b": 3_212_749_824 + 128_256 * 3072,
}


def load(name: str) -> ModelArgs:
    args = ModelArgs.load(PARAMS / f"{name}.json")
    return args.with_vocab_size(32000) if args.vocab_size == -1 else args


def test_every_params_file_loads_and_the_real_ones_have_their_published_size():
    names = sorted(path.stem for path in PARAMS.glob("*.json"))
    assert names == sorted([*KNOWN_COUNTS, "tiny-llama2", "tiny-llama3"])
    for name, count in KNOWN_COUNTS.items():
        assert params_per_rank(load(name), 1) == count, name
    assert load("llama-3.2-1b").rope_scaling_factor == 32.0 and load("llama-3.1-8b").rope_scaling_factor == 8.0
    assert json.loads((PARAMS / "tiny-llama2.json").read_text()) == TINY_LLAMA2
    assert json.loads((PARAMS / "tiny-llama3.json").read_text()) == TINY_LLAMA3


@pytest.mark.parametrize("params, layout, world_size", [(TINY_LLAMA2, "dim", 2), (TINY_LLAMA3, "vocab", 4)])
def test_per_rank_parameters_equal_a_shard(tmp_path, params, layout, world_size):
    write_checkpoint(tmp_path, params, full_weights(params, 32000), world_size, layout)
    shard = torch.load(tmp_path / "consolidated.00.pth", weights_only=True)
    stored = sum(t.numel() for name, t in shard.items() if name != "rope.freqs")
    assert params_per_rank(ModelArgs.from_dict(params).with_vocab_size(32000), world_size) == stored


def test_plan_matches_the_built_model_and_build_prints_it(tmp_path, capsys):
    write_checkpoint(tmp_path, TINY_LLAMA3, full_weights(TINY_LLAMA3, 32000), 1, "vocab")
    llama = Llama.build(str(tmp_path), str(LLAMA2_TOKENIZER), max_seq_len=32, max_batch_size=3)
    printed = capsys.readouterr().err  # the library logs on stderr
    memory = plan(llama.model.args, 1, 3, 32, torch.float32)
    assert memory.weight_bytes == sum(p.numel() * p.element_size() for p in llama.model.parameters())
    caches = [layer.attention.cache for layer in llama.model.layers]
    assert memory.kv_cache_bytes == sum(c.k.nbytes + c.v.nbytes for c in caches)
    assert "Memory per process (1 process, 4-byte weights, batch 3 x 32 tokens)" in printed
    assert printed.index("Memory per process") < printed.index("Loaded in")


def test_planner_command_line(monkeypatch, capsys):
    """python -m llama_tp.plan, run in this process (a subprocess would only add the import time)."""
    monkeypatch.setattr(sys, "argv", ["plan", "--params", str(PARAMS / "llama-2-70b.json"), "--world_size", "8",
                                      "--max_batch_size", "4", "--max_seq_len", "4096"])
    runpy.run_module("llama_tp.plan", run_name="__main__")
    printed = capsys.readouterr().out
    assert "weights       16.06 GiB  (8.62 billion of 68.98 billion parameters)" in printed
    assert "KV cache       0.63 GiB  (80 layers x 1 KV head here)" in printed  # 4 x 4096 positions and a scratch block
    assert "8 divides the 64 query heads, 8 KV heads" in printed


def test_planner_names_the_world_sizes_that_work_and_exits_1(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["plan", "--params", str(PARAMS / "llama-2-70b.json"), "--world_size", "3"])
    with pytest.raises(SystemExit) as exit:
        runpy.run_module("llama_tp.plan", run_name="__main__")
    assert exit.value.code == 1
    printed = capsys.readouterr()
    assert "3 processes cannot split this model" in printed.out
    assert "world sizes that work: 1, 2, 4, 8, 16, 32, 64\n" in printed.out
    assert printed.err == ("llama_tp error on rank 0: this model cannot be split over 3 processes (64 query heads, "
                           "8 KV heads, ffn size 28672, vocabulary 32000); world sizes that work: 1, 2, 4, 8, 16, "
                           "32, 64\n")


def test_planner_defaults_are_the_chat_scripts_and_memory_gib_is_checked(monkeypatch, capsys):
    """As the README runs it: no --max_seq_len (the scripts' 512) nor --max_batch_size (4)."""
    monkeypatch.setattr(sys, "argv", ["plan", "--params", str(PARAMS / "llama-2-70b.json"), "--world_size", "8"])
    runpy.run_module("llama_tp.plan", run_name="__main__")
    assert "batch 4 x 512 tokens" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["plan", "--params", str(PARAMS / "llama-2-70b.json"), "--world_size", "8",
                                      "--memory_gib", "16"])
    with pytest.raises(SystemExit) as exit:
        runpy.run_module("llama_tp.plan", run_name="__main__")
    assert exit.value.code == 1
    assert capsys.readouterr().err == (
        "llama_tp error on rank 0: the weights and KV cache need 16.14 GiB a process, more than --memory_gib 16; "
        "use more processes, --quantize int8 or int4, or a smaller --max_seq_len or --max_batch_size\n")



def test_int8_plan_matches_the_built_model_and_build_prints_it(tmp_path, capsys):
    """An int8 checkpoint loads as int8 unasked, and build's plan says so and counts its bytes."""
    write_checkpoint(tmp_path / "bf16", TINY_LLAMA3, full_weights(TINY_LLAMA3, 32000), 1, "vocab")
    reshard(tmp_path / "bf16", tmp_path / "int8", 1, quantize="int8")
    capsys.readouterr()
    for folder, quantize in ((tmp_path / "int8", None), (tmp_path / "bf16", "int8")):
        llama = Llama.build(str(folder), str(LLAMA2_TOKENIZER), max_seq_len=32, max_batch_size=3, quantize=quantize)
        memory = plan(llama.model.args, 1, 3, 32, torch.float32, "int8")
        assert memory.weight_bytes == sum(t.nbytes for t in llama.model.state_dict().values())
        assert "(1 process, int8 linear layers, other 4-byte weights, batch 3 x 32 tokens)" in capsys.readouterr().err


def test_planner_counts_int4_layers_and_their_int8_head(capsys):
    """0.625 bytes per block weight (half a byte, fp16 scales and mins per 32), the output head 1.25."""
    plan_main(str(PARAMS / "llama-2-7b.json"), world_size=1, max_batch_size=1, max_seq_len=128, quantize="int4")
    printed = capsys.readouterr().out
    assert "int4 linear layers (the output head int8), other 2-byte weights" in printed
    args = load("llama-2-7b")
    head = args.vocab_size * args.dim
    blocks = params_per_rank(args, 1) - 2 * head - (2 * args.n_layers + 1) * args.dim  # less embedding, head, norms
    expected = plan(args, 1, 1, 128, "bf16").weight_bytes - 2 * (blocks + head) + blocks * 5 // 8 + head * 5 // 4
    assert plan(args, 1, 1, 128, "bf16", "int4").weight_bytes == expected
