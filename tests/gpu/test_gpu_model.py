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
def test_compiled_steps_equal_eager_ones_without_recompiles(wide_heads_checkpoint, tokenizer_path, quantize):
    """Compiled by default on CUDA: each step one CUDA graph of the ladder's rung, recorded at the
    warm-up for greedy and sampled steps; afterwards nothing compiles, whatever the batch size.
    Also with int8 (3 rows: read as stored) and int4 (tinygemm) layers."""
    torch._dynamo.reset()
    eager = build(wide_heads_checkpoint, tokenizer_path, dtype="fp32", quantize=quantize, compile=False)
    compiled = build(wide_heads_checkpoint, tokenizer_path, dtype="fp32", quantize=quantize)
    graphs = compiled.model.graphs[1]
    assert graphs.record and graphs.rungs == [1, 2, 3]
    expected = eager.generate(PROMPTS, max_gen_len=12, temperature=0, logprobs=True)
    compiled.model.warm_up_decoding()
    assert len(graphs.graphs) == 2 * len(graphs.rungs)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = compiled.generate(PROMPTS, max_gen_len=12, temperature=0, logprobs=True)
        got_one = compiled.generate(PROMPTS[1:2], max_gen_len=12, temperature=0)  # another batch size
    assert got[0] == expected[0] and got_one[0] == expected[0][1:2]
    for row, expected_row in zip(got[1], expected[1]):
        assert row == pytest.approx(expected_row, abs=1e-3)
    assert len(graphs.graphs) == 2 * len(graphs.rungs)


def test_speculation_verifies_through_a_recorded_step_with_eager_greedy_tokens(wide_heads_checkpoint, tokenizer_path):
    """Compiled by default on CUDA with speculation too: the target's verifying step of k + 1
    tokens a row is recorded at each rung beside its one-token step (the draft, here the target
    itself, has its own), and greedy tokens are eager decoding's without guesses."""
    torch._dynamo.reset()
    folder = str(wide_heads_checkpoint)
    expected = build(folder, tokenizer_path, dtype="fp32", compile=False).generate(PROMPTS, max_gen_len=12,
                                                                                 temperature=0)[0]
    llama = build(folder, tokenizer_path, dtype="fp32", speculate="draft", draft_ckpt_dir=folder, speculate_k=3)
    assert sorted(llama.model.graphs) == [1, 4] and llama.model.graphs[4].record
    llama.warm_up()
    assert len(llama.model.graphs[4].graphs) == 2 * 3  # 3 rungs, greedy and sampled heads
    assert llama.generate(PROMPTS, max_gen_len=12, temperature=0)[0] == expected
    assert llama.speculator.stats.accepted > 0 and len(llama.model.graphs[4].graphs) == 2 * 3


@pytest.mark.parametrize("max_seq_len", [64, 1000])
def test_whole_steps_on_staggered_rows_equal_eager_ones(wide_heads_checkpoint, tokenizer_path, max_seq_len):
    """Rows anywhere in the cache at their own positions, in steps of every size (a server's), as
    CUDA graphs reading each row's cache through a block mask: eager's logits, and the rows outside
    a step keep their caches; with a cache length that is not a whole number of blocks too."""
    options = dict(max_seq_len=max_seq_len, max_batch_size=5, dtype="fp32")
    eager = Llama.build(str(wide_heads_checkpoint), tokenizer_path, compile=False, **options).model
    compiled = Llama.build(str(wide_heads_checkpoint), tokenizer_path, **options).model
    compiled.warm_up_decoding()
    tokens = torch.randint(0, 32000, (5, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    for model in (eager, compiled):
        for slot, length in enumerate((6, 3, 20, 4, 2)):
            model.forward(tokens[slot : slot + 1, :length], 0, slots=[slot])
    steps = [([2, 0], [20, 6]), ([1], [3]), ([0, 1, 2], [7, 4, 21]), ([0, 2, 3, 4], [8, 22, 4, 2]),
             ([4, 3, 1, 0, 2], [3, 5, 5, 9, 23])]
    for slots, starts in steps:
        step_tokens = torch.stack([tokens[slot, start : start + 1] for slot, start in zip(slots, starts)])
        for vocab_slice in (True, False):
            got = compiled.forward(step_tokens, starts, slots=slots, vocab_slice=vocab_slice)
            want = eager.forward(step_tokens, starts, slots=slots, vocab_slice=vocab_slice)
            torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    for layer, eager_layer in zip(compiled.layers, eager.layers):
        torch.testing.assert_close(layer.attention.cache.k[:5, :, :24], eager_layer.attention.cache.k[:, :, :24])


def test_a_recorded_step_takes_in_prompt_chunks_beside_decoding_rows(wide_heads_checkpoint, tokenizer_path):
    """A server's step with prompt chunks (forward_segments) is one CUDA graph of the ladder's rung
    (mixed_step), recorded at the warm-up for both heads: prompt chunks in rows of 64 tokens, from
    any position, a last row's padding past max_seq_len, beside decoding rows or alone, more rows
    than a step takes in two steps, give eager passes' logits, and nothing compiles afterwards."""
    torch._dynamo.reset()
    options = dict(max_seq_len=200, max_batch_size=5, dtype="fp32")
    eager = Llama.build(str(wide_heads_checkpoint), tokenizer_path, compile=False, **options).model
    compiled = Llama.build(str(wide_heads_checkpoint), tokenizer_path, **options).model
    mixed = compiled.mixed_graphs
    assert mixed.record and mixed.rungs == [1, 2, 4, 5]
    tokens = torch.randint(0, 32000, (5, 200), generator=torch.Generator().manual_seed(8))
    for model in (eager, compiled):
        for slot, length in ((0, 10), (1, 70), (2, 5)):
            model.forward(tokens[slot : slot + 1, :length], 0, slots=[slot])
    compiled.warm_up_decoding()
    assert len(mixed.graphs) == 2 * len(mixed.rungs)

    def batch(slot, start, length):
        return tokens[slot : slot + 1, start : start + length], [start], [slot]

    def decoding(rows):
        return (torch.stack([tokens[slot, start : start + 1] for slot, start in rows]),
                [start for _, start in rows], [slot for slot, _ in rows])

    passes = [[batch(3, 0, 100), decoding([(0, 10), (1, 70)])], [batch(4, 0, 64), batch(3, 100, 37), decoding([(2, 5)])],
              [batch(4, 64, 130), batch(2, 7, 60)], [batch(0, 12, 188), batch(2, 67, 133), decoding([(1, 72), (3, 137)])]]  # 6 prompt rows: 2 steps
    with torch._dynamo.config.patch(error_on_recompile=True):
        for batches in passes:
            for vocab_slice in (True, False):
                got = compiled.forward_segments(batches, vocab_slice=vocab_slice)
                want = eager.forward_segments(batches, vocab_slice=vocab_slice)
                torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    assert len(mixed.graphs) == 2 * len(mixed.rungs)


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

