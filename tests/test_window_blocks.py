"""A sliding window frees the blocks it leaves behind (engine/scheduler.py): a long answer of a
Mistral-style model holds about window / 64 + 1 blocks of the KV cache, not its length's, the
blocks it gives back go to other sequences, and every answer is still transformers' own and the
one it has with every block kept (as before windows freed blocks), alone, beside others in a pool
too small to keep them all, preempted, and starting from a prefix that a windowed sequence left
behind."""

import pytest

from hf_families import hf_model, transformers_greedy
from llama_tp import Llama
from llama_tp.engine import GenerationRequest, run_job
from llama_tp.engine.requests import BeamSearch
from llama_tp.model.kv_cache import BLOCK_POSITIONS, NO_BLOCK, blocks_for
from llama_tp.sampling import SamplingOptions
from llama_tp.tools.convert.__main__ import main as convert
from serve_harness import request
from torchrun import one_thread  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW = 100  # not a whole number of blocks: the window's first position moves within a block
MAX_SEQ_LEN = 384  # six blocks a request at most
ANSWER = 300  # well past the window: a request runs to five blocks, and would hold them all
HELD = blocks_for(WINDOW) + 1  # the most blocks a windowed request holds: its window's, and the one it writes


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """transformers' Mistral with a window of WINDOW positions, and our conversion of it."""
    root = tmp_path_factory.mktemp("window")
    model = hf_model(root / "hf", "mistral_window", sliding_window=WINDOW, max_position_embeddings=1024)
    convert("hf", str(root / "hf"), str(root / "ours"))
    return model, root / "ours"


def build(ckpt, pool_blocks: int) -> Llama:
    """Our model with a KV cache of pool_blocks blocks for three requests at once."""
    llama = Llama.build(str(ckpt), str(ckpt / "tokenizer.json"), max_seq_len=MAX_SEQ_LEN, max_batch_size=3)
    model = llama.model
    model.setup_caches(model.max_batch_size, model.max_seq_len, model.rotary.device,
                       model.layers[0].attention.cache.k.dtype, pool_blocks * BLOCK_POSITIONS)
    return llama


def prompts(count: int, length: int = 20) -> list[list[int]]:
    return [[3] + [(17 + 29 * row + 7 * column) % 280 + 20 for column in range(length - 1)] for row in range(count)]


def run(llama: Llama, prompts: list[list[int]], frees: bool = True) -> dict:
    """Each prompt's greedy answer of ANSWER tokens (no stop token before), run together in one
    engine: the answers, the preemptions, and the most blocks the pool and any one request held
    at the end of a step. frees: whether the window frees blocks (off: every block is kept)."""
    engine = llama.engine()
    if not frees:
        engine.scheduler.window = None
    requests = [(request(llama, prompt, ANSWER, min_gen_len=ANSWER, temperature=0), 0) for prompt in prompts]
    ended, pool_held, request_held, cached = {}, 0, 0, {}
    for updates in run_job(engine, requests):
        pool_held = max(pool_held, engine.scheduler.pool.held)
        for sequence in engine.running:
            held = [block for block in sequence.blocks if block != NO_BLOCK]
            assert held == sequence.held  # the blocks given back are the table's first ones
            request_held = max(request_held, len(held))
        for update in updates:
            if update.delta.finish_reason is not None:
                ended[update.sequence.request.id] = list(update.sequence.sampling.answer)
                cached[update.sequence.request.id] = update.delta.cached_tokens
    ids = [each.id for each, _ in requests]
    return {"answers": [ended[i] for i in ids], "preemptions": engine.scheduler.preemptions, "pool_held": pool_held,
            "request_held": request_held, "cached": [cached[i] for i in ids]}


def test_a_long_answer_holds_its_windows_blocks_and_is_transformers_answer(mistral):
    model, ckpt = mistral
    llama = build(ckpt, 8)
    assert llama.model.window == WINDOW
    prompt = prompts(1)[0]
    freeing = run(llama, [prompt])
    assert freeing["answers"][0] == transformers_greedy(model, prompt, ANSWER)
    assert freeing["pool_held"] == HELD == 3  # of the 6 blocks its 320 tokens fill
    keeping = run(llama, [prompt], frees=False)
    assert keeping["answers"] == freeing["answers"] and keeping["pool_held"] == blocks_for(len(prompt) + ANSWER)


@pytest.mark.parametrize("pool_blocks, preempts", [(10, False), (7, True)])
def test_requests_share_a_pool_through_the_blocks_the_window_frees(mistral, pool_blocks, preempts):
    """Three requests that would need 15 blocks kept whole: in 10 blocks, each holding its window's
    3, none is preempted (blocks one gives back go to the others and are overwritten); in 7, some
    are, and resume. Each answer is transformers' and the one it has with every block kept."""
    model, ckpt = mistral
    three = prompts(3)
    freeing = run(build(ckpt, pool_blocks), three)
    assert (freeing["preemptions"] > 0) == preempts
    assert freeing["request_held"] <= HELD and freeing["pool_held"] <= pool_blocks
    assert freeing["answers"] == [transformers_greedy(model, prompt, ANSWER) for prompt in three]
    keeping = run(build(ckpt, 15), three, frees=False)
    assert keeping["answers"] == freeing["answers"] and keeping["preemptions"] == 0 and keeping["pool_held"] == 15


def test_a_next_turn_starts_from_the_blocks_a_windowed_answer_left_behind(mistral):
    """A conversation's next turn (the first's prompt and answer, and more) shares the blocks the
    first turn gave back (cached, named) and copies the start of the next: transformers' answer
    all the same."""
    model, ckpt = mistral
    llama = build(ckpt, 10)
    first = prompts(1)[0]
    answer = run(llama, [first])["answers"][0]
    turn = first + answer[:200] + [5, 6, 7]
    second = run(llama, [turn])
    # all it shares with the first turn: its first three blocks, given back by the first turn, and
    # the start of the fourth, copied
    assert len(first) + 200 < 4 * BLOCK_POSITIONS and second["cached"][0] == len(first) + 200
    reply = second["answers"][0]
    assert len(reply) == MAX_SEQ_LEN - len(turn)  # to the end of the context
    assert reply == transformers_greedy(model, turn, len(reply))


def test_a_beam_search_under_a_window_forks_only_the_blocks_it_holds(mistral):
    """Beams fork their parents' blocks by reference: those left behind the window are not held,
    and are neither shared nor given back again; the beams equal those of a search keeping every block."""
    _, ckpt = mistral
    search = GenerationRequest("beams", tuple(prompts(1)[0]), 200, SamplingOptions(), frozenset(),
                               beams=BeamSearch(3, returned=3))

    def beams(llama: Llama, frees: bool) -> list[list[int]]:
        engine = llama.engine()
        if not frees:
            engine.scheduler.window = None
        (last,) = [update.delta for step in run_job(engine, [(search, 0)]) for update in step if update.delta.finished]
        assert engine.scheduler.pool.held == 0
        return [list(beam.tokens) for beam in last.beams]

    freed = beams(build(ckpt, 3 * HELD + 3), frees=True)  # too few blocks to keep every beam's
    assert len(freed) == 3 and all(len(tokens) == 200 for tokens in freed)
    assert freed == beams(build(ckpt, 3 * blocks_for(MAX_SEQ_LEN) + 1), frees=False)
