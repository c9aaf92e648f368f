"""Several prompts' chunks prefilled in one pass: which chunks share a pass, the padded pass's
logits and cache equal to each chunk's own pass, and generate's prompts prefilled together (in
one unpadded pass beside the generating rows where steps run eagerly: test_mixed_passes.py)."""

import pytest
import torch

from kv_rows import by_row
from llama_tp import Llama
from llama_tp.engine.blocks import BlockPool
from llama_tp.model.prefix_cache import PrefixCache
from llama_tp.engine.scheduler import MAX_PADDING, Chunk, Scheduler, prefill_passes
from serve_harness import request
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, full_weights, write_checkpoint


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Llama:
    directory = tmp_path_factory.mktemp("tiny")
    write_checkpoint(directory, TINY_LLAMA2, full_weights(TINY_LLAMA2, 32000), 1, "dim")
    return Llama.build(str(directory), str(LLAMA2_TOKENIZER), max_seq_len=64, max_batch_size=4, dtype="fp32")


def chunks_of(llama: Llama, lengths: list[int], starts: "list[int] | None" = None) -> list[Chunk]:
    """One admitted request per length, each chunk its whole prompt from its start."""
    scheduler = Scheduler(PrefixCache(4), max_prefill_tokens=256, pool=BlockPool(8))
    chunks = []
    for slot, (length, start) in enumerate(zip(lengths, starts or [0] * len(lengths))):
        sequence = scheduler.admit(request(llama, [1] + [100 + slot] * (start + length - 1), 4), slot)
        chunks.append(Chunk(sequence, start, sequence.tokens[start:]))
    return chunks


def widths(passes: list[list[Chunk]]) -> list[list[int]]:
    return [[len(chunk.tokens) for chunk in group] for group in passes]


def test_equal_chunks_share_one_pass_and_unequal_ones_share_while_padding_stays_small(llama):
    assert widths(prefill_passes(chunks_of(llama, [5, 5, 5, 5]), 64)) == [[5, 5, 5, 5]]
    # longest first; 3 x 8 = 24 padded tokens for 8 + 7 + 6 = 21 fed (1.14), then 2 joins: 32 for 23 (1.39)
    assert widths(prefill_passes(chunks_of(llama, [6, 8, 2, 7]), 64)) == [[8, 7, 6, 2]]
    assert MAX_PADDING == 1.5  # 2 x 12 = 24 padded tokens for 14 fed is 1.71: a pass each
    assert widths(prefill_passes(chunks_of(llama, [2, 12]), 64)) == [[12], [2]]
    assert widths(prefill_passes(chunks_of(llama, [12, 9, 2]), 64)) == [[12, 9], [2]]


def test_a_chunk_whose_padding_would_pass_the_caches_end_gets_a_pass_of_its_own(llama):
    # 10 + 6 padded to 10 would end at position 60 + 10 = 70 > 64
    assert widths(prefill_passes(chunks_of(llama, [10, 6], starts=[0, 58]), 64)) == [[10], [6]]
    assert widths(prefill_passes(chunks_of(llama, [10, 6], starts=[0, 54]), 64)) == [[10, 6]]


def test_a_padded_pass_gives_each_row_its_own_passs_logits_and_cache(llama):
    model = llama.model
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 32000, (length,), generator=generator).tolist() for length in (9, 4, 7)]
    starts = [0, 5, 2]  # rows 1 and 2 continue what their caches hold
    for slot, start in enumerate(starts):
        if start:
            model.forward(torch.randint(3, 32000, (1, start), generator=generator), 0, slots=[slot])
    keys_before = [layer.attention.cache.k.clone() for layer in model.layers]
    alone = []
    for slot, (prompt, start) in enumerate(zip(prompts, starts)):
        alone.append(model.forward(torch.tensor([prompt]), start, last_only=True, slots=[slot])[0, -1])
    keys_alone = [layer.attention.cache.k.clone() for layer in model.layers]
    for layer, keys in zip(model.layers, keys_before):
        layer.attention.cache.k.copy_(keys)
    padded = torch.tensor([prompt + [0] * (9 - len(prompt)) for prompt in prompts])
    together = model.forward(padded, starts, last_only=True, slots=[0, 1, 2], lengths=[9, 4, 7])
    assert together.shape == (3, 1, 32000)
    for row in range(3):
        torch.testing.assert_close(together[row, -1], alone[row], rtol=1e-5, atol=1e-5)
    for layer, keys in zip(model.layers, keys_alone):  # every row's own positions hold the same keys
        for slot, (prompt, start) in enumerate(zip(prompts, starts)):
            end = start + len(prompt)
            torch.testing.assert_close(by_row(layer.attention.cache.k, model)[slot, :, :end],
                                       by_row(keys, model)[slot, :, :end], rtol=1e-5, atol=1e-5)


def test_generate_prefills_its_prompts_in_one_pass_and_answers_each_as_alone(llama, monkeypatch):
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 32000, (length,), generator=generator).tolist() for length in (6, 6, 5, 6)]
    alone = [llama.generate([prompt], max_gen_len=6, temperature=0)[0][0] for prompt in prompts]
    llama.forget_prefixes()  # every prompt prefilled afresh
    passes = []
    forward_segments = llama.model.forward_segments
    monkeypatch.setattr(llama.model, "forward_segments", lambda batches, **kwargs: (
        passes.append([tuple(tokens.shape) for tokens, _, _ in batches]), forward_segments(batches, **kwargs))[1])
    together, _ = llama.generate(prompts, max_gen_len=6, temperature=0)
    assert passes == [[(1, 6), (1, 6), (1, 5), (1, 6)]]  # one pass for the four prompts, none padded
    assert together == alone


def test_without_mixed_passes_generate_prefills_its_prompts_padded_together(llama, monkeypatch):
    """Where one-token steps are compiled (Transformer.can_mix_batches is False), prompts share
    padded passes of their own (prefill_passes)."""
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 32000, (length,), generator=generator).tolist() for length in (6, 6, 5, 6)]
    alone = [llama.generate([prompt], max_gen_len=6, temperature=0)[0][0] for prompt in prompts]
    llama.forget_prefixes()
    monkeypatch.setattr(type(llama.model), "can_mix_batches", property(lambda model: False))
    passes = []
    forward = llama.model.forward
    monkeypatch.setattr(llama.model, "forward", lambda tokens, *args, **kwargs: (
        passes.append(tuple(tokens.shape)) if tokens.shape[1] > 1 else None, forward(tokens, *args, **kwargs))[1])
    together, _ = llama.generate(prompts, max_gen_len=6, temperature=0)
    assert passes == [(4, 6)]  # one prefill pass for the four prompts (5 padded to 6)
    assert together == alone
