"""Batch jobs and streams: requests that every rank already holds, run through the engine until all
have ended, step by step.

A row that ends takes the next request at the next step, so no row idles while another finishes a
long answer. Each request runs as it runs on the server: in a cache row of its own (the one
holding the longest start of it, for prefix reuse), with its own random generator, so its answer
is the one it gets alone, whatever shares the batch. (Speculative sampling is the exception: a
round guesses fewer tokens a row the more rows share it, Speculator.guesses_for, and so draws
other numbers.)
"""

from collections import deque
from typing import Iterable, Iterator

import torch

from .engine import Admission, Engine, Update
from .requests import GenerationRequest

# Prompt tokens fed a step beside the generating rows (the server's --max_prefill_tokens, at twice
# its default: a batch job has no client waiting for its first token).
JOB_PREFILL_TOKENS = 512

# Prompt i of a call seeded s gets seed s + i * SEED_STRIDE (mod 2**63): the first prompt s itself,
# as the server seeds a request, and the others far apart, so that calls with nearby seeds (s, s+1)
# share no prompt seeds. The golden ratio's 64-bit Weyl step (as splitmix64's), made odd.
SEED_STRIDE = 0x9E3779B97F4A7C15 % 2**63
SEED_RANGE = 2**63  # seeds are non-negative int64s


def prompt_seed(seed: int, index: int) -> int:
    """The seed of prompt index's own generator in a call seeded with seed."""
    return (seed + index * SEED_STRIDE) % SEED_RANGE


def prompt_seeds(seed: "int | list[int] | None", count: int) -> list[int]:
    """Each prompt's seed: from the call's seed, or as given (one per prompt, e.g. to resume a job),
    or, without one, drawn from the global generator that Llama.build seeded alike on every rank."""
    if isinstance(seed, list):
        return seed
    if seed is None:
        return torch.randint(SEED_RANGE - 1, (count,)).tolist()
    return [prompt_seed(seed, index) for index in range(count)]


def run_job(engine: Engine, requests: Iterable[tuple[GenerationRequest, int]]) -> Iterator[list[Update]]:
    """Every request with its seed through the engine; each step's updates as it ends. Every rank
    holds every request, so there is no news to exchange: each rank admits them in order as rows
    free up (a row that ends takes the next request at the next step), until all have ended."""
    waiting = deque(requests)
    while waiting or engine.running:
        taken: set[int] = set()
        while waiting:
            slots = engine.choose_slots(waiting[0][0], taken)  # a beam search's: one a beam
            if slots is None:
                if not engine.running:  # nothing will free blocks: never wait for them forever
                    raise RuntimeError(f"a prompt of {len(waiting[0][0].prompt_tokens)} tokens does not fit the "
                                       f"KV cache's {engine.scheduler.pool.available} free blocks")
                break
            request, seed = waiting.popleft()
            taken.update(slots)
            engine.admit(Admission(request, slots[0], seed, beam_slots=slots[1:]))
        yield engine.step()
