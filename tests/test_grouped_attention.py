"""Grouped-query attention under a mask with each KV head's query heads folded into the query axis
(model.folded_attention, what GPUs run so as to keep their fast kernels) equals attention to
repeated keys and values, and so does model.attend, what CPUs run."""

import pytest
import torch
import torch.nn.functional as F

from llama_tp.model.attention import attend, folded_attention


def reference(q, keys, values, mask):
    group = q.shape[1] // keys.shape[1]
    repeated = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, *repeated, attn_mask=mask, is_causal=mask is None and q.shape[2] > 1)


@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (8, 8), (6, 1), (4, 4)])
@pytest.mark.parametrize("seqlen, end", [(1, 9), (5, 12), (16, 16)])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_groups_equal_repeated_keys(heads, kv_heads, seqlen, end, per_row, dtype):
    generator = torch.Generator().manual_seed(seqlen * heads + kv_heads)
    bsz, head_dim = 3, 16
    q = torch.randn(bsz, seqlen, heads, head_dim, generator=generator, dtype=dtype).transpose(1, 2)  # as the model lays it out
    keys, values = (torch.randn(bsz, kv_heads, end, head_dim, generator=generator, dtype=dtype) for _ in range(2))
    starts = torch.tensor([end - seqlen, end - seqlen - 1, 0])[:, None] if per_row else torch.tensor([[end - seqlen]])
    positions = starts + torch.arange(seqlen)  # 1 or bsz, seqlen
    mask = torch.arange(end)[None, None, None, :] <= positions[:, None, :, None]  # 1 or bsz, 1, seqlen, end
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    expected = reference(q, keys, values, mask)
    torch.testing.assert_close(folded_attention(q, keys, values, mask), expected, **tolerance)
    torch.testing.assert_close(attend(q, keys, values, mask), expected, **tolerance)


def test_without_a_mask_a_prompt_is_causal():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 7, 16, generator=generator)
    keys, values = (torch.randn(2, 2, 7, 16, generator=generator) for _ in range(2))
    torch.testing.assert_close(attend(q, keys, values, None), reference(q, keys, values, None))
