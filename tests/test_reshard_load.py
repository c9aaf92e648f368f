"""Any checkpoint on any number of processes: 1, 2 and 4 shards loaded at world sizes 1, 2 and 4
give the same logits and greedy tokens, for both embedding layouts and with KV heads copied."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llama_tp.model.args import ModelArgs
from meta_shards import meta_shards, write_shards
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, TINY_LLAMA3, full_weights

TESTS = Path(__file__).resolve().parent
PROJECT_ROOT = TESTS.parent
VOCAB = 32000  # the Llama 2 tokenizer's, which every checkpoint here is loaded with
CASES = {
    "llama2": (TINY_LLAMA2, "dim", True),
    "llama3": (TINY_LLAMA3, "vocab", True),
    "kv2": (TINY_LLAMA3 | {"n_kv_heads": 2}, "vocab", True),  # world size 4 copies each KV head to two ranks
    # 4 shards holding half a KV head each, as a tool that splits every tensor's rows evenly writes them
    "kv2_half_heads": (TINY_LLAMA3 | {"n_kv_heads": 2}, "vocab", False),
}
SHARD_COUNTS = (1, 2, 4)
WORLD_SIZES = (1, 2, 4)
# A worker process loading 12 checkpoints at three world sizes; test_reshard_plan.py checks the same
# slices in memory, fast.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[int, dict]:
    """{world size: {"case/shards": {"logits", "tokens"}}}, from one worker process for all of them."""
    root = tmp_path_factory.mktemp("reshard_load")
    checkpoints = {}
    for case, (params, layout, head_copies) in CASES.items():
        args = ModelArgs.from_dict(params).with_vocab_size(VOCAB)
        weights = full_weights(params, VOCAB, seed=1)
        for n in SHARD_COUNTS:
            shards = meta_shards(weights, args, layout, n, head_copies)
            checkpoints[f"{case}/{n}"] = str(write_shards(root / case / str(n), params, shards))
    manifest = root / "manifest.json"
    manifest.write_text(json.dumps({"checkpoints": checkpoints, "tokenizer": str(LLAMA2_TOKENIZER), "out": str(root)}))
    env = os.environ | {"PYTHONPATH": str(PROJECT_ROOT), "OMP_NUM_THREADS": "1"}
    job = subprocess.run([sys.executable, str(TESTS / "reshard_worker.py"), str(manifest)], cwd=PROJECT_ROOT,
                         env=env, capture_output=True, text=True, timeout=240)
    assert job.returncode == 0, job.stderr[-3000:]
    return {w: torch.load(root / f"world{w}.pt", weights_only=True) for w in WORLD_SIZES}


@pytest.mark.parametrize("case", CASES)
def test_same_logits_and_greedy_tokens_everywhere(results, case):
    reference = results[1][f"{case}/1"]
    assert reference["logits"].dtype == torch.float32 and reference["logits"].abs().max() > 0.1
    assert len(set(t for row in reference["tokens"] for t in row)) > 2, "a degenerate model proves little"
    for world_size in WORLD_SIZES:
        for n in SHARD_COUNTS:
            got = results[world_size][f"{case}/{n}"]
            label = f"{n} shards at world size {world_size}"
            assert got["tokens"] == reference["tokens"], label
            torch.testing.assert_close(got["logits"], reference["logits"], atol=1e-5, rtol=0, msg=label)
            # At one world size the slices are the same whatever the shard count: so is every bit.
            assert torch.equal(got["logits"], results[world_size][f"{case}/{world_size}"]["logits"]), label
