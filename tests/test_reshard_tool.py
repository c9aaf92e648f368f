"""The offline reshard tool: round trips give back the original tensors; it never clobbers by accident."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llama_tp.checkpoint import load_shard, shard_paths
from llama_tp.tools.reshard import reshard
from tiny_checkpoint import TINY_LLAMA2, TINY_LLAMA3, full_weights, write_checkpoint

PROJECT_ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "llama2": (TINY_LLAMA2, "dim"),
    "llama3": (TINY_LLAMA3 | {"vocab_size": 512}, "vocab"),
    "kv2": (TINY_LLAMA3 | {"n_kv_heads": 2, "vocab_size": 512}, "vocab"),  # 4 shards hold copied KV heads
}


def read_all(directory: Path) -> list[dict[str, torch.Tensor]]:
    return [dict(load_shard(path)) for path in shard_paths(directory)]


@pytest.mark.parametrize("case", CASES)
def test_round_trip_1_4_2_1(tmp_path, case):
    params, layout = CASES[case]
    original = write_checkpoint(tmp_path / "mp1", params, full_weights(params, 512), 1, layout)
    (original / "tokenizer.model").write_bytes(b"any tokenizer file travels with the shards")
    (original / "llama_tp.json").write_text('{"chat_format": "chatml"}')  # as the converters write it
    reshard(original, tmp_path / "mp4", 4)
    reshard(tmp_path / "mp4", tmp_path / "mp2", 2)
    reshard(tmp_path / "mp2", tmp_path / "back", 1)
    (before,), (after,) = read_all(original), read_all(tmp_path / "back")
    assert before.keys() == after.keys()
    for name in before:
        assert before[name].dtype == after[name].dtype and torch.equal(before[name], after[name]), name
    assert len(read_all(tmp_path / "mp4")) == 4
    for name in ("params.json", "tokenizer.model", "llama_tp.json"):
        assert (tmp_path / "back" / name).read_bytes() == (original / name).read_bytes()
    assert not list((tmp_path / "back").glob("*.tmp"))


def test_shards_hold_only_their_slice(tmp_path):
    params, layout = CASES["kv2"]
    source = write_checkpoint(tmp_path / "mp1", params, full_weights(params, 512), 1, layout)
    reshard(source, tmp_path / "mp4", 4)
    whole = sum(path.stat().st_size for path in shard_paths(source))
    # Replicated norms and copied KV heads add a little; a saved view would add a whole tensor.
    assert all(path.stat().st_size < 0.3 * whole for path in shard_paths(tmp_path / "mp4"))


def test_refuses_to_overwrite_without_force(tmp_path):
    params, layout = CASES["llama3"]
    source = write_checkpoint(tmp_path / "mp2", params, full_weights(params, 512), 2, layout)
    reshard(source, tmp_path / "out", 4)
    with pytest.raises(ValueError, match=r"DST_DIR .*out is not empty; pass --force"):
        reshard(source, tmp_path / "out", 1)
    with pytest.raises(ValueError, match="is SRC_DIR"):
        reshard(source, source, 1, force=True)
    with pytest.raises(ValueError, match="cannot be split over 3 processes"):
        reshard(source, tmp_path / "three", 3)
    reshard(source, tmp_path / "out", 1, force=True)
    assert [p.name for p in shard_paths(tmp_path / "out")] == ["consolidated.00.pth"]  # old shards 01-03 gone


@pytest.mark.slow  # a Python process of its own; reshard() is tested in this one above
def test_command_line(tmp_path):
    params, layout = CASES["llama2"]
    source = write_checkpoint(tmp_path / "mp1", params, full_weights(params, 512), 1, layout)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("not empty")
    env = os.environ | {"PYTHONPATH": str(PROJECT_ROOT)}
    command = [sys.executable, "-m", "llama_tp.reshard", str(source), str(tmp_path / "full"), "--mp", "2", "--force"]
    done = subprocess.run(command, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "1 -> 2 shards" in done.stderr and "2/2" in done.stderr  # the progress bar, on stderr
    assert done.stdout.strip() == f"wrote 2 shards to {tmp_path / 'full'}"
    assert len(shard_paths(tmp_path / "full")) == 2
