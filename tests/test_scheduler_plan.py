"""The scheduler's plan of a step, without a model."""

from llama_tp.prefix_cache import PrefixCache
from llama_tp.sampling import SamplingOptions
from llama_tp.serve.requests import GenerationRequest
from llama_tp.serve.scheduler import Chunk, Scheduler


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
