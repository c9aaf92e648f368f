"""RMSNorm: our one-pass CPU kernel gives F.rms_norm's result, and the model takes it eagerly only."""

import pytest
import torch
import torch.nn.functional as F

from llama_tp.kernels import cpu_kernels
from llama_tp.model.norm import RMSNorm

needs_kernel = pytest.mark.skipif(not cpu_kernels.decoding_kernels_run_on(torch.device("cpu")),
                                  reason="the kernel needs AVX-512 or AVX2")


# 37: two AVX-512 registers and a tail of 5 (four AVX2 ones and 5); 130 rows: split between threads.
@needs_kernel
@pytest.mark.parametrize("shape", [(1, 1, 576), (8, 1, 576), (3, 5, 37), (130, 64)])
def test_our_rms_norm_is_torch_s(shape):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator) * 3
    weight = torch.randn(shape[-1], generator=generator)
    expected = F.rms_norm(x.double(), (shape[-1],), weight.double(), 1e-5)
    got = cpu_kernels.rms_norm(x, weight, 1e-5)
    assert got.shape == x.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=1e-5)


@needs_kernel
def test_the_model_norm_takes_our_kernel_eagerly_and_torch_s_compiled(monkeypatch):
    calls = []
    kernel = cpu_kernels.rms_norm
    monkeypatch.setattr(cpu_kernels, "rms_norm", lambda *args: calls.append(1) or kernel(*args))
    norm = RMSNorm(64, eps=1e-6)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(1))
    eager = norm(x)
    assert calls == [1]
    torch._dynamo.reset()
    compiled = torch.compile(norm, fullgraph=True)(x)
    assert calls == [1]
    torch.testing.assert_close(eager, compiled, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(eager, F.rms_norm(x, (64,), norm.weight, 1e-6), atol=1e-6, rtol=1e-5)
