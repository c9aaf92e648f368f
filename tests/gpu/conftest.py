"""tests/gpu: what only a machine with CUDA GPUs can check (docs/gpu.md). Every test here skips
without CUDA, or without as many GPUs as it needs; the rest of the suite runs on CPU anyway."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite's helpers (distributed.py, ...)


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            needed = next((mark.args[0] for mark in item.iter_markers("gpus")), 1)
            if gpu_count() < needed:
                item.add_marker(pytest.mark.skip(
                    reason=f"needs {needed} CUDA GPU{'s' * (needed > 1)}, this machine has {gpu_count()}"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpus(n): needs n CUDA GPUs (tests/gpu)")


@pytest.fixture(autouse=True)
def on_gpus(monkeypatch):
    """The rest of the suite sets LLAMA_TP_DEVICE=cpu; here llama_tp takes the GPUs (and refuses
    to start without them), in this process and in the worlds it spawns."""
    monkeypatch.setenv("LLAMA_TP_DEVICE", "cuda")
