"""Loading resharded keeps a rank's peak resident memory near its own slice, not the whole model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llama_tp.tools.reshard import reshard
from tiny_checkpoint import full_weights, write_checkpoint

TESTS = Path(__file__).resolve().parent
PROJECT_ROOT = TESTS.parent
# About 240 MB in bf16: large enough that the slice, not the interpreter, decides the peak.
# Rows of wo and w2 span one page or more, so a column slice touches (and must give back) every page.
BIG = {"dim": 2048, "n_layers": 2, "n_heads": 16, "vocab_size": 4096}
MB = 2**20
pytestmark = pytest.mark.slow  # processes loading a 240 MB checkpoint


def test_peak_rss_follows_the_slice(tmp_path):
    one = write_checkpoint(tmp_path / "mp1", BIG, full_weights(BIG, BIG["vocab_size"]), 1, "vocab")
    four = tmp_path / "mp4"
    reshard(one, four, 4)
    whole = (one / "consolidated.00.pth").stat().st_size
    env = os.environ | {"PYTHONPATH": str(PROJECT_ROOT), "OMP_NUM_THREADS": "1"}
    # Split one shard four ways (rank 1), and merge four shards into two (rank 0), side by side.
    jobs = {name: subprocess.Popen([sys.executable, str(TESTS / "peak_rss_probe.py"), str(ckpt), rank, world],
                                   cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for name, ckpt, rank, world in (("split", one, "1", "4"), ("merge", four, "0", "2"))}
    for name, job in jobs.items():
        stdout, stderr = job.communicate(timeout=120)
        assert job.returncode == 0, stderr
        report = json.loads(stdout)
        growth = report["peak"] - report["before"]
        assert abs(report["slice"] - whole * {"split": 0.25, "merge": 0.5}[name]) < 4 * MB
        message = f"{name}: peak grew {growth / MB:.0f} MB for a {report['slice'] / MB:.0f} MB slice of {whole / MB:.0f} MB"
        print(message)
        assert growth < 1.25 * report["slice"] + 16 * MB, message
        assert report["slice"] <= growth, message + " (less than the slice: nothing was measured)"
