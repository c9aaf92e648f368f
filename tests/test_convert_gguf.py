"""GGUF pieces without the network: dequantisation per type, rope and ffn settings, KV sharding."""

import math
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter
from gguf.quants import quantize
from transformers.integrations.gguf.dequant import dequantize as transformers_dequantize

from llama_tp.args import ModelArgs
from llama_tp.tools.convert.gguf import dequantized, llama31_rope
from llama_tp.tools.convert.writer import ffn_params, shard_of
from llama_tp.text.tokenizer import load_tokenizer

ROWS, COLS = 4, 512  # two 256-value super-blocks per row for the K types
# Largest error of one quantised value for N(0, 1) data: about half a quantisation step.
ROUND_TRIP_TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 0.03, Q.Q4_0: 0.5, Q.Q4_1: 0.3}
# gguf can dequantise but not quantise these: random blocks, checked against transformers' dequantiser.
K_BLOCK = {Q.Q4_K: (144, (0, 2)), Q.Q6_K: (210, (208,))}  # bytes per block, offsets of its fp16 scales


def random_k_blocks(kind: Q, rows: int, cols: int, rng, scales: tuple[float, float]) -> np.ndarray:
    """Random K-quant blocks for a rows x cols tensor, with fp16 scales drawn from the range given."""
    block_bytes, scale_offsets = K_BLOCK[kind]
    blocks = rng.integers(0, 256, (rows * cols // 256, block_bytes), dtype=np.uint8)
    for offset in scale_offsets:  # random bytes there could be inf or NaN
        blocks[:, offset : offset + 2] = rng.uniform(*scales, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def written_and_read(tmp_path, data: np.ndarray, kind: Q):
    """data stored as one GGUF tensor of type kind, and that tensor read back from the file."""
    writer = GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    writer.add_tensor("t", data, raw_dtype=None if kind in (Q.F32, Q.F16) else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = GGUFReader(str(tmp_path / "t.gguf")).tensors
    assert tensor.tensor_type == kind
    return tensor


@pytest.mark.parametrize("kind", list(ROUND_TRIP_TOLERANCE), ids=lambda k: k.name)
def test_convert_gguf_dequantises_what_gguf_quantised(tmp_path, kind):
    values = np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(np.float32)
    stored = values.astype(np.float16) if kind == Q.F16 else values if kind == Q.F32 else quantize(values, kind)
    result = dequantized(written_and_read(tmp_path, stored, kind))
    assert result.shape == (ROWS, COLS) and result.dtype == torch.float32
    error = (result - torch.from_numpy(values)).abs().max().item()
    assert error <= ROUND_TRIP_TOLERANCE[kind]
    assert kind in (Q.F32, Q.F16, Q.BF16) or error > 0  # it really was quantised
    if kind in (Q.Q8_0, Q.Q4_0, Q.Q4_1):  # and the values are exactly the independent dequantiser's
        expected = transformers_dequantize(torch.from_numpy(stored.reshape(-1)), int(kind)).reshape(ROWS, COLS)
        torch.testing.assert_close(result, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", list(K_BLOCK), ids=lambda k: k.name)
def test_convert_gguf_dequantises_k_quants_as_transformers_does(tmp_path, kind):
    stored = random_k_blocks(kind, ROWS, COLS, np.random.default_rng(1), scales=(0.01, 0.1))
    result = dequantized(written_and_read(tmp_path, stored, kind))
    expected = transformers_dequantize(torch.from_numpy(stored.reshape(-1)), int(kind)).reshape(ROWS, COLS)
    assert result.shape == (ROWS, COLS) and result.abs().max() > 0
    torch.testing.assert_close(result, expected, atol=1e-6, rtol=0)


def llama_cpp_rope_divisors(args: ModelArgs, factor: float, high_freq_factor: float) -> torch.Tensor:
    """rope_freqs.weight as llama.cpp's converter computes it for Llama 3.1 (low_freq_factor 1, 8192)."""
    divisors = []
    for i in range(0, args.head_dim, 2):
        wavelen = 2 * math.pi * args.rope_theta ** (i / args.head_dim)
        if wavelen < 8192 / high_freq_factor:
            divisors.append(1.0)
        elif wavelen > 8192:
            divisors.append(factor)
        else:
            smooth = (8192 / wavelen - 1) / (high_freq_factor - 1)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(divisors)


def test_convert_gguf_reads_llama31_rope_scaling_from_rope_freqs():
    args = ModelArgs(dim=2048, n_layers=1, n_heads=32, rope_theta=500000.0)
    settings = llama31_rope(args, llama_cpp_rope_divisors(args, 32.0, 4.0), path="x.gguf")
    assert settings == {"use_scaled_rope": True, "rope_scaling_factor": 32.0, "rope_high_freq_factor": 4.0}
    with pytest.raises(ValueError, match="is not Llama 3.1's rope scaling"):
        llama31_rope(args, llama_cpp_rope_divisors(args, 32.0, 2.0), path="x.gguf")


@pytest.mark.parametrize("dim, hidden", [
    (576, 1536), (4096, 11008), (5120, 13824), (8192, 28672), (4096, 14336), (2048, 8192), (3072, 8192),
    (64, 200), (64, 171),
])  # SmolLM2-135M, Llama 2 7B/13B/70B, Llama 3 8B, 3.2 1B/3B, and sizes needing odd settings
def test_convert_ffn_params_reproduce_the_hidden_size(dim, hidden):
    params = ffn_params(dim, hidden)
    assert ModelArgs(dim=dim, n_layers=1, n_heads=1, **params).ffn_hidden_dim == hidden


def test_convert_replicates_kv_heads_when_ranks_outnumber_them():
    """4 ranks, 2 KV heads: ranks 0 and 1 hold KV head 0, ranks 2 and 3 head 1, as the model expects."""
    args = ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2)
    wk = torch.arange(2 * 8 * 32, dtype=torch.float32).view(16, 32)  # 2 heads of head_dim 8
    shards = [shard_of("layers.0.attention.wk.weight", wk, rank, 4, args) for rank in range(4)]
    assert [s.shape for s in shards] == [(8, 32)] * 4
    for rank, shard in enumerate(shards):
        assert torch.equal(shard, wk[8 * (rank // 2) : 8 * (rank // 2 + 1)])
    assert torch.equal(shard_of("layers.0.attention.wq.weight", wk.repeat(2, 1), 3, 4, args), wk[8:])


def test_convert_missing_extra_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if the package were not installed
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ModuleNotFoundError, match=r"needs the 'tokenizers' package \(the 'convert' extra\).*pip install --no-build-isolation -e \".*\[convert\]\""):
        load_tokenizer(str(tmp_path / "tokenizer.json"))
