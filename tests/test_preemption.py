"""A KV cache too small for every running request (engine/scheduler.py): a request waits until its
prompt's blocks are free, and a request that cannot grow preempts the newest, whose blocks are
freed and whose tokens are fed again later; every request then has the answer it has alone, greedy
and (where our kernels take every product) seeded sampled, on one rank and on two in lockstep."""

import pytest

from distributed import run_world
from llama_tp import Llama
from llama_tp.engine import run_job
from llama_tp.model.kv_cache import BLOCK_POSITIONS
from serve_harness import request
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, full_weights, write_checkpoint
from torchrun import one_thread  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_SEQ_LEN = 128  # two blocks a request at most
PROMPTS = [[1] + [450 + 37 * row + column for column in range(40)] for row in range(4)]  # a block each
ANSWER = 80  # into a second block: four requests need eight blocks, the small pool holds three
OPTIONS = {"greedy": dict(temperature=0), "sampled": dict(temperature=1.0, top_p=0.9)}


def answers(llama: Llama, prompts: list[list[int]], options: dict, first_seed: int = 100) -> tuple[list, int]:
    """Each prompt's answer, with seed first_seed + its index, through one engine (min_gen_len keeps
    stop tokens off, so that every answer runs to ANSWER), from a cache that holds no earlier
    prompt (a start computed in another pass differs by fp32's rounding, which a sampled token may
    not survive); and how many preemptions it made."""
    llama.forget_prefixes()
    engine = llama.engine()
    requests = [(request(llama, prompt, ANSWER, min_gen_len=ANSWER, **options), first_seed + index)
                for index, prompt in enumerate(prompts)]
    ended = {}
    for updates in run_job(engine, requests):
        for update in updates:
            if update.delta.finish_reason is not None:
                ended[update.sequence.request.id] = list(update.sequence.sampling.answer)
    return [ended[each.id] for each, _ in requests], engine.scheduler.preemptions


def with_pool(llama: Llama, blocks: int) -> Llama:
    """llama with its KV cache made again with this many blocks."""
    model = llama.model
    model.setup_caches(model.max_batch_size, model.max_seq_len, model.rotary.device,
                       model.layers[0].attention.cache.k.dtype, blocks * BLOCK_POSITIONS)
    return llama


def bit_for_bit(name: str, exact_steps: bool) -> bool:
    """Whether the answers are checked against the answers alone: greedy on every path, seeded
    sampled where a step's tokens get the bits of steps of their own (our CPU kernels,
    Transformer.exact_steps). Elsewhere (torch's products: on an AMD EPYC with the kernels off, one
    answer of four) the tokens a resumed request feeds again round differently from the one-token
    steps that first made them, which a sampled token may not survive (docs/serving.md, "When the
    pool runs out")."""
    return name == "greedy" or exact_steps


def build(checkpoint: str) -> Llama:
    return Llama.build(checkpoint, str(LLAMA2_TOKENIZER), max_seq_len=MAX_SEQ_LEN, max_batch_size=4)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny")
    for world_size in (1, 2):
        write_checkpoint(directory / f"mp{world_size}", TINY_LLAMA2, full_weights(TINY_LLAMA2, 32000), world_size,
                         "dim")
    return directory


@pytest.fixture(scope="module")
def alone(checkpoints) -> dict[str, list[list[int]]]:
    """Each prompt's answers alone, in the default cache (two blocks a row), with its seed in the batch."""
    llama = build(str(checkpoints / "mp1"))
    return {name: [answers(llama, [prompt], options, 100 + index)[0][0] for index, prompt in enumerate(PROMPTS)]
            for name, options in OPTIONS.items()}


@pytest.mark.parametrize("name", OPTIONS)
def test_preempted_requests_answer_as_they_do_alone(checkpoints, alone, name):
    llama = with_pool(build(str(checkpoints / "mp1")), 3)
    if not bit_for_bit(name, llama.model.exact_steps):
        pytest.skip("seeded sampled answers equal their answers alone only where our kernels take every product")
    together, preemptions = answers(llama, PROMPTS, OPTIONS[name])
    assert preemptions > 0
    assert together == alone[name]


def _two_ranks_preempting(checkpoint: str) -> dict[str, tuple[list[list[int]], int, list[list[int]], bool]]:
    llama = build(checkpoint)
    alone = {name: [answers(llama, [prompt], options, 100 + index)[0][0] for index, prompt in enumerate(PROMPTS)]
             for name, options in OPTIONS.items()}
    with_pool(llama, 3)
    return {name: (*answers(llama, PROMPTS, options), alone[name], bit_for_bit(name, llama.model.exact_steps))
            for name, options in OPTIONS.items()}


@pytest.mark.slow  # two processes, each answering alone and together twice: 7 minutes on 2 busy cores
def test_two_ranks_preempt_in_lockstep_with_the_answers_alone(checkpoints):
    ranks = run_world(2, _two_ranks_preempting, str(checkpoints / "mp2"))
    assert ranks[0] == ranks[1]  # the same decisions and tokens on both ranks
    for together, preemptions, alone, checked in ranks[0].values():
        assert preemptions > 0 and (together == alone or not checked)
