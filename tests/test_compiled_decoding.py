"""A compiled decoding step computes what the eager one does, and its shapes suit CUDA graphs."""

from typing import Optional

import pytest
import torch

from distributed import run_world
from kv_rows import by_row
from job_answers import greedy_answers
from llama_tp import Llama, parallel
from llama_tp.model import transformer
from llama_tp.parallel.group import DecodeCompilation

PROMPTS = [[1, 450, 4996, 17354, 1701], [1, 306, 4658], [1, 18637, 29892, 3186, 29991, 910, 338]]


def build(folder: str, tokenizer_path: str, compile: bool, quantize: Optional[str] = None,
          max_batch_size: int = 3, max_seq_len: int = 32) -> Llama:
    return Llama.build(folder, tokenizer_path, max_seq_len=max_seq_len, max_batch_size=max_batch_size,
                       compile=compile, quantize=quantize)


def step_logits(llama: Llama) -> dict[int, list[torch.Tensor]]:
    """By batch size: a prompt, then one-token steps, at batch 3 (if the model takes it) and, on a
    fresh cache, at batch 1."""
    tokens = torch.randint(0, 32000, (3, 12), generator=torch.Generator().manual_seed(3))
    logits = {}
    if llama.model.max_batch_size >= 3:
        logits[3] = [llama.model.forward(tokens[:, :5], 0)]
        logits[3] += [llama.model.forward(tokens[:, pos : pos + 1], pos) for pos in range(5, 12)]
    logits[1] = [llama.model.forward(tokens[:1, :3], 0)]
    logits[1] += [llama.model.forward(tokens[:1, pos : pos + 1], pos) for pos in range(3, 8)]
    return logits


def generations(folder: str, tokenizer_path: str, compile: bool, quantize: Optional[str] = None,
                max_batch_size: int = 3) -> tuple:
    """On each rank: step logits, greedy tokens with log probabilities, and seeded samples."""
    llama = build(folder, tokenizer_path, compile, quantize, max_batch_size)
    greedy = llama.generate(PROMPTS, max_gen_len=8, temperature=0, logprobs=True)
    sampled, _ = llama.generate(PROMPTS, max_gen_len=8, temperature=0.8, seed=7)
    return step_logits(llama), greedy, sampled


