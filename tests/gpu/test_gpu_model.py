"""The model on a GPU: logits against the CPU's, bf16 greedy tokens across world sizes, compiled
steps (CUDA graphs) against eager ones and the load peak (int8 and int4 too:
test_gpu_quantized.py has the rest of them), attention through the fast kernels only."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from device_allocations import held_bytes
from distributed import run_world
from gpu_workers import PROMPTS, greedy
from llama_tp import Llama


def build(folder, tokenizer_path, **options) -> Llama:
    return Llama.build(str(folder), tokenizer_path, max_seq_len=64, max_batch_size=3, **options)


def test_gpu_logits_equal_the_cpus_in_fp32(checkpoints, tokenizer_path, monkeypatch):
    tokens = torch.tensor([PROMPTS[2]])
    on_gpu = build(checkpoints["llama3", 1], tokenizer_path, dtype="fp32", compile=False)
    assert on_gpu.model.output.weight.device.type == "cuda"
    gpu_logits = on_gpu.model.forward(tokens.cuda(), 0).cpu()
    monkeypatch.setenv("LLAMA_TP_DEVICE", "cpu")
    cpu_logits = build(checkpoints["llama3", 1], tokenizer_path, dtype="fp32").model.forward(tokens, 0)
    torch.testing.assert_close(gpu_logits, cpu_logits, atol=1e-3, rtol=1e-3)


@pytest.mark.gpus(2)
def test_bf16_greedy_tokens_are_the_same_at_world_sizes_1_and_2(checkpoints, tokenizer_path):
    folder = str(checkpoints["llama3", 2])
    one = run_world(1, greedy, folder, tokenizer_path, "bf16")
    two = run_world(2, greedy, folder, tokenizer_path, "bf16")
    assert two == one * 2


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_compiled_steps_equal_eager_ones_without_recompiles_or_cuda_graph_skips(checkpoints, tokenizer_path, quantize):
    """Also with int8 (3 rows: read as stored) and int4 (tinygemm) layers."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager = build(checkpoints["llama3", 1], tokenizer_path, dtype="fp32", quantize=quantize, compile=False)
    compiled = build(checkpoints["llama3", 1], tokenizer_path, dtype="fp32", quantize=quantize)  # compiled on CUDA
    assert compiled.model.static_decode_shapes
    expected = eager.generate(PROMPTS, max_gen_len=12, temperature=0, logprobs=True)
    compiled.generate(PROMPTS[:1], max_gen_len=2, temperature=0)  # warm-up
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = compiled.generate(PROMPTS, max_gen_len=12, temperature=0, logprobs=True)
        got_one = compiled.generate(PROMPTS[1:2], max_gen_len=12, temperature=0)  # another batch size
    assert got[0] == expected[0] and got_one[0] == expected[0][1:2]
    for row, expected_row in zip(got[1], expected[1]):
        assert row == pytest.approx(expected_row, abs=1e-3)
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_attention_never_needs_the_math_kernel(checkpoints, tokenizer_path, dtype):
    """Prompts, one-token steps, rows at different positions, several-token chunks after a cache
    (speculative verification, chunked prefill, prefix reuse): all through flash or memory-efficient
    attention; with the math kernel ruled out, a path that needs it raises. cuDNN's is left out
    (parallel.init): it builds a plan on the host for every new shape."""
    model = build(checkpoints["llama3", 1], tokenizer_path, dtype=dtype, compile=False).model
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    tokens = torch.randint(0, 32000, (3, 24), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        model.forward(tokens[:, :8], 0)  # a prompt from position 0
        model.forward(tokens[:, 8:9], 8)  # one token a row, every row alike
        model.forward(tokens[:, 9:10], [9, 7, 5])  # rows at their own positions
        model.forward(tokens[:, 10:14], [10, 8, 6])  # a chunk after a cache
        model.forward(tokens[:2, 14:15], [14, 12], slots=[2, 0])  # rows anywhere in the cache


@pytest.mark.parametrize("dtype, quantize", [("fp32", None), ("bf16", None), ("bf16", "int8"), ("bf16", "int4")])
def test_loading_peaks_within_the_weights_and_the_kv_cache(checkpoints, tokenizer_path, dtype, quantize):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    llama = build(checkpoints["llama3", 2], tokenizer_path, dtype=dtype, quantize=quantize, compile=False)
    caches = sum(layer.attention.cache.k.nbytes * 2 for layer in llama.model.layers)
    peak = torch.cuda.max_memory_allocated() - before
    assert peak <= 1.1 * held_bytes(llama.model) + caches + (1 << 20), (peak, held_bytes(llama.model), caches)

