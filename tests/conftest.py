"""Shared fixtures: the real Llama 2 tokenizer and tiny random checkpoints in Meta's layout; CI's
settings (a derandomized Hypothesis, skips of kernel tests made failures where kernels must run)."""

import os
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from llama_tp.text.tokenizer import Tokenizer
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, TINY_LLAMA3, TINY_WIDE_HEADS, full_weights, write_checkpoint

# The suite runs on CPU with gloo wherever it runs, GPUs or not (and so do the processes it starts);
# tests/gpu/ asks for the GPUs itself.
os.environ["LLAMA_TP_DEVICE"] = "cpu"

VOCAB = 32000  # the Llama 2 tokenizer's, which every tiny checkpoint here is paired with

# HYPOTHESIS_PROFILE=ci (set by .ci/run): the same examples every run, so a red CI is reproducible.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# Every test that needs our kernels names the instruction sets they need in its skip reason
# ("AVX-512", or "AVX-512 or AVX2" for the quantized products, norm and attention). With LLAMA_TP_REQUIRE_KERNELS=1
# (set by .ci/run where a compiler is found), a skip that names this CPU's own is a failure: the
# kernels should have run, and a green run would otherwise hide that they did not.
KERNEL_SKIP = {"AVX512": "AVX-512", "AVX2": "AVX2"}.get(torch.backends.cpu.get_cpu_capability())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("LLAMA_TP_REQUIRE_KERNELS") == "1" and isinstance(report.longrepr, tuple):
        reason = report.longrepr[2]
        if KERNEL_SKIP is not None and KERNEL_SKIP in reason:
            report.outcome = "failed"
            report.longrepr = (f"{reason}, but LLAMA_TP_REQUIRE_KERNELS=1 says the kernels must run here: "
                               f"check that the CPU has {KERNEL_SKIP}, a C++ compiler is found and LLAMA_TP_CPU_KERNELS is not 0")


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


@pytest.fixture(scope="session")
def wide_heads_checkpoint(tmp_path_factory) -> Path:
    """One shard of TINY_WIDE_HEADS: heads wide enough for the GPU's decoding steps."""
    return write_checkpoint(tmp_path_factory.mktemp("wide-heads"), TINY_WIDE_HEADS,
                            full_weights(TINY_WIDE_HEADS, VOCAB), 1, "vocab")


@pytest.fixture(params=["torch's ops", "our kernel"])
def sampler_path(request, monkeypatch):
    """A sampler test twice: through torch's ops (what every device but a CPU with our kernels
    runs) and through sampler_kernel.cpp (CPUs with AVX-512 or AVX2)."""
    from llama_tp import sampler
    from llama_tp.kernels import cpu_kernels

    if request.param == "our kernel" and not cpu_kernels.decoding_kernels_run_on(torch.device("cpu")):
        pytest.skip("the sampler kernel needs AVX-512 or AVX2")
    monkeypatch.setattr(sampler, "USE_KERNEL", request.param == "our kernel")
    return request.param