def assert_same(results: tuple, expected: tuple) -> None:
    for batch, logits in results[0].items():
        for got, want in zip(logits, expected[0][batch], strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert_same_greedy(results, expected)
    assert results[2] == expected[2]  # seeded samples


def assert_same_greedy(results: tuple, expected: tuple) -> None:
    (tokens, logprobs), (expected_tokens, expected_logprobs) = results[1], expected[1]
    assert tokens == expected_tokens
    for row, expected_row in zip(logprobs, expected_logprobs):
        assert row == pytest.approx(expected_row, abs=1e-4)


@pytest.fixture(scope="module")
def eager(checkpoints, tokenizer_path):
    """Eager results by max_batch_size (which decides how seeded samples draw), each made once."""
    made = {}

    def results(max_batch_size: int = 3) -> tuple:
        if max_batch_size not in made:
            made[max_batch_size] = generations(str(checkpoints["llama3", 1]), tokenizer_path, False, None,
                                               max_batch_size)
        return made[max_batch_size]

    return results


@pytest.mark.slow
@pytest.mark.parametrize("max_batch_size", [1, 3])
def test_compiled_decoding_equals_eager(checkpoints, tokenizer_path, eager, max_batch_size):
    """Up to matmul.SUMMED_MAX_ROWS rows the compiler makes the products itself from plain weights;
    for larger batches they stay oneDNN's, on packed weights."""
    torch._dynamo.reset()
    assert_same(generations(str(checkpoints["llama3", 1]), tokenizer_path, True, None, max_batch_size),
                eager(max_batch_size))


@pytest.mark.slow
def test_compiled_decoding_over_two_processes_equals_one_eager_process(checkpoints, tokenizer_path, eager):
    """The exchanges inside compiled steps, at batch 3 and 1; how products are made at
    max_batch_size 1 does not depend on the world size, and the test above covers it."""
    per_rank = run_world(2, generations, str(checkpoints["llama3", 2]), tokenizer_path, True)
    for results in per_rank:
        assert_same(results, eager())


@pytest.mark.slow
@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_compiled_quantized_decoding_equals_eager(checkpoints, tokenizer_path, eager, quantize):
    """Compiled steps run the same int8 and int4 kernels as eager ones, fused with the operations
    around them: the logits may differ by fp32 rounding, a hundredth of what the weights' own
    rounding moves them, and greedy choices not at all (a seeded sample on this random model's
    flat distributions may)."""
    folder = str(checkpoints["llama3", 1])
    eager_quantized = generations(folder, tokenizer_path, compile=False, quantize=quantize)
    torch._dynamo.reset()
    compiled = generations(folder, tokenizer_path, compile=True, quantize=quantize)
    for batch in (3, 1):
        for got, want, fp32 in zip(compiled[0][batch], eager_quantized[0][batch], eager()[0][batch], strict=True):
            assert (got - want).abs().max() <= 0.01 * (want - fp32).abs().max()
    assert_same_greedy(compiled, eager_quantized)


# Whole steps compiled on CPU through AOTAutograd alone: Inductor's code for FlexAttention on CPUs
# cannot read the queries where a step of one row leaves them (a view of the rotation's output),
# and GPUs run Triton's instead (tests/gpu).
CPU_BACKEND = "aot_eager"


def whole_steps(folder: str, tokenizer_path: str, max_batch_size: int = 3, **compile_options) -> Llama:
    """A model whose one-token steps run as on a GPU (decode_step at the ladder's sizes, through
    block masks), compiled as compile_options say, without CUDA graphs (the CPU has none)."""
    llama = build(folder, tokenizer_path, compile=False, max_batch_size=max_batch_size)
    llama.model.compile_decoding(graphs=True, **compile_options)
    assert llama.model.whole_steps
    return llama


@pytest.mark.slow
def test_whole_steps_compile_one_step_for_every_position(wide_heads_checkpoint, tokenizer_path, monkeypatch):
    """The GPU's step (each row reading its cache through a block mask, at the ladder's sizes)
    gives eager decoding's logits, and every one-token step at a batch size reuses one compiled
    graph: nothing depends on the position, nor on which group of layers runs (one layer a group
    here, so two groups)."""
    torch._dynamo.reset()
    monkeypatch.setattr(transformer, "MAX_LAYERS_PER_CALL", 1)
    expected = step_logits(build(str(wide_heads_checkpoint), tokenizer_path, compile=False))
    llama = whole_steps(str(wide_heads_checkpoint), tokenizer_path, dynamic=False, backend=CPU_BACKEND)
    assert len(llama.model.decode_layer_groups) == 2
    torch._dynamo.utils.counters.clear()
    logits = step_logits(llama)
    assert logits.keys() == expected.keys()
    for batch in logits:
        for got, want in zip(logits[batch], expected[batch], strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # A group's graph and the head's, for batch 3 (the rung of 3 rows) and batch 1, however many
    # positions were stepped through.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 4


@pytest.mark.slow
def test_whole_steps_serve_staggered_rows_without_recompiling(wide_heads_checkpoint, tokenizer_path):
    """Rows anywhere in the cache, each at its own position, in batches of any size (a server's
    steps, speculation after a row ends): after the warm-up, the GPU's step layout never compiles
    again, and its logits are eager decoding's; rows outside a step keep their caches, and the
    padding rows write only the spare cache row."""
    torch._dynamo.reset()
    folder = str(wide_heads_checkpoint)
    eager_model = build(folder, tokenizer_path, compile=False, max_batch_size=5).model
    compiled = whole_steps(folder, tokenizer_path, max_batch_size=5, dynamic=False, backend=CPU_BACKEND).model
    assert compiled.graphs[1].rungs == [1, 2, 4, 5]
    tokens = torch.randint(0, 32000, (5, 20), generator=torch.Generator().manual_seed(5))
    prompts = [(0, 0, 6), (1, 0, 3), (2, 0, 9), (3, 0, 4), (4, 0, 2)]  # cache row, start, length
    for model_ in (eager_model, compiled):
        for slot, start, length in prompts:
            model_.forward(tokens[slot : slot + 1, start : start + length], start, slots=[slot])
    compiled.warm_up_decoding()
    steps = [([2, 0], [9, 7]), ([1], [3]), ([0, 1, 2], [8, 4, 10]), ([2, 1], [11, 5]), ([1], [6]),
             ([0, 2, 3, 4], [9, 12, 4, 2]), ([4, 3, 1, 0, 2], [3, 5, 7, 10, 13])]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for slots, starts in steps:
            step_tokens = torch.stack([tokens[slot, start : start + 1] for slot, start in zip(slots, starts)])
            got = compiled.forward(step_tokens, starts, slots=slots)
            want = eager_model.forward(step_tokens, starts, slots=slots)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for layer, eager_layer in zip(compiled.layers, eager_model.layers):
        torch.testing.assert_close(by_row(layer.attention.cache.k, compiled)[:5, :, :14],
                                   by_row(eager_layer.attention.cache.k, eager_model)[:, :, :14])


@pytest.mark.slow
def test_whole_verifying_steps_give_eager_logits_without_recompiling(wide_heads_checkpoint, tokenizer_path,
                                                                     monkeypatch):
    """Speculation's verifying passes (a row's last token and its guesses, padded to verify_width)
    run whole as one-token steps do, at the ladder's sizes (up to VERIFY_MAX_ROWS rows, more in
    parts), each token reading its row's blocks up to its own position: after the warm-up nothing
    compiles again, each pass's logits are eager decoding's at every position, and rows outside a
    pass keep their caches."""
    torch._dynamo.reset()
    monkeypatch.setattr(transformer, "VERIFY_MAX_ROWS", 4)
    folder = str(wide_heads_checkpoint)
    eager_model = build(folder, tokenizer_path, compile=False, max_batch_size=5, max_seq_len=128).model
    compiled = build(folder, tokenizer_path, compile=False, max_batch_size=5, max_seq_len=128).model
    compiled.compile_decoding(graphs=True, verify_width=4, dynamic=False, backend=CPU_BACKEND)
    assert sorted(compiled.graphs) == [1, 4] and compiled.graphs[1].rungs == [1, 2, 4, 5]
    assert compiled.graphs[4].rungs == [1, 2, 4]  # a pass of 5 rows: 4, then 1
    tokens = torch.randint(0, 32000, (5, 96), generator=torch.Generator().manual_seed(6))
    prompts = [(0, 70), (1, 3), (2, 9), (3, 63), (4, 2)]  # cache row, length: rows 0 and 3 cross a block's end
    for model_ in (eager_model, compiled):
        for slot, length in prompts:
            model_.forward(tokens[slot : slot + 1, :length], 0, slots=[slot])
    compiled.warm_up_decoding()
    passes = [([0, 3], [69, 62]), ([1], [2]), ([2, 4, 1], [8, 1, 5]), ([3, 0, 2, 4, 1], [65, 72, 11, 4, 8])]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for slots, starts in passes:
            feed = torch.stack([tokens[slot, start : start + 4] for slot, start in zip(slots, starts)])
            got = compiled.forward(feed, starts, slots=slots)
            want = eager_model.forward(feed, starts, slots=slots)
            assert got.shape == (len(slots), 4, 32000)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for layer, eager_layer in zip(compiled.layers, eager_model.layers):
        torch.testing.assert_close(by_row(layer.attention.cache.k, compiled)[:5, :, :76],
                                   by_row(eager_layer.attention.cache.k, eager_model)[:, :, :76])
    assert compiled.padded_width(3, [10, 20]) == 4  # guesses fewer than the width: padded to it
    assert compiled.padded_width(3, [compiled.max_seq_len - 3]) == 3  # no room for the width's padding
    assert compiled.padded_width(6, [0]) == 6  # more than the width: eagerly


def test_a_step_runs_at_the_next_rung_with_spare_rows_padding(wide_heads_checkpoint, tokenizer_path):
    """A step of b rows runs at the ladder's next size: the step function sees that many rows, the
    spare ones in the spare cache row at position 0, and the caller gets its b rows' logits."""
    llama = whole_steps(str(wide_heads_checkpoint), tokenizer_path, max_batch_size=6, backend="eager")
    graphs = llama.model.graphs[1]
    assert graphs.rungs == [1, 2, 4, 6] and graphs.rung(3) == 4 and graphs.rung(5) == 6
    seen = []
    step = graphs.step
    graphs.step = lambda tokens, slots, positions, key: seen.append((slots.tolist(), positions.tolist())) or step(
        tokens, slots, positions, key)
    logits = llama.model.forward(torch.tensor([[5], [7], [9]]), [3, 1, 2], slots=[4, 0, 2])
    assert seen == [([4, 0, 2, 6], [3, 1, 2, 0])] and logits.shape == (3, 1, 32000)
    assert llama.model.spare_slot == 6 and llama.model.block_tables.tables.shape[0] == 7


@pytest.mark.slow
def test_a_warmed_up_step_compiles_nothing_more_for_greedy_or_sampled_rows(wide_heads_checkpoint, tokenizer_path):
    """launch/serve.py warms the compiled step up before it says it serves: afterwards neither a
    greedy step (the vocabulary slice) nor a sampled one (the whole vocabulary) compiles, and the
    warm-up leaves no cache row holding anything."""
    torch._dynamo.reset()
    compiled = whole_steps(str(wide_heads_checkpoint), tokenizer_path, dynamic=False, backend=CPU_BACKEND).model
    compiled.warm_up_decoding()
    assert compiled.prefix_cache.rows[0] == []
    tokens = torch.randint(0, 32000, (1, 7), generator=torch.Generator().manual_seed(2))
    compiled.forward(tokens[:, :5], 0, slots=[1])  # a prompt: eager, as prompts are
    torch._dynamo.utils.counters.clear()
    for position, vocab_slice in ((5, True), (6, False)):
        compiled.forward(tokens[:, position : position + 1], position, last_only=True, vocab_slice=vocab_slice,
                         slots=[1])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0


@pytest.mark.parametrize("n_layers, size", [(30, 10), (32, 8), (80, 10), (22, 2), (7, 7), (13, 1)])
def test_layers_per_call_splits_the_layers_into_equal_groups(n_layers, size):
    assert transformer.layers_per_call(n_layers) == size


@pytest.mark.slow
def test_a_compiled_draft_speculates_with_the_eager_targets_greedy_tokens(checkpoints, tokenizer_path, eager):
    """With speculation on a CPU, compile=True compiles the int8 draft's steps; the target's passes
    stay eager (our kernels), so greedy tokens are eager decoding's exactly."""
    torch._dynamo.reset()
    llama = Llama.build(str(checkpoints["llama2", 1]), tokenizer_path, max_seq_len=32, max_batch_size=3,
                        compile=True, speculate="draft", draft_quantize="int8")
    assert llama.model.run_decode_layers is transformer.run_layers  # the target: eager
    assert llama.speculator.draft.model.run_decode_layers is not transformer.run_layers
    plain = Llama.build(str(checkpoints["llama2", 1]), tokenizer_path, max_seq_len=32, max_batch_size=3)
    expected = plain.generate(PROMPTS, max_gen_len=16, temperature=0)[0]
    assert llama.generate(PROMPTS, max_gen_len=16, temperature=0)[0] == expected
    assert llama.speculator.stats.accepted > 0


@pytest.mark.slow
def test_where_steps_run_whole_speculation_verifies_through_a_compiled_step(wide_heads_checkpoint, tokenizer_path,
                                                                            monkeypatch):
    """Where compiled steps run whole (a GPU's CUDA graphs; here the same steps, without graphs),
    compile=True with speculation compiles the target's one-token step and its verifying step of
    k + 1 tokens a row (and the draft's steps): every round verifies through the latter, and greedy
    tokens are those of eager decoding without guesses; the warm-up compiles them all. The draft
    is the target itself, so that its guesses are accepted and rounds run to the end."""
    torch._dynamo.reset()
    monkeypatch.setattr(parallel, "steps_run_whole", lambda device: True)
    monkeypatch.setattr(parallel, "decode_compilation",
                        lambda device: DecodeCompilation({"dynamic": False, "backend": CPU_BACKEND}, graphs=True))
    folder = str(wide_heads_checkpoint)
    llama = Llama.build(folder, tokenizer_path, max_seq_len=64, max_batch_size=3, compile=True, speculate="draft",
                        draft_ckpt_dir=folder, speculate_k=3)
    assert sorted(llama.model.graphs) == [1, 4] and sorted(llama.speculator.draft.model.graphs) == [1]
    widths = []
    for width, graphs in llama.model.graphs.items():
        graphs.run = lambda *args, width=width, run=graphs.run: widths.append(width) or run(*args)
    plain = Llama.build(folder, tokenizer_path, max_seq_len=64, max_batch_size=3)
    expected = plain.generate(PROMPTS, max_gen_len=16, temperature=0)[0]
    prepared = []
    for model in (llama.model, llama.speculator.draft.model):
        for width, graphs in model.graphs.items():
            graphs.prepare = lambda keys, at=(model is llama.model, width), prepare=graphs.prepare: (
                prepared.append(at) or prepare(keys))
    llama.warm_up()  # as launch/serve.py does
    assert sorted(prepared) == [(False, 1), (True, 1), (True, 4)]  # the draft's step, the target's two
    torch._dynamo.utils.counters.clear()
    assert llama.generate(PROMPTS, max_gen_len=16, temperature=0)[0] == expected
    assert widths.count(4) >= 4 and llama.speculator.stats.accepted > 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0  # all compiled in the warm-up


def whole_mixed_steps(folder: str, tokenizer_path: str, max_batch_size: int, max_seq_len: int, backend: str):
    """A model whose steps run whole and take in prompt chunks (compile_decoding's mix_prompts)."""
    model = build(folder, tokenizer_path, compile=False, max_batch_size=max_batch_size, max_seq_len=max_seq_len).model
    model.compile_decoding(graphs=True, mix_prompts=True, dynamic=False, backend=backend)
    assert model.mixed_prompt_rows == transformer.MIXED_PROMPT_ROWS == 5 and model.can_mix_batches
    return model


@pytest.mark.slow
def test_whole_steps_take_in_prompt_chunks_beside_decoding_rows(wide_heads_checkpoint, tokenizer_path):
    """A server's step with prompt chunks (forward_segments) runs as one whole step where steps run
    whole: prompt chunks of any length from any position, in rows of BLOCK_POSITIONS tokens (a
    chunk's rows seeing each other's keys, a last row's padding past max_seq_len), beside decoding
    rows or alone, give eager passes' logits, more prompt rows than a step takes going on in a
    step of their own; after the warm-up nothing compiles, and the caches hold eager's keys
    wherever the rows wrote theirs, the padding writing none of them."""
    torch._dynamo.reset()
    folder = str(wide_heads_checkpoint)
    eager_model = build(folder, tokenizer_path, compile=False, max_batch_size=5, max_seq_len=200).model
    compiled = whole_mixed_steps(folder, tokenizer_path, 5, 200, CPU_BACKEND)
    tokens = torch.randint(0, 32000, (5, 200), generator=torch.Generator().manual_seed(8))
    for model_ in (eager_model, compiled):
        for slot, length in ((0, 10), (1, 70), (2, 5)):
            model_.forward(tokens[slot : slot + 1, :length], 0, slots=[slot])
    compiled.warm_up_decoding()
    runs = []
    compiled.mixed_graphs.run = lambda *args, run=compiled.mixed_graphs.run: runs.append(len(args[1])) or run(*args)

    def batch(slot: int, start: int, length: int) -> tuple[torch.Tensor, list[int], list[int]]:
        return tokens[slot : slot + 1, start : start + length], [start], [slot]

    def decoding(rows: list[tuple[int, int]]) -> tuple[torch.Tensor, list[int], list[int]]:
        return (torch.stack([tokens[slot, start : start + 1] for slot, start in rows]),
                [start for _, start in rows], [slot for slot, _ in rows])

    passes = [
        [batch(3, 0, 100), decoding([(0, 10), (1, 70)])],  # a chunk of two rows beside decoding rows
        [batch(4, 0, 64), batch(3, 100, 37), decoding([(2, 5)])],  # a row ending a block; one from mid-block
        [batch(3, 137, 1), decoding([(0, 11), (2, 6), (1, 71)])],  # a prompt's last token alone
        [batch(4, 64, 130), batch(2, 7, 60)],  # prompts alone; a last row's padding past max_seq_len (194 + 62)
        [batch(0, 12, 188), batch(2, 67, 133), decoding([(1, 72)])],  # chunks to the cache's end: 6 rows, 2 steps
    ]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for batches in passes:
            got = compiled.forward_segments(batches)
            want = eager_model.forward_segments(batches)
            assert got.shape == (sum(len(tokens) for tokens, _, _ in batches), 1, 32000)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert runs == [2, 1, 4, 0, 1, 0]  # one whole step a pass (two for six rows), the first with the one-token rows
    written = [(0, 200), (1, 73), (2, 200), (3, 138), (4, 194)]  # each row's positions written
    for layer, eager_layer in zip(compiled.layers, eager_model.layers):
        for slot, end in written:
            for pool, eager_pool in ((layer.attention.cache.k, eager_layer.attention.cache.k),
                                     (layer.attention.cache.v, eager_layer.attention.cache.v)):
                torch.testing.assert_close(by_row(pool, compiled)[slot, :, :end],
                                           by_row(eager_pool, eager_model)[slot, :, :end], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_where_steps_run_whole_the_engine_takes_in_prompts_in_the_whole_step_that_decodes_the_others(
        wide_heads_checkpoint, tokenizer_path, monkeypatch):
    """Where compiled steps run whole (a GPU's CUDA graphs; here the same steps, without graphs),
    compile=True without speculation compiles the step that takes in prompt chunks too, and the
    warm-up compiles it: a batch job whose rows free at different steps takes later prompts in
    beside the generating rows, each such step one whole step, nothing compiling after the warm-up,
    and every greedy answer is the prompt's alone, eagerly."""
    torch._dynamo.reset()
    monkeypatch.setattr(parallel, "steps_run_whole", lambda device: True)
    monkeypatch.setattr(parallel, "decode_compilation",
                        lambda device: DecodeCompilation({"dynamic": False, "backend": CPU_BACKEND}, graphs=True))
    folder = str(wide_heads_checkpoint)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 32000, (length,), generator=generator).tolist() for length in (3, 17, 5, 70, 8, 2)]
    lengths = [4, 9, 2, 12, 6, 3]
    plain = Llama.build(folder, tokenizer_path, max_seq_len=128, max_batch_size=3)
    alone = [plain.generate([prompt], max_gen_len=length, temperature=0)[0][0] for prompt, length in zip(prompts, lengths)]
    llama = Llama.build(folder, tokenizer_path, max_seq_len=128, max_batch_size=3, compile=True)
    assert llama.model.mixed_graphs is not None
    llama.warm_up()
    steps = []
    run = llama.model.mixed_graphs.run
    llama.model.mixed_graphs.run = lambda *args: steps.append((len(args[1]), len(args[4]))) or run(*args)
    torch._dynamo.utils.counters.clear()
    assert greedy_answers(llama.engine(256), prompts, lengths) == alone
    assert (0, 3) in steps  # the first three prompts, in one step
    assert any(rows and prompt_rows == 2 for rows, prompt_rows in steps)  # the 70-token prompt beside generating rows
    steps.clear()
    llama.forget_prefixes()
    assert greedy_answers(llama.engine(256), prompts[3:4], lengths[3:4]) == alone[3:4]
    assert steps == [(0, 2)]  # a prompt alone: the whole step too, then steps of its one row
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0  # all compiled in the warm-up
