"""Greedy answers of a batch job through one engine, for tests that compare them with other runs'."""

from llama_tp.engine import Engine, GenerationRequest, run_job
from llama_tp.sampling import SamplingOptions


def greedy_answers(engine: Engine, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """Each prompt's greedy answer of up to its length in tokens, all of them submitted at once."""
    requests = [(GenerationRequest(str(index), tuple(prompt), length, SamplingOptions(temperature=0), frozenset()), 0)
                for index, (prompt, length) in enumerate(zip(prompts, lengths))]
    answers = {}
    for updates in run_job(engine, requests):
        answers |= {update.sequence.request.id: update.sequence.sampling.answer
                    for update in updates if update.delta.finished}
    return [answers[str(index)] for index in range(len(prompts))]
