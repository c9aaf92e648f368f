"""Shared fixtures: the real Llama 2 tokenizer and tiny random checkpoints in Meta's layout."""

import os
from pathlib import Path

import pytest

from llama_tp.text.tokenizer import Tokenizer
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, TINY_LLAMA3, full_weights, write_checkpoint

# The suite runs on CPU with gloo wherever it runs, GPUs or not (and so do the processes it starts);
# tests/gpu/ asks for the GPUs itself.
os.environ["LLAMA_TP_DEVICE"] = "cpu"

VOCAB = 32000  # the Llama 2 tokenizer's, which every tiny checkpoint here is paired with


@pytest.fixture(scope="session")
def tokenizer_path() -> str:
    if not LLAMA2_TOKENIZER.is_file():
        raise FileNotFoundError(f"{LLAMA2_TOKENIZER} is missing: shared/ must sit beside the project")
    return str(LLAMA2_TOKENIZER)


@pytest.fixture(scope="session")
def llama2_tokenizer(tokenizer_path) -> Tokenizer:
    """The real Llama 2 tokenizer, loaded once."""
    return Tokenizer(tokenizer_path)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[tuple[str, int], Path]:
    """{(family, n_shards): folder} for Llama 2 (dim-split embedding) and Llama 3 style (vocab-split)."""
    root = tmp_path_factory.mktemp("checkpoints")
    folders = {}
    for family, params, layout in (("llama2", TINY_LLAMA2, "dim"), ("llama3", TINY_LLAMA3, "vocab")):
        weights = full_weights(params, VOCAB)
        for n_shards in (1, 2, 4):
            folders[family, n_shards] = write_checkpoint(
                root / f"{family}-mp{n_shards}", params, weights, n_shards, layout
            )
    return folders
