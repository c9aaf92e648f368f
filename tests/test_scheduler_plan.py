"""The scheduler's plan of a step and the blocks it hands out, without a model."""

from llama_tp.engine import GenerationRequest
from llama_tp.engine.blocks import BlockPool
from llama_tp.engine.scheduler import Chunk, Scheduler, StepPlan
from llama_tp.model.kv_cache import BLOCK_POSITIONS
from llama_tp.model.prefix_cache import PrefixCache
from llama_tp.sampling import SamplingOptions

SYSTEM = list(range(1000, 1000 + 2 * BLOCK_POSITIONS))  # a system prompt two blocks long


def request(request_id: str, prompt, max_tokens: int = 4) -> GenerationRequest:
    return GenerationRequest(request_id, tuple(prompt), max_tokens, SamplingOptions(), frozenset({2}))


def run_step(scheduler: Scheduler, token: int = 7) -> StepPlan:
    """A step as the engine runs it: every chunk fed, each sequence whose pending tokens it fed gains token."""
    plan = scheduler.plan()
    for chunk in plan.prefill + plan.decode:
        scheduler.fed(chunk)
        if chunk.completes:
            chunk.sequence.tokens.append(token)
    return plan


def test_generating_rows_decode_in_cache_row_order_whatever_order_they_came_in():
    """Rows that fill a block of the cache are then read in place rather than gathered."""
    scheduler = Scheduler(PrefixCache(4), max_prefill_tokens=64, pool=BlockPool(8))
    for number, slot in enumerate((2, 0, 3, 1)):  # admitted in this order
        prompt = (1, 100 + number, 200 + number)
        sequence = scheduler.admit(request(f"r{number}", prompt), slot)
        scheduler.fed(Chunk(sequence, 0, list(prompt[:-1])))  # all but the last token: one to decode
    plan = scheduler.plan()
    assert plan.prefill == [] and [chunk.sequence.slot.index for chunk in plan.decode] == [0, 1, 2, 3]
    assert [chunk.sequence.request.id for chunk in plan.decode] == ["r1", "r3", "r0", "r2"]


def test_a_sequence_holds_the_blocks_of_its_prompt_and_grows_a_block_at_a_time():
    scheduler = Scheduler(PrefixCache(2), max_prefill_tokens=256, pool=BlockPool(8))
    sequence = scheduler.admit(request("a", [1] * (BLOCK_POSITIONS - 1), max_tokens=100), 0)
    assert sequence.blocks == [0]
    assert run_step(scheduler).tables == {0: [0]}  # the table given before the first pass
    plan = run_step(scheduler)  # the prompt's next token, at the block's last position
    assert not plan.tables and sequence.blocks == [0]
    plan = run_step(scheduler)  # the next is the second block's first
    assert plan.tables == {0: [0, 1]} and scheduler.pool.held == 2


def test_a_shared_start_is_held_once_by_reference_running_or_ended():
    scheduler = Scheduler(PrefixCache(3), max_prefill_tokens=1024, pool=BlockPool(16))
    first = scheduler.admit(request("a", [*SYSTEM, 7, 8]), 0)
    system_blocks = first.blocks[:2]
    run_step(scheduler)  # prefilled: its two full blocks are named
    second = scheduler.admit(request("b", [*SYSTEM, 9, 9, 9]), 1)
    assert second.reused == len(SYSTEM) and second.pending == [9, 9, 9]
    assert second.blocks[:2] == first.blocks[:2] and second.blocks[2] != first.blocks[2]
    assert scheduler.pool.held == 4  # two shared, one each for the rest
    scheduler.release(first)
    scheduler.release(second)
    assert scheduler.pool.held == 0 and len(scheduler.pool.cached) == 2  # the system prompt, for later
    third = scheduler.admit(request("c", [*SYSTEM, 5]), 2)
    assert third.reused == len(SYSTEM) and third.blocks[:2] == system_blocks


def test_a_prompt_whose_whole_blocks_are_cached_still_feeds_its_last_token_in_a_block_of_its_own():
    scheduler = Scheduler(PrefixCache(2), max_prefill_tokens=1024, pool=BlockPool(8))
    first = scheduler.admit(request("a", SYSTEM), 0)
    run_step(scheduler)
    again = scheduler.admit(request("b", SYSTEM), 1)
    # the first block is shared; the second, where the last token is written again, is its own: a
    # copy of the first's but for that token
    assert again.reused == len(SYSTEM) - 1 and again.blocks[0] == first.blocks[0]
    assert again.blocks[1] != first.blocks[1] and again.pending == SYSTEM[-1:]
    assert run_step(scheduler).copies == [(first.blocks[1], again.blocks[1])]


