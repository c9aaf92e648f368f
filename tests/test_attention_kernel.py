"""One new token's attention through our CPU kernel: scaled_dot_product_attention's result for
every grouping of query heads, head width and cache length, each row's positions in blocks its
table scatters over the pools, eager and compiled; the whole eager step (rotation, cache write,
attention) as the model's Python does it; and the model's one-token steps take it where it runs."""

import pytest
import torch
import torch.nn.functional as F

from llama_tp import Llama
from llama_tp.kernels import cpu_kernels
from llama_tp.model.kv_cache import BLOCK_POSITIONS, MAX_KERNEL_STEP_TOKENS, places
from llama_tp.model.rotary import apply_rotary

pytestmark = pytest.mark.skipif(not cpu_kernels.decoding_kernels_run_on(torch.device("cpu")),
                                reason="the kernel needs AVX-512 or AVX2")


def _pools(kv_heads, head_dim, blocks, generator):
    """Random pools of keys and values [1, kv_heads, blocks * BLOCK_POSITIONS, head_dim]."""
    return torch.randn(2, 1, kv_heads, blocks * BLOCK_POSITIONS, head_dim, generator=generator)


def _scattered_tables(batch, positions, generator):
    """Block tables [batch, blocks a row] for rows holding `positions` positions at most, each row's
    blocks scattered over a pool with blocks to spare (none in order), and the pool's block count."""
    blocks_per_row = max(positions) // BLOCK_POSITIONS + 1
    blocks = batch * blocks_per_row + 3
    order = torch.randperm(blocks, generator=generator)[: batch * blocks_per_row]
    return order.view(batch, blocks_per_row), blocks


def _row(pool, table, length):
    """A row's first `length` positions of a pool, through its block table: [kv heads, length, head_dim]."""
    return pool[0][:, places(table[None], torch.arange(length)[None])[0]]


