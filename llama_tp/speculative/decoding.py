"""Speculative rounds for the generation API: a batch under Meta's schedule, after its first step."""

from typing import Iterator, Optional

import torch

from ..batch import Batch, logprobs_of
from ..logs import logger
from ..model import Transformer
from ..sampling import SamplingOptions, top_candidates
from .rounds import Speculator
from .rows import Row, histories, suppressed


def decode_rounds(speculator: Speculator, model: Transformer, batch: Batch, options: SamplingOptions,
                  stop: tuple[str, ...], stop_tokens: set[int], generator: Optional[torch.Generator],
                  logprobs: bool, tokenizer) -> Iterator[Batch]:
    """Continue a batch whose first step (the prefill, which chose every row's first token) is
    done, in rounds until every row has ended; yield it after each round.

    The rows of Meta's schedule are cache rows 0, 1, ...; a row still within its prompt (longer
    than the shortest) takes the rest of it as guesses that are always right, so that its
    tokens come from exactly the passes they would come from without speculation. Rows that
    have ended drop out of the passes.
    """
    bsz = len(batch.lengths)
    batch.reached = [batch.cur_pos + 1] * bsz
    rows_so_far = [row[: batch.cur_pos + 1] for row in batch.rows]
    prompts = [row[:length] for row, length in zip(batch.rows, batch.lengths)]
    before = (speculator.stats.proposed, speculator.stats.accepted)
    while not batch.all_ended:
        ends = batch.ends
        active = [row for row in range(bsz) if batch.reached[row] < ends[row]]
        rows = [Row(row, rows_so_far[row], options, generator, batch.lengths[row], sorted(stop_tokens),
                    ends[row] - batch.reached[row], prompts[row][batch.reached[row]:]) for row in active]
        outcomes = speculator.round(model, rows, want_logits=logprobs or batch.top_ids is not None)
        for spec, outcome in zip(rows, outcomes):
            row, first = spec.slot, batch.reached[spec.slot]
            new = torch.tensor(outcome.tokens, device=batch.tokens.device)
            if logprobs:
                batch.token_logprobs[row, first : first + len(new)] = logprobs_of(outcome.logits[None], new[None])[0]
            if batch.top_ids is not None:
                _keep_top(batch, spec, outcome, options, first)
            batch.fill(row, outcome.tokens, stop_tokens, stop, tokenizer)
            rows_so_far[row] += outcome.tokens
        yield batch
    proposed, accepted = speculator.stats.proposed - before[0], speculator.stats.accepted - before[1]
    logger.debug(f"speculation ({speculator.mode}): {accepted} of {proposed} guesses accepted")


def _keep_top(batch: Batch, spec: Row, outcome, options: SamplingOptions, first: int) -> None:
    """The most likely candidates at each position the round filled, as the sampler saw them."""
    positions, vocab = outcome.logits.shape
    device = outcome.logits.device
    history = histories(spec.tokens + outcome.tokens[:-1], positions, options, device)
    suppress = suppressed(spec, first, positions, vocab, device)
    ids, probs = top_candidates(outcome.logits, options, batch.top_ids.shape[-1], history, suppress)
    batch.top_ids[spec.slot, first : first + positions] = ids
    batch.top_probs[spec.slot, first : first + positions] = probs
