"""Load one rank's slice of a checkpoint as load_model does (without the model); print how much memory that took.

    python tests/peak_rss_probe.py CKPT_DIR RANK WORLD_SIZE

Prints JSON: resident bytes before loading, peak resident bytes after, and the slice's bytes.
Every tensor is read in full (as a forward pass would), so lazily mapped pages count too.
The peak is /proc/self/status's VmHWM, not getrusage's ru_maxrss: Linux folds the parent's
peak at fork into the child's ru_maxrss at exec, so a test process that just built a big
checkpoint would show up in this one's figure.
"""

import json
import sys
from pathlib import Path

import torch

from llama_tp.model.args import ModelArgs
from llama_tp.checkpoint import load_slice, open_checkpoint


def main(ckpt_dir: str, rank: int, world_size: int) -> None:
    ckpt_dir = Path(ckpt_dir)
    before = memory_status("VmRSS")
    checkpoint = open_checkpoint(ckpt_dir, ModelArgs.load(ckpt_dir / "params.json"))
    state = load_slice(checkpoint, rank, world_size, torch.device("cpu"))
    checksum = sum(float(t.sum()) for t in state.values())  # touch every byte of the slice
    peak = memory_status("VmHWM")
    slice_bytes = sum(t.numel() * t.element_size() for t in state.values())
    print(json.dumps({"before": before, "peak": peak, "slice": slice_bytes, "checksum": checksum}))


def memory_status(field: str) -> int:
    """A memory figure of this process from /proc/self/status, in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"/proc/self/status has no {field}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
