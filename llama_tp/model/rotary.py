"""Rotary position embeddings: each position's angles (Llama 3.1's rescaling among them) and the
rotation of queries and keys by them."""

import math

import torch

from .args import ModelArgs


def rotary_frequencies(args: ModelArgs) -> torch.Tensor:
    """The rotation speed of each pair of channels in a head, [head_dim // 2], in fp32."""
    exponents = torch.arange(0, args.head_dim, 2)[: args.head_dim // 2].float() / args.head_dim
    freqs = 1.0 / (args.rope_theta**exponents)
    if args.use_scaled_rope:
        freqs = _llama31_scaled(freqs, args.rope_scaling_factor, args.rope_high_freq_factor,
                                args.rope_low_freq_factor, args.rope_original_context)
    return freqs


def _llama31_scaled(freqs: torch.Tensor, factor: float, high_freq_factor: float, low_freq_factor: float,
                    original_context: int) -> torch.Tensor:
    """Llama 3.1's rescaling: slow rotations stretched by factor, fast ones kept, a ramp between."""
    wavelen = 2 * math.pi / freqs
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    ramp = (1 - smooth) * freqs / factor + smooth * freqs
    scaled = torch.where(wavelen > original_context / low_freq_factor, freqs / factor, ramp)
    return torch.where(wavelen < original_context / high_freq_factor, freqs, scaled)


def rotary_table(args: ModelArgs, max_seq_len: int) -> torch.Tensor:
    """cos and sin of every position's angles: [max_seq_len, head_dim // 2, 2], fp32."""
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), rotary_frequencies(args))
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rotary(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (2i, 2i+1) of x [bsz, seqlen, heads, head_dim] by the angles of table
    [1 or bsz, seqlen, head_dim // 2, 2] (one for every row, or each row its own)."""
    pairs = x.float().unflatten(-1, (-1, 2))  # bsz, seqlen, heads, head_dim // 2, 2
    if torch.compiler.is_compiling():
        # Real arithmetic, which the compiler fuses into one kernel (it has none for complex numbers).
        even, odd = pairs[..., 0], pairs[..., 1]
        cos, sin = table[:, :, None, :, 0], table[:, :, None, :, 1]  # 1 or bsz, seqlen, 1, head_dim // 2
        rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
        return rotated.flatten(-2).type_as(x)
    # Eagerly, a pair is a complex number and the rotation one complex product: 2x faster for one
    # token and 8x for a 512-token prompt than the eight real operations above.
    turns = torch.view_as_complex(table)[:, :, None, :]  # 1 or bsz, seqlen, 1, head_dim // 2: cos + i sin
    return torch.view_as_real(torch.view_as_complex(pairs) * turns).flatten(-2).type_as(x)
