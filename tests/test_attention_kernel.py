"""One new token's attention through our CPU kernel: scaled_dot_product_attention's result for
every grouping of query heads, head width and cache length, eager and compiled; the whole eager
step (rotation, cache write, attention) as the model's Python does it; and the model's one-token
steps take it where it runs."""

import pytest
import torch
import torch.nn.functional as F

from llama_tp import Llama
from llama_tp.kernels import cpu_kernels
from llama_tp.kv_cache import MAX_KERNEL_STEP_TOKENS
from llama_tp.model import apply_rotary

pytestmark = pytest.mark.skipif(not cpu_kernels.decoding_kernels_run_on(torch.device("cpu")),
                                reason="the kernel needs AVX-512 or AVX2")


def _attention_inputs(batch, heads, kv_heads, head_dim, positions, cached=64, seed=0):
    """q [batch, heads, 1, head_dim], and preallocated caches [batch + 2, kv_heads, cached,
    head_dim] whose rows 2, 3, ... hold the batch's keys and values (rows elsewhere than 0..batch-1,
    as a server's batch sits), each row's first `positions[r]` positions filled."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, 1, head_dim, generator=generator) * 4  # some near-one-hot weights
    k_cache, v_cache = torch.randn(2, batch + 2, kv_heads, cached, head_dim, generator=generator)
    slots = torch.arange(2, batch + 2).flip(0)  # out of order too
    return q, k_cache, v_cache, slots, torch.tensor(positions)


def _expected_attention(q, k_cache, v_cache, slots, lengths):
    """scaled_dot_product_attention row by row, in double precision."""
    rows = [F.scaled_dot_product_attention(q[r : r + 1].double(), k_cache[slot : slot + 1, :, :length].double(),
                                           v_cache[slot : slot + 1, :, :length].double(), enable_gqa=True)
            for r, (slot, length) in enumerate(zip(slots.tolist(), lengths.tolist()))]
    return torch.cat(rows)


# 9 heads on 3 kv heads (the demo model's), one head per kv head, all heads on one; 17 and 33
# positions leave a tail of a register (16 or 8 lanes); 8 rows split between threads, each its own length.
@pytest.mark.parametrize("batch, heads, kv_heads, head_dim, positions", [
    (1, 9, 3, 64, [1]), (1, 9, 3, 64, [17]), (8, 9, 3, 64, [60, 1, 33, 17, 2, 64, 5, 48]), (3, 4, 4, 48, [33] * 3),
    (2, 8, 1, 128, [16, 3]), (2, 4, 2, 16, [5, 5]),
])
def test_decode_attention_is_scaled_dot_product_attention(batch, heads, kv_heads, head_dim, positions):
    q, k_cache, v_cache, slots, lengths = _attention_inputs(batch, heads, kv_heads, head_dim, positions)
    got = cpu_kernels.decode_attention(q, k_cache, v_cache, slots, lengths)
    assert got.shape == q.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _expected_attention(q, k_cache, v_cache, slots, lengths),
                               atol=2e-6, rtol=1e-5)


def test_scores_far_below_the_largest_weigh_nothing():
    q, k_cache, v_cache, slots, lengths = _attention_inputs(1, 2, 1, 16, [20])
    k_cache[2, 0, 3] = q[0, 0, 0] * 100  # a score thousands above the others for head 0
    got = cpu_kernels.decode_attention(q, k_cache, v_cache, slots, lengths)
    torch.testing.assert_close(got[0, 0, 0], v_cache[2, 0, 3])
    assert torch.isfinite(got).all()


def test_decode_attention_refuses_rows_outside_the_cache():
    q, k_cache, v_cache, slots, _ = _attention_inputs(2, 4, 2, 16, [5, 5])
    with pytest.raises(RuntimeError, match="row 1: cache row 2 or position 65 outside the cache"):
        cpu_kernels.decode_attention(q, k_cache, v_cache, slots, torch.tensor([5, 65]))
    with pytest.raises(RuntimeError, match="row 0: cache row 9"):
        cpu_kernels.decode_attention(q, k_cache, v_cache, torch.tensor([9, 2]), torch.tensor([5, 5]))


def test_compiled_decode_attention_calls_the_kernel_as_it_is():
    inputs = _attention_inputs(2, 9, 3, 64, [21, 4])
    cpu_kernels.load_decoding_kernels()
    torch._dynamo.reset()
    compiled = torch.compile(cpu_kernels.decode_attention, fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(*inputs), cpu_kernels.decode_attention(*inputs))


# The demo model's grouping at one and three rows (a cache for five), one head per kv head, and
# the first position (attending to itself alone) and the cache's last; rows at one position
# (Meta's schedule) or each at its own (continuous batching); contexts attended in parts (longer
# than kPartPositions, 64), with a part of one position, beside contexts of one part.
@pytest.mark.parametrize("batch, heads, kv_heads, head_dim, positions", [
    (1, 9, 3, 64, [39]), (3, 9, 3, 64, [16, 16, 16]), (3, 9, 3, 64, [16, 0, 47]), (2, 4, 4, 16, [0, 0]),
    (2, 8, 2, 32, [47, 30]), (1, 9, 3, 64, [299]), (3, 9, 3, 64, [64, 10, 200]), (2, 8, 2, 32, [128, 63]),
])
def test_decode_step_rotates_caches_and_attends_as_the_model_does(batch, heads, kv_heads, head_dim, positions):
    generator = torch.Generator().manual_seed(2)
    qkv = torch.randn(batch, 1, (heads + 2 * kv_heads) * head_dim, generator=generator)
    angles = torch.rand(batch, 1, head_dim // 2, generator=generator) * 6.3
    turns = torch.stack([angles.cos(), angles.sin()], dim=-1)  # batch, 1, head_dim // 2, 2
    capacity = max(48, max(positions) + 1)
    k_cache, v_cache = torch.randn(2, 5, kv_heads, capacity, head_dim, generator=generator)
    slots, positions = torch.tensor([4, 1, 2][:batch]), torch.tensor(positions)

    q, k, v = (part.unflatten(-1, (-1, head_dim)) for part in qkv.split(
        (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1))  # batch, 1, heads, head_dim
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_k[slots, :, positions] = apply_rotary(k, turns)[:, 0]
    expected_v[slots, :, positions] = v[:, 0]
    expected = _expected_attention(apply_rotary(q, turns).transpose(1, 2), expected_k, expected_v, slots, positions + 1)
    expected = expected.transpose(1, 2).reshape(batch, 1, heads * head_dim)

    got = cpu_kernels.decode_step_attention(qkv, turns, k_cache, v_cache, slots, positions, heads)
    assert got.shape == (batch, 1, heads * head_dim)
    torch.testing.assert_close(got.double(), expected, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(k_cache, expected_k, atol=1e-6, rtol=1e-6)  # the other rows untouched
    assert torch.equal(v_cache, expected_v)
    one_turn = cpu_kernels.decode_step_attention(qkv, turns[:1], k_cache.clone(), v_cache.clone(), slots,
                                                 positions, heads)  # one angle for every row: as Meta's schedule
    assert one_turn[:1].equal(got[:1])  # row 0's own angle


@pytest.mark.parametrize("start", [40, 120, 250], ids=["one part", "parts from the second token on", "parts"])
def test_a_steps_token_gets_the_bits_of_a_step_of_its_own_alone_or_among_other_rows(start):
    """Long contexts are attended in parts of absolute positions: a token's result depends on its
    position alone, not on the other tokens or rows of the step."""
    heads, kv_heads, head_dim, tokens = 9, 3, 64, 16
    generator = torch.Generator().manual_seed(3)
    qkv = torch.randn(3, tokens, (heads + 2 * kv_heads) * head_dim, generator=generator)
    angles = torch.rand(3, tokens, head_dim // 2, generator=generator) * 6.3
    turns = torch.stack([angles.cos(), angles.sin()], dim=-1)
    caches = torch.randn(2, 4, kv_heads, 300, head_dim, generator=generator)
    slots, positions = torch.tensor([2, 0, 3]), torch.tensor([start, 7, start + 30])
    together = cpu_kernels.decode_step_attention(qkv, turns, *caches.clone(), slots, positions, heads)
    k_cache, v_cache = caches.clone()
    for t in range(tokens):  # row 0 alone, a token a step
        alone = cpu_kernels.decode_step_attention(qkv[:1, t : t + 1], turns[:1, t : t + 1], k_cache, v_cache,
                                                  slots[:1], positions[:1] + t, heads)
        assert torch.equal(alone[0, 0], together[0, t])


def test_the_model_attends_steps_of_few_tokens_through_the_kernel(checkpoints, tokenizer_path, monkeypatch):
    """The tiny Llama 2's heads are 16 wide: its steps of up to MAX_KERNEL_STEP_TOKENS tokens take
    the kernel (and the incremental-decoding tests of test_model.py compare them with a full
    forward); a longer prompt does not."""
    calls = []
    kernel = cpu_kernels.decode_step_attention
    monkeypatch.setattr(cpu_kernels, "decode_step_attention", lambda *args: calls.append(args[0].shape) or kernel(*args))
    llama = Llama.build(str(checkpoints["llama2", 1]), tokenizer_path, max_seq_len=32, max_batch_size=2)
    tokens = torch.randint(0, 32000, (2, 24), generator=torch.Generator().manual_seed(1))
    llama.model.forward(tokens[:, :MAX_KERNEL_STEP_TOKENS + 1], 0)
    assert calls == []
    chunk = llama.model.forward(tokens[:, 17:21], 17)
    step = llama.model.forward(tokens[:, 21:22], 21)
    width = (4 + 2 * 4) * 16  # 4 query heads, 4 kv heads
    assert calls == [(2, 4, width)] * 2 + [(2, 1, width)] * 2  # one per layer
    full = llama.model.forward(tokens[:, :22], 0)
    torch.testing.assert_close(torch.cat([chunk, step], dim=1), full[:, 17:], atol=1e-5, rtol=1e-5)