def _attention_inputs(batch, heads, kv_heads, head_dim, positions, seed=0):
    """q [batch, heads, 1, head_dim], pools whose blocks the rows' tables scatter, the tables and the lengths."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, 1, head_dim, generator=generator) * 4  # some near-one-hot weights
    tables, blocks = _scattered_tables(batch, positions, generator)
    k_pool, v_pool = _pools(kv_heads, head_dim, blocks, generator)
    return q, k_pool, v_pool, tables, torch.tensor(positions)


def _expected_attention(q, k_pool, v_pool, tables, lengths):
    """scaled_dot_product_attention row by row, in double precision."""
    rows = [F.scaled_dot_product_attention(q[r : r + 1].double(), _row(k_pool, table, length)[None].double(),
                                           _row(v_pool, table, length)[None].double(), enable_gqa=True)
            for r, (table, length) in enumerate(zip(tables, lengths.tolist()))]
    return torch.cat(rows)


# 9 heads on 3 kv heads (the demo model's), one head per kv head, all heads on one; 17 and 33
# positions leave a tail of a register (16 or 8 lanes); 8 rows split between threads, each its own
# length; contexts of several blocks, attended in parts.
@pytest.mark.parametrize("batch, heads, kv_heads, head_dim, positions", [
    (1, 9, 3, 64, [1]), (1, 9, 3, 64, [17]), (8, 9, 3, 64, [60, 1, 33, 17, 2, 64, 5, 48]), (3, 4, 4, 48, [33] * 3),
    (2, 8, 1, 128, [16, 3]), (2, 4, 2, 16, [5, 5]), (3, 9, 3, 64, [65, 200, 128]),
])
def test_decode_attention_is_scaled_dot_product_attention(batch, heads, kv_heads, head_dim, positions):
    q, k_pool, v_pool, tables, lengths = _attention_inputs(batch, heads, kv_heads, head_dim, positions)
    got = cpu_kernels.decode_attention(q, k_pool, v_pool, tables, lengths, BLOCK_POSITIONS)
    assert got.shape == q.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _expected_attention(q, k_pool, v_pool, tables, lengths),
                               atol=2e-6, rtol=1e-5)


def test_scores_far_below_the_largest_weigh_nothing():
    q, k_pool, v_pool, tables, lengths = _attention_inputs(1, 2, 1, 16, [20])
    place = tables[0, 0] * BLOCK_POSITIONS + 3
    k_pool[0, 0, place] = q[0, 0, 0] * 100  # a score thousands above the others for head 0
    got = cpu_kernels.decode_attention(q, k_pool, v_pool, tables, lengths, BLOCK_POSITIONS)
    torch.testing.assert_close(got[0, 0, 0], v_pool[0, 0, place])
    assert torch.isfinite(got).all()


def test_decode_attention_refuses_positions_outside_the_tables_or_blocks_outside_the_pools():
    q, k_pool, v_pool, tables, _ = _attention_inputs(2, 4, 2, 16, [5, 5])
    with pytest.raises(RuntimeError, match="row 1: position 65 outside its block table"):
        cpu_kernels.decode_attention(q, k_pool, v_pool, tables, torch.tensor([5, 65]), BLOCK_POSITIONS)
    with pytest.raises(RuntimeError, match="row 0: block 9 outside the pools"):
        cpu_kernels.decode_attention(q, k_pool, v_pool, torch.tensor([[9], [2]]), torch.tensor([5, 5]), BLOCK_POSITIONS)


def test_compiled_decode_attention_calls_the_kernel_as_it_is():
    inputs = _attention_inputs(2, 9, 3, 64, [21, 70]) + (BLOCK_POSITIONS,)
    cpu_kernels.load_decoding_kernels()
    torch._dynamo.reset()
    compiled = torch.compile(cpu_kernels.decode_attention, fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(*inputs), cpu_kernels.decode_attention(*inputs))


# The demo model's grouping at one and three rows, one head per kv head, and the first position
# (attending to itself alone); rows at one position (Meta's schedule) or each at its own
# (continuous batching); contexts attended in parts (longer than a block), with a part of one
# position, beside contexts of one part.
@pytest.mark.parametrize("batch, heads, kv_heads, head_dim, positions", [
    (1, 9, 3, 64, [39]), (3, 9, 3, 64, [16, 16, 16]), (3, 9, 3, 64, [16, 0, 47]), (2, 4, 4, 16, [0, 0]),
    (2, 8, 2, 32, [47, 30]), (1, 9, 3, 64, [299]), (3, 9, 3, 64, [64, 10, 200]), (2, 8, 2, 32, [128, 63]),
])
def test_decode_step_rotates_caches_and_attends_as_the_model_does(batch, heads, kv_heads, head_dim, positions):
    generator = torch.Generator().manual_seed(2)
    qkv = torch.randn(batch, 1, (heads + 2 * kv_heads) * head_dim, generator=generator)
    angles = torch.rand(batch, 1, head_dim // 2, generator=generator) * 6.3
    turns = torch.stack([angles.cos(), angles.sin()], dim=-1)  # batch, 1, head_dim // 2, 2
    tables, blocks = _scattered_tables(batch, positions, generator)
    k_pool, v_pool = _pools(kv_heads, head_dim, blocks, generator)
    positions = torch.tensor(positions)

    q, k, v = (part.unflatten(-1, (-1, head_dim)) for part in qkv.split(
        (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1))  # batch, 1, heads, head_dim
    expected_k, expected_v = k_pool.clone(), v_pool.clone()
    where = places(tables, positions[:, None])[:, 0]  # batch
    expected_k[0, :, where] = apply_rotary(k, turns)[:, 0].transpose(0, 1)
    expected_v[0, :, where] = v[:, 0].transpose(0, 1)
    expected = _expected_attention(apply_rotary(q, turns).transpose(1, 2), expected_k, expected_v, tables, positions + 1)
    expected = expected.transpose(1, 2).reshape(batch, 1, heads * head_dim)

    got = cpu_kernels.decode_step_attention(qkv, turns, k_pool, v_pool, tables, positions, heads, BLOCK_POSITIONS)
    assert got.shape == (batch, 1, heads * head_dim)
    torch.testing.assert_close(got.double(), expected, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(k_pool, expected_k, atol=1e-6, rtol=1e-6)  # the other positions untouched
    assert torch.equal(v_pool, expected_v)
    one_turn = cpu_kernels.decode_step_attention(qkv, turns[:1], k_pool.clone(), v_pool.clone(), tables,
                                                 positions, heads, BLOCK_POSITIONS)  # one angle for every row
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
    tables, blocks = _scattered_tables(3, [300], generator)
    pools = _pools(kv_heads, head_dim, blocks, generator)
    positions = torch.tensor([start, 7, start + 30])
    together = cpu_kernels.decode_step_attention(qkv, turns, *pools.clone(), tables, positions, heads, BLOCK_POSITIONS)
    k_pool, v_pool = pools.clone()
    for t in range(tokens):  # row 0 alone, a token a step
        alone = cpu_kernels.decode_step_attention(qkv[:1, t : t + 1], turns[:1, t : t + 1], k_pool, v_pool,
                                                  tables[:1], positions[:1] + t, heads, BLOCK_POSITIONS)
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
