"""Our sampler kernel (sampler_kernel.cpp) beside torch's ops (test_sampler.py runs both on small
rows): the same tokens from the same generators on rows of a real vocabulary's size at a chat
model's settings, and a nucleus found by growing the candidates step by step."""

import os
import subprocess
import sys

import pytest
import torch

from llama_tp.sampling import sampler
from llama_tp.kernels import cpu_kernels
from llama_tp.sampling import SamplingOptions, distribution
from test_sampler import chi_square_p_value
from torchrun import ROOT, environment

pytestmark = pytest.mark.skipif(not cpu_kernels.decoding_kernels_run_on(torch.device("cpu")),
                                reason="the sampler kernel needs AVX-512 or AVX2")

VOCAB = 49152  # the demo model's


def chat_logits(rows: int) -> torch.Tensor:
    """Rows whose best few dozen tokens stand out, as a chat model's do."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, VOCAB, generator=generator) * 2.5
    logits[:, :40] += torch.rand(rows, 40, generator=generator) * 14
    return logits


def both_ways(logits, options, history=None, ban=None, monkeypatch=None):
    """The tokens through torch's ops and through the kernel, each row with its own seeded generator."""
    tokens = {}
    for use_kernel in (False, True):
        monkeypatch.setattr(sampler, "USE_KERNEL", use_kernel)
        generators = [torch.Generator().manual_seed(1000 + row) for row in range(len(options))]
        tokens[use_kernel] = sampler.choose(logits, options, generators, history, ban)
    return tokens[False], tokens[True]


def test_the_kernel_takes_the_tokens_torchs_ops_take_at_a_chat_models_settings(monkeypatch):
    settings = [SamplingOptions(temperature=0.7, top_p=0.9, repetition_penalty=1.1),
                SamplingOptions(temperature=1.0, top_p=0.95, top_k=40),
                SamplingOptions(temperature=0.8, top_p=1.0, min_p=0.05),
                SamplingOptions(temperature=0, repetition_penalty=1.3),
                SamplingOptions(temperature=0.6, top_p=0.9)]
    rows = 300
    options = [settings[row % len(settings)] for row in range(rows)]
    logits = chat_logits(rows)
    history = torch.randint(0, 60, (rows, 50), generator=torch.Generator().manual_seed(1))  # the best tokens
    history[:, 40:] = -1  # padding
    ban = torch.zeros(rows, VOCAB, dtype=torch.bool)
    ban[::7, logits[::7].argmax(dim=-1)] = True  # some rows may not take their best token
    by_torch, by_kernel = both_ways(logits, options, history, ban, monkeypatch)
    assert torch.equal(by_kernel, by_torch)
    assert len(set(by_kernel.tolist())) > 30  # draws, not always the best token


def test_a_nucleus_past_the_candidates_is_found_by_growing_them(monkeypatch):
    monkeypatch.setattr(sampler, "USE_KERNEL", True)
    monkeypatch.setattr(sampler, "NUCLEUS_CANDIDATES", 4)  # grown to 32, then to the whole 100
    sampler.step_options.cache_clear()
    try:
        logits = torch.linspace(3.0, -3.0, 100)  # no two alike
        for top_p in (0.5, 0.97):  # a nucleus of about 20 tokens, then of about 80
            options = SamplingOptions(temperature=1.0, top_p=top_p)
            tokens = sampler.choose(logits.repeat(20_000, 1), [options] * 20_000, torch.Generator().manual_seed(2))
            assert chi_square_p_value(tokens, distribution(logits[None], options)[0]) > 1e-3
    finally:
        sampler.step_options.cache_clear()


def test_a_top_k_beyond_the_candidates_is_refused():
    logits, history = torch.zeros(1, 10), torch.empty(1, 0, dtype=torch.long)
    settings = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    with pytest.raises(RuntimeError, match="top_k 5 is not within its 4 candidates"):
        cpu_kernels.sample_rows(logits, history, settings, torch.tensor([5]), torch.zeros(1, dtype=torch.float64), 4)


def test_rows_with_nothing_to_choose_take_token_0_and_leave_the_others_alone():
    """A row whose every logit is -inf (a grammar that allows nothing) or NaN has no token to
    weigh: the kernel answers 0 for it (the engine then ends that answer), greedy or sampled, and
    the other rows draw as they would alone."""
    vocab = 1000
    ordinary = torch.linspace(-3, 3, vocab)
    settings = torch.tensor([[1 / 0.7, 0.9, 0.0, 1.0], [0.0, 1.0, 0.0, 1.0], [1.0, 0.5, 0.0, 1.2], [1.0, 1.0, 0.0, 1.0]])
    top_k, uniform = torch.tensor([0, 0, 40, 0]), torch.full((4,), 0.5, dtype=torch.float64)
    history = torch.tensor([[3, 4, -1]] * 4)
    alone = cpu_kernels.sample_rows(ordinary.repeat(4, 1), history, settings, top_k, uniform, 256)
    for nothing in (float("-inf"), float("nan")):
        for row in range(4):
            logits = ordinary.repeat(4, 1)
            logits[row] = nothing
            tokens = cpu_kernels.sample_rows(logits, history, settings, top_k, uniform, 256)
            assert tokens[row] == 0
            assert torch.equal(tokens[torch.arange(4) != row], alone[torch.arange(4) != row])


@pytest.mark.slow
def test_rows_with_nothing_to_choose_under_bounds_checks_and_address_sanitizer(tmp_path):
    """The kernel built alone with libstdc++'s bounds checks and AddressSanitizer, on such rows:
    before, best_.back() on an empty list (a segfault in RowSampler::keep_best on every rank)."""
    asan = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    assert os.path.isabs(asan), f"gcc has no AddressSanitizer runtime: {asan!r}"
    env = environment() | {"LD_PRELOAD": asan, "ASAN_OPTIONS": "detect_leaks=0",
                           "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")}
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "checked_sampler.py"), str(tmp_path)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    # -inf: 0; one token allowed: it; greedy on -inf: 0; NaN: 0; ordinary: a token; +inf: it
    tokens = [int(token) for token in run.stdout.split()]
    assert tokens[:4] == [0, 5, 0, 0] and tokens[5] == 7, tokens
