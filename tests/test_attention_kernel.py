"""One new token's attention through our CPU kernel: scaled_dot_product_attention's result for
every grouping of query heads, head width and cache length, eager and compiled; the whole eager
step (rotation, cache write, attention) as the model's Python does it; and the model's one-token
steps take it where it runs."""

import pytest
import torch
import torch.nn.functional as F

from llama_tp import Llama
from llama_tp.kernels import cpu_kernels
from llama_tp.model import apply_rotary

pytestmark = pytest.mark.skipif(not cpu_kernels.ON_THIS_CPU, reason="our kernels need AVX-512")


def _attention_inputs(batch, heads, kv_heads, head_dim, positions, cached=64, seed=0):
    """q [batch, heads, 1, head_dim], and keys and values as the cache hands them over: the first
    `positions` of a preallocated [batch, kv_heads, cached, head_dim]."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, 1, head_dim, generator=generator) * 4  # some near-one-hot weights
    cache = torch.randn(2, batch, kv_heads, cached, head_dim, generator=generator)
    return q, cache[0, :, :, :positions], cache[1, :, :, :positions]


# 9 heads on 3 kv heads (the demo model's), one head per kv head, all heads on one; 17 and 33
# positions leave a tail of a 16-lane register; 8 rows split between threads.
@pytest.mark.parametrize("batch, heads, kv_heads, head_dim, positions", [
    (1, 9, 3, 64, 1), (1, 9, 3, 64, 17), (8, 9, 3, 64, 60), (3, 4, 4, 48, 33), (2, 8, 1, 128, 16), (2, 4, 2, 16, 5),
])
def test_decode_attention_is_scaled_dot_product_attention(batch, heads, kv_heads, head_dim, positions):
    q, keys, values = _attention_inputs(batch, heads, kv_heads, head_dim, positions)
    expected = F.scaled_dot_product_attention(q.double(), keys.double(), values.double(), enable_gqa=True)
    got = cpu_kernels.decode_attention(q, keys, values)
    assert got.shape == q.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, atol=2e-6, rtol=1e-5)


def test_scores_far_below_the_largest_weigh_nothing():
    q, keys, values = _attention_inputs(1, 2, 1, 16, 20)
    keys[0, 0, 3] = q[0, 0, 0] * 100  # a score thousands above the others for head 0
    got = cpu_kernels.decode_attention(q, keys, values)
    torch.testing.assert_close(got[0, 0, 0], values[0, 0, 3])
    assert torch.isfinite(got).all()


def test_compiled_decode_attention_calls_the_kernel_as_it_is():
    q, keys, values = _attention_inputs(2, 9, 3, 64, 21)
    cpu_kernels.load()
    torch._dynamo.reset()
    compiled = torch.compile(cpu_kernels.decode_attention, fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(q, keys, values), cpu_kernels.decode_attention(q, keys, values))


# The demo model's grouping at one and three rows (a cache for four), one head per kv head, and
# the first position (attending to itself alone) and the cache's last.
@pytest.mark.parametrize("batch, heads, kv_heads, head_dim, end", [
    (1, 9, 3, 64, 40), (3, 9, 3, 64, 17), (2, 4, 4, 16, 1), (2, 8, 2, 32, 48),
])
def test_decode_step_rotates_caches_and_attends_as_the_model_does(batch, heads, kv_heads, head_dim, end):
    generator = torch.Generator().manual_seed(2)
    qkv = torch.randn(batch, 1, (heads + 2 * kv_heads) * head_dim, generator=generator)
    angles = torch.rand(1, head_dim // 2, generator=generator) * 6.3
    turns = torch.stack([angles.cos(), angles.sin()], dim=-1)  # 1, head_dim // 2, 2
    k_cache, v_cache = torch.randn(2, 4, kv_heads, 48, head_dim, generator=generator)

    q, k, v = (part.unflatten(-1, (-1, head_dim)) for part in qkv.split(
        (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1))  # batch, 1, heads, head_dim
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_k[:batch, :, end - 1] = apply_rotary(k, turns)[:, 0]
    expected_v[:batch, :, end - 1] = v[:, 0]
    expected = F.scaled_dot_product_attention(
        apply_rotary(q, turns).transpose(1, 2).double(), expected_k[:batch, :, :end].double(),
        expected_v[:batch, :, :end].double(), enable_gqa=True,
    ).transpose(1, 2).reshape(batch, 1, heads * head_dim)

    got = cpu_kernels.decode_step_attention(qkv, turns, k_cache, v_cache, end, heads)
    assert got.shape == (batch, 1, heads * head_dim)
    torch.testing.assert_close(got.double(), expected, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(k_cache, expected_k, atol=1e-6, rtol=1e-6)  # the other rows untouched
    assert torch.equal(v_cache, expected_v)


def test_the_model_attends_one_new_token_through_the_kernel(checkpoints, tokenizer_path, monkeypatch):
    """The tiny Llama 2's heads are 16 wide: its one-token steps take the kernel (and the
    incremental-decoding tests of test_model.py compare them with a full forward); a prompt does not."""
    calls = []
    kernel = cpu_kernels.decode_step_attention
    monkeypatch.setattr(cpu_kernels, "decode_step_attention", lambda *args: calls.append(args[0].shape) or kernel(*args))
    llama = Llama.build(str(checkpoints["llama2", 1]), tokenizer_path, max_seq_len=32, max_batch_size=2)
    tokens = torch.randint(0, 32000, (2, 6), generator=torch.Generator().manual_seed(1))
    llama.model.forward(tokens[:, :5], 0)
    assert calls == []
    step = llama.model.forward(tokens[:, 5:], 5)
    assert calls == [(2, 1, (4 + 2 * 4) * 16)] * 2  # one per layer: 4 query heads, 4 kv heads
    torch.testing.assert_close(step, llama.model.forward(tokens, 0)[:, 5:], atol=1e-5, rtol=1e-5)
