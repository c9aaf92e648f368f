"""Beam search in the engine: transformers' generate(num_beams=...) step for step, its beams in
cache rows that share the prompt's blocks.

A request with beams (GenerationRequest.beams) is admitted to one slot, with `width` - 1 more
slots reserved (scheduler.reserve), and prefills its prompt once. From then on each step scores every
beam's continuations at once: the log-softmax of its logits (after the repetition penalty, the
stop-token ban before min_tokens, banned words and Python's logits processors, applied to the log
probabilities as transformers' processors are in beam search), plus the beam's score so far; the
best max(2, 1 + stop tokens) x width of them are read back in the step's one read-back, as rank 0
scored them (choices.read_back). The host then does what transformers' _beam_search does with
them, with the same float32 arithmetic, so that ties and length penalties fall alike:

- candidates ending in a stop token, or at the token limit, are finished; among the first
  `width`, they join the finished hypotheses (scored by their sum over their length **
  length_penalty) where they beat the worst, unless early_stopping=True has `width` already or
  the early-stop heuristic says no running beam can improve them;
- the best `width` unfinished ones are the next step's beams: the scheduler forks them (each
  takes over its parent's blocks by reference; a beam that writes a block another beam holds
  too copies it first), and the beams no candidate continues give their blocks back;
- the search ends when early stopping allows it, or when every candidate has finished; its
  answers are the `returned` best finished hypotheses.

The beams share one Progress (the request's), whose answer is the best hypothesis once it ends.
"""

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from .. import parallel
from ..model.kv_cache import BLOCK_POSITIONS, blocks_for
from ..sampling.processors import apply_processors
from ..sampling.rule import adjust_logits
from ..structured.bad_words import banned_next
from .choices import read_back
from .requests import Delta, GenerationRequest, TokenLogprob
from .scheduler import Scheduler, Sequence
from .step import stop_bans

# transformers' score for what must not be chosen (finished candidates among the running ones,
# hypotheses not yet finished), added rather than set: the same sums, the same ties.
MASKED = -1.0e9


