"""The scheduler's plan of a step, without a model."""

from llama_tp.model.prefix_cache import MIN_COPIED_TOKENS, PrefixCache
from llama_tp.sampling import SamplingOptions
from llama_tp.engine import GenerationRequest
from llama_tp.engine.scheduler import Chunk, Copy, Scheduler


def test_generating_rows_decode_in_cache_row_order_whatever_order_they_came_in():
    """Rows that fill a block of the cache are then read in place rather than gathered."""
    scheduler = Scheduler(PrefixCache(4), max_prefill_tokens=64)
    for number, slot in enumerate((2, 0, 3, 1)):  # admitted in this order
        prompt = (1, 100 + number, 200 + number)
        sequence = scheduler.admit(GenerationRequest(f"r{number}", prompt, 4, SamplingOptions(), frozenset({2})), slot)
        scheduler.fed(Chunk(sequence, 0, list(prompt[:-1])))  # all but the last token: one to decode
    plan = scheduler.plan()
    assert plan.prefill == [] and [chunk.sequence.slot.index for chunk in plan.decode] == [0, 1, 2, 3]
    assert [chunk.sequence.request.id for chunk in plan.decode] == ["r1", "r3", "r0", "r2"]


def test_a_prompt_that_begins_as_another_slots_tokens_copies_them_once_before_its_passes():
    system = list(range(1000, 1000 + MIN_COPIED_TOKENS))  # a system prompt, as long as copies start
    scheduler = Scheduler(PrefixCache(3), max_prefill_tokens=64)
    first = scheduler.admit(GenerationRequest("a", (1, *system, 7, 8), 4, SamplingOptions(), frozenset({2})), 0)
    scheduler.fed(Chunk(first, 0, first.tokens))  # prefilled; it runs on
    short = scheduler.admit(GenerationRequest("b", (1, *system[:-2], 9), 4, SamplingOptions(), frozenset({2})), 2)
    second = scheduler.admit(GenerationRequest("c", (1, *system, 9, 9), 4, SamplingOptions(), frozenset({2})), 1)
    assert short.reused == 0 and short.copy is None  # one token too few to be worth a copy
    assert second.reused == 1 + MIN_COPIED_TOKENS and second.pending == [9, 9]
    assert scheduler.prefix_cache.rows[1] == [1, *system]
    plan = scheduler.plan()
    assert plan.copies == [Copy(0, 1, 0, 1 + MIN_COPIED_TOKENS)]
    assert [chunk.tokens for chunk in plan.prefill] == [short.tokens, [9, 9]]
    assert scheduler.plan().copies == []  # done once


def test_a_sequence_that_ends_before_its_copy_is_made_leaves_its_slot_without_the_copied_start():
    system = list(range(1000, 1000 + MIN_COPIED_TOKENS))
    scheduler = Scheduler(PrefixCache(2), max_prefill_tokens=64)
    first = scheduler.admit(GenerationRequest("a", (1, *system, 7), 4, SamplingOptions(), frozenset({2})), 0)
    scheduler.fed(Chunk(first, 0, first.tokens))
    second = scheduler.admit(GenerationRequest("b", (1, *system, 9), 4, SamplingOptions(), frozenset({2})), 1)
    assert second.copy is not None
    scheduler.release(second)  # the server stopped before the step that would have copied
    assert scheduler.prefix_cache.rows[1] == []