def test_a_prompt_copies_the_start_it_shares_with_a_filled_block_where_a_block_is_too_long_to_share():
    """A system turn shorter than a block, then another question: the next request copies the
    first positions of the block an ended request filled, before the pass that writes the rest of
    it, and feeds only what follows; with the prefix cache off it feeds everything."""
    system = list(range(500, 520))
    for enabled in (True, False):
        scheduler = Scheduler(PrefixCache(2, enabled), max_prefill_tokens=1024, pool=BlockPool(8))
        first = scheduler.admit(request("a", system + list(range(600, 700))), 0)  # fills its first block
        run_step(scheduler)
        filled = first.blocks[0]
        scheduler.release(first)
        second = scheduler.admit(request("b", system + [9, 9, 9]), 1)
        plan = run_step(scheduler)
        if enabled:
            assert second.reused == len(system) and plan.copies == [(filled, second.blocks[0])]
            assert [(chunk.start, chunk.tokens) for chunk in plan.prefill] == [(len(system), [9, 9, 9])]
        else:
            assert second.reused == 0 and plan.copies == []


def test_cached_blocks_go_least_recently_used_first_when_the_pool_needs_them():
    scheduler = Scheduler(PrefixCache(1), max_prefill_tokens=1024, pool=BlockPool(4))
    for name, start in (("a", 1000), ("b", 2000)):  # two ended prompts of two full blocks (and one more)
        sequence = scheduler.admit(request(name, range(start, start + 2 * BLOCK_POSITIONS + 1)), 0)
        run_step(scheduler)
        scheduler.release(sequence)
    assert len(scheduler.pool.cached) == 3  # b's two, and a's first (its second went to b's third)
    newer = scheduler.admit(request("c", range(2000, 2000 + 2 * BLOCK_POSITIONS + 1)), 0)
    assert newer.reused == 2 * BLOCK_POSITIONS


def test_a_request_waits_until_its_prompts_blocks_are_available():
    scheduler = Scheduler(PrefixCache(3), max_prefill_tokens=1024, pool=BlockPool(4))
    assert scheduler.choose_slot(tuple(range(3 * BLOCK_POSITIONS)), set()) == 0
    running = scheduler.admit(request("a", range(3 * BLOCK_POSITIONS)), 0)
    assert scheduler.choose_slot(tuple(range(5000, 5000 + 2 * BLOCK_POSITIONS)), set()) is None  # 1 block left
    assert scheduler.choose_slot((1, 2, 3), set()) == 1
    assert scheduler.choose_slot((1, 2, 4), {1}) is None  # the one block is promised to the chosen prompt
    scheduler.release(running)
    assert scheduler.choose_slot(tuple(range(5000, 5000 + 2 * BLOCK_POSITIONS)), set()) == 0


def test_a_sequence_that_cannot_grow_preempts_the_newest_which_resumes_with_its_tokens():
    scheduler = Scheduler(PrefixCache(2), max_prefill_tokens=1024, pool=BlockPool(3))
    old = scheduler.admit(request("old", range(100, 100 + BLOCK_POSITIONS), max_tokens=200), 0)
    new = scheduler.admit(request("new", range(300, 300 + BLOCK_POSITIONS - 1), max_tokens=200), 1)
    run_step(scheduler)  # both prompts; each holds one block, one block is free
    run_step(scheduler)  # old's first token is in its second block (the free one); new fills its first
    assert len(old.blocks) == 2 and len(new.blocks) == 1 and not scheduler.pool.free
    plan = run_step(scheduler)  # new needs a second block: none is left, and it is the newest
    assert new.preempted and new.blocks == [] and scheduler.preemptions == 1
    assert [chunk.sequence for chunk in plan.decode] == [old]
    assert scheduler.choose_slot((1, 2), set()) is None  # nothing is admitted while new waits
    for _ in range(BLOCK_POSITIONS - 1):  # old grows on, and takes new's first block (cached) for its third
        run_step(scheduler)
    assert new.preempted and len(old.blocks) == 3
    scheduler.release(old)
    plan = run_step(scheduler)  # new resumes: all its tokens fed anew, its prompt and the two it had chosen
    assert not new.preempted and not plan.decode
    fed = [(chunk.sequence, chunk.start, chunk.tokens) for chunk in plan.prefill]
    assert fed == [(new, 0, [*range(300, 363), 7, 7])]


def test_a_sequence_alone_grows_through_the_pool():
    scheduler = Scheduler(PrefixCache(1), max_prefill_tokens=1024, pool=BlockPool(2))
    sequence = scheduler.admit(request("a", range(BLOCK_POSITIONS), max_tokens=BLOCK_POSITIONS), 0)
    for _ in range(BLOCK_POSITIONS):
        run_step(scheduler)
    assert not sequence.preempted and len(sequence.blocks) == 2
