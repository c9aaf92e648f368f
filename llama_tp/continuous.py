"""Llama.generate's continuous batching: the serving engine's loop over prompts that every rank
already holds.

A row that ends takes the next prompt at the next step, so no row idles while another finishes a
long answer. Each prompt runs as a request runs on the server: in a cache row of its own (the one
holding the longest start of it, for prefix reuse), with its own random generator, so its answer
is the one it gets alone, whatever shares the batch.
"""

from dataclasses import dataclass
from typing import Callable

import torch

from .sampling import SamplingOptions
from .serve.engine import Engine
from .serve.requests import GenerationRequest
from .serve.scheduler import Sequence

# Prompt tokens fed a step beside the generating rows (the server's --max_prefill_tokens, at twice
# its default: a batch job has no client waiting for its first token).
JOB_PREFILL_TOKENS = 512

# Prompt i of a call seeded s gets seed s + i * SEED_STRIDE (mod 2**63): the first prompt s itself,
# as the server seeds a request, and the others far apart, so that calls with nearby seeds (s, s+1)
# share no prompt seeds. The golden ratio's 64-bit Weyl step (as splitmix64's), made odd.
SEED_STRIDE = 0x9E3779B97F4A7C15 % 2**63
SEED_RANGE = 2**63  # seeds are non-negative int64s


@dataclass(frozen=True)
class Finished:
    """One prompt's answer, as it ends: its generated tokens (without a stop token; with the one that
    completed a stop string) and, where asked, their log probabilities."""

    index: int
    tokens: list[int]
    logprobs: list[float]


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


def run_continuously(llama, prompts: list[list[int]], max_gen_len: int, options: SamplingOptions,
                     stop: tuple[str, ...], stop_tokens: set[int], logprobs: bool, seeds: list[int],
                     on_finish: Callable[[Finished], None]) -> None:
    """Generate for every prompt through the engine, telling on_finish of each as it ends."""
    room = llama.model.max_seq_len

    def finished(sequence: Sequence, reason: str) -> None:
        progress = sequence.sampling
        on_finish(Finished(int(sequence.request.id), progress.answer,
                           [entry.logprob for entry in progress.logprobs]))

    requests = []
    for index, (prompt, seed) in enumerate(zip(prompts, seeds)):
        if len(prompt) >= room:  # a prompt that fills the context has no answer (as in a static batch)
            on_finish(Finished(index, [], []))
            continue
        request = GenerationRequest(id=str(index), prompt_tokens=tuple(prompt), max_tokens=max_gen_len,
                                    options=options, stop_tokens=frozenset(stop_tokens), stop=stop,
                                    logprobs=logprobs)
        requests.append((request, seed))
    Engine(llama, JOB_PREFILL_TOKENS, on_finish=finished).run_job(requests)


def check_seeds(seed: "int | list[int] | None", count: int) -> None:
    """Refuse a list of seeds that is not one integer per prompt (an int or None is checked with the options)."""
    if not isinstance(seed, list):
        return
    if len(seed) != count or not all(isinstance(s, int) and not isinstance(s, bool) for s in seed):
        raise ValueError(f"seed must be an integer or a list of one integer per prompt ({count}), found {seed!r}")