@dataclass
class Hypothesis:
    """A finished (or, where the search is cut short, running) answer: its generated tokens (a
    stop token last where one ended it) and each one's log probability."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class Search:
    """One request's beam search: its running beams (in transformers' order, best first), their
    scores, and the best finished hypotheses so far."""

    def __init__(self, leader: Sequence, spare: list[int], limit: int):
        """leader: the request's sequence, which prefills the prompt; spare: the slots reserved for
        the other beams; limit: the most tokens an answer may have (max_tokens, within max_seq_len)."""
        self.request: GenerationRequest = leader.request
        self.width = self.request.beams.width
        self.limit = limit
        self.beams = [leader]
        self.scores = [0.0]  # float32 values: each beam's summed log probabilities
        self.logprobs: list[list[float]] = [[]]  # each beam's tokens' log probabilities
        self.spare = list(spare)
        self.generated = 0  # tokens each beam has
        # transformers' finished buffers: hypotheses, their scores (MASKED where none yet), whether finished
        self.finished = [Hypothesis() for _ in range(self.width)]
        self.finished_scores = torch.full((1, self.width), MASKED)
        self.is_finished = torch.zeros((1, self.width), dtype=torch.bool)
        self.improvable = torch.ones((1, 1), dtype=torch.bool)  # transformers' is_early_stop_heuristic_unsatisfied
        self.slots = [leader.slot.index] + self.spare  # every slot it holds or keeps

    @property
    def candidates(self) -> int:
        """How many continuations a step keeps: enough that `width` remain if the best all finish."""
        return max(2, 1 + len(self.request.stop_tokens)) * self.width

    def hits(self, tokens: list[int]) -> list[bool]:
        """Which continuations finish the answer: a stop token, or the token limit."""
        return [token in self.request.stop_tokens or self.generated + 1 >= self.limit for token in tokens]

    def advance(self, values: list[float], flat: list[int], chosen: list[float],
                vocab: int) -> Optional[tuple[list[int], list[int]]]:
        """One step on the host, from the best continuations (their scores, flat indices beam *
        vocab + token, and each token's own log probability): the next beams as (parents, tokens),
        or None where the search has ended."""
        parents, tokens = [index // vocab for index in flat], [index % vocab for index in flat]
        beams = self.request.beams
        topk = torch.tensor([values], dtype=torch.float32)  # 1, candidates
        hits = torch.tensor([self.hits(tokens)])
        # the next running beams: the best unfinished continuations (_get_running_beams_for_next_iteration)
        running = topk + hits.to(torch.float32) * MASKED
        keep = torch.topk(running, k=self.width)[1]
        running_scores = torch.take_along_dim(running, keep, dim=1)
        # finished hypotheses: the best `width` of those so far and the new ones (_update_finished_beams)
        top = torch.arange(len(values)) < self.width  # transformers' top_num_beam_mask
        just_finished = hits & top[None, :]
        scored = topk / ((self.generated + 1) ** beams.length_penalty)
        full = torch.all(self.is_finished, dim=-1, keepdim=True) & (beams.early_stopping is True)
        scored += full.to(torch.float32) * MASKED
        scored += (~self.improvable).to(torch.float32) * MASKED
        scored += (~just_finished) * MASKED
        merged = torch.cat((self.finished_scores, scored), dim=1)
        best = torch.topk(merged, k=self.width)[1]
        new = [self._hypothesis(parents[index - self.width], tokens[index - self.width], chosen[index - self.width])
               for index in range(self.width, merged.shape[1])]
        pool = self.finished + new
        self.finished = [pool[index] for index in best[0].tolist()]
        self.finished_scores = torch.take_along_dim(merged, best, dim=1)
        self.is_finished = torch.take_along_dim(torch.cat((self.is_finished, just_finished), dim=1), best, dim=1)
        self.generated += 1
        # could a running beam still beat the worst finished hypothesis? (_check_early_stop_heuristic)
        length = self.limit if beams.early_stopping == "never" and beams.length_penalty > 0.0 else self.generated
        best_possible = running_scores[:, :1] / (length ** beams.length_penalty)
        worst = torch.where(self.is_finished, torch.min(self.finished_scores, dim=1, keepdim=True)[0], MASKED)
        self.improvable = self.improvable & torch.any(best_possible > worst, dim=-1, keepdim=True)
        goes_on = self.improvable & ~(torch.all(self.is_finished) & (beams.early_stopping is True)) & ~torch.all(hits)
        if not bool(goes_on):
            return None
        kept = keep[0].tolist()
        self.scores = running_scores[0].tolist()
        self.logprobs = [self.logprobs[parents[index]] + [chosen[index]] for index in kept]
        return [parents[index] for index in kept], [tokens[index] for index in kept]

    def _hypothesis(self, parent: int, token: int, logprob: float) -> Hypothesis:
        beam = self.beams[parent]
        return Hypothesis(beam.tokens[beam.prompt_length :] + [token], self.logprobs[parent] + [logprob])

    def answers(self) -> list[tuple[Hypothesis, str]]:
        """The `returned` best hypotheses, each with its finish reason: finished ones first; where
        the search was cut short (cancelled) before enough finished, the best running beams."""
        answers = [(hypothesis, self._reason(hypothesis))
                   for hypothesis, done in zip(self.finished, self.is_finished[0].tolist()) if done]
        running = [Hypothesis(beam.tokens[beam.prompt_length :], logprobs)
                   for beam, logprobs in zip(self.beams, self.logprobs)]
        answers += [(hypothesis, "length") for hypothesis in running]
        return answers[: self.request.beams.returned]

    def _reason(self, hypothesis: Hypothesis) -> str:
        return "stop" if hypothesis.tokens and hypothesis.tokens[-1] in self.request.stop_tokens else "length"


def search_blocks(prompt_length: int, max_tokens: int, width: int) -> int:
    """The most blocks a search can hold: its prompt's full blocks once, and each beam's own copy
    of the rest (the prompt's last, partial block and every token it may generate). A door refuses
    a search the KV cache cannot hold, which would preempt itself step after step."""
    return prompt_length // BLOCK_POSITIONS + width * blocks_for(prompt_length % BLOCK_POSITIONS + max_tokens)


class BeamSearches:
    """An engine's running beam searches: their steps, forks and ends."""

    def __init__(self, scheduler: Scheduler, tokenizer, max_seq_len: int):
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.searches: dict[int, Search] = {}  # by id(request): its beams share the one request

    def start(self, leader: Sequence, spare: tuple[int, ...]) -> None:
        """A beam search admitted in leader's slot, its other beams to come in the spare slots."""
        self.scheduler.reserve(spare)
        limit = min(leader.request.max_tokens, self.max_seq_len - leader.prompt_length)
        self.searches[id(leader.request)] = Search(leader, list(spare), limit)

    def step(self, sequences: list[Sequence], logits: torch.Tensor) -> list[Sequence]:
        """Every search whose beams are sequences (all of each search's, in any order) takes a step
        from their logits [rows, vocab]: one read-back for all of them. The searches that ended,
        each as one of its beams (the engine then ends them: end)."""
        row_of = {id(sequence): row for row, sequence in enumerate(sequences)}
        searches = list({id(s.request): self.searches[id(s.request)] for s in sequences}.values())
        processes = any(search.request.logits_processors for search in searches)
        parts = []
        for search in searches:
            rows = [row_of[id(beam)] for beam in search.beams]
            model_scores = F.log_softmax(logits[rows].float(), dim=-1)  # beams, vocab
            scores = self._adjusted(search, model_scores)
            totals = scores + torch.tensor(search.scores, device=scores.device)[:, None]
            values, flat = torch.topk(totals.view(1, -1), search.candidates)
            # each token's log probability under the model, as the other rows report theirs
            parts += [values[0], flat[0], model_scores.view(-1)[flat[0]]]
        line = read_back([torch.cat([part.double() for part in parts])[None]], exchange=processes)[1][0]
        ended, start, vocab = [], 0, logits.shape[-1]
        for search in searches:
            count = search.candidates
            values, flat, chosen = (line[start + count * part : start + count * (part + 1)] for part in range(3))
            start += 3 * count
            chosen_next = search.advance(values, [int(index) for index in flat], chosen, vocab)
            if chosen_next is None:
                ended.append(search.beams[0])
                continue
            parents, tokens = chosen_next
            spare, search.spare = search.spare, []
            search.beams = self.scheduler.fork(search.beams, spare, parents, tokens)
        return ended

    def _adjusted(self, search: Search, scores: torch.Tensor) -> torch.Tensor:
        """The beams' next-token log probabilities [beams, vocab] adjusted as transformers' beam
        search adjusts them: the repetition penalty, the stop-token ban before min_tokens, banned
        words, then Python's logits processors (rank 0 only: its scores are read back)."""
        request, beams = search.request, search.beams
        vocab = scores.shape[-1]
        ban = stop_bans([request] * len(beams), [search.generated] * len(beams), vocab, scores.device)
        if request.bad_words:
            banned = [(row, token) for row, beam in enumerate(beams)
                      for token in banned_next(beam.tokens, request.bad_words)]
            if banned:
                ban = torch.zeros(len(beams), vocab, dtype=torch.bool, device=scores.device) if ban is None else ban
                rows, tokens = zip(*banned)
                ban[torch.tensor(rows, device=ban.device), torch.tensor(tokens, device=ban.device)] = True
        history = None
        if request.options.repetition_penalty != 1.0:
            history = torch.tensor([beam.tokens for beam in beams], device=scores.device)
        scores = adjust_logits(scores, request.options, history, ban)
        if request.logits_processors and parallel.model_parallel_rank() == 0:
            scores = apply_processors(scores, [(request.logits_processors, request.prompt_tokens,
                                                beam.tokens[beam.prompt_length :]) for beam in beams])
        return scores

    def end(self, sequence: Sequence, reason: str) -> Optional[Delta]:
        """End sequence's search (reason: "stop" once the search has ended, "length" for a prompt
        that fills the context, "cancelled"): every beam's slot and blocks given back; its last
        delta, with the answers (None if it has ended already). Its Progress's answer is the best."""
        search = self.searches.pop(id(sequence.request), None)
        if search is None:
            return None
        for beam in search.beams:
            if beam.slot.sequence is beam:
                self.scheduler.release(beam)
        self.scheduler.unreserve(search.slots)
        answers = search.answers() if search.generated else []
        progress, request = sequence.sampling, sequence.request
        finals = []
        for hypothesis, why in answers:
            answer = hypothesis.tokens[:-1] if why == "stop" else hypothesis.tokens
            logprobs = tuple(TokenLogprob(token, logprob) for token, logprob in zip(answer, hypothesis.logprobs))
            finals.append(Delta(self.tokenizer.decode(answer) if progress.decoder is not None else "", tuple(answer),
                                logprobs if request.logprobs else (), why if reason == "stop" else reason,
                                sequence.prompt_length, len(hypothesis.tokens), sequence.reused))
        if finals:  # the best: the request's own answer
            progress.answer = list(finals[0].tokens)
            progress.logprobs = list(finals[0].logprobs)
        best = finals[0] if finals else Delta(finish_reason=reason)
        return Delta(best.text, best.tokens, best.logprobs, best.finish_reason, sequence.prompt_length,
                     sum(final.completion_tokens for final in finals), sequence.reused, beams=tuple(finals))
