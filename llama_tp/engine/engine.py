"""The engine: requests in the KV cache's rows, and the step that advances all of them.

Every rank holds the same engine and is told the same admissions and cancellations, so every rank
decides alike: the scheduler's plan, each step's tokens (rank 0's choices, which reach the others
with the step's one read-back: choices.py), where answers end. A step feeds the model what each
sequence's cache row lacks (prompt chunks, and the generating rows' last tokens, in one pass where
the model can mix them), then chooses every generating row's next token in one call of the
sampler, each with its own options, generator and adjustments (grammar, logit_bias, penalties:
llama_tp/structured); with a speculator, the rows free of adjustments gain theirs in a round of
guesses instead (speculative/). Each step's Updates (one Delta per request) go back to whoever
drives the engine: a batch job or a stream (jobs.py), or the server's loop (serving.py).

What a token needs before the next step (its row's grammar, whether its sequence ends by its
token or its length, blocks given back) is done as it is read back; the rest of the host's part
(its text, stop strings, the Delta, the metrics: Made) is reported at once, or, where the device
runs a step while the host goes on (Engine.overlap: a GPU), after the next step has been launched,
so that the device does not wait for it. A sequence that its text ends then (a stop string) has
been fed once more meanwhile: that step's token for it is dropped, and its answer is the same.

It knows nothing of HTTP, of Llama's API or of files: it is given a model (with its KV cache and
the cache's record, model.prefix_cache), a tokenizer, and a speculator and grammars where the
model has them.
"""

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.nn.functional as F

from .. import parallel
from ..logs import logger
from ..model.kv_cache import BLOCK_POSITIONS
from ..model.transformer import Transformer
from ..sampling.sampler import TokenHistory, sample
from ..sampling.processors import apply_processors
from ..structured.rows import adjust_rows, make_adjustment
from ..text.streaming import IncrementalDecoder, cut_at_stop
from .beams import BeamSearches
from .choices import agreed_tokens, read_back
from .blocks import BlockPool
from .observer import CacheUse, Observer
from .progress import Candidates, Progress
from .requests import Delta, GenerationRequest, TokenLogprob
from .scheduler import Chunk, Scheduler, Sequence, prefill_passes
from .speculative import Row, Speculator
from .step import (batch_tensors, candidate_columns, logprob_columns, prompt_logprobs, prompt_targets, read_candidates,
                   read_logprob, round_extras, stop_bans)

if TYPE_CHECKING:  # xgrammar (the serve extra), imported where a request asks for a grammar
    import xgrammar

    from ..structured.grammars import Grammars

# With speculation, the acceptance so far is logged (debug) each time this many more rows are verified.
SPECULATION_REPORT_ROWS = 1000
# A constrained answer whose grammar allows no next token (the client's 400, code grammar_dead_end).
DEAD_END = ("the answer's grammar allows no next token: it cannot go on from where it is; loosen the "
            "schema, regex or grammar")


@dataclass(frozen=True)
class Admission:
    request: GenerationRequest
    slot: int
    seed: int  # the request's own, or one rank 0 drew: every rank samples alike
    grammar: Optional[int] = None  # its grammar's number on every rank's Shelf (serving.py; a batch job's: None)
    beam_slots: tuple[int, ...] = ()  # a beam search's: the free slots its other beams will take (beams.py)


@dataclass(frozen=True)
class Made:
    """A token a step chose for a sequence (or, token None, the end of one without a token: cancelled,
    its grammar's dead end, a prompt filling its context), waiting for its text, Delta and metrics."""

    sequence: Sequence
    token: Optional[int]
    end: Optional[str] = None  # the reason the sequence ends here, as known before its text
    logprob: Optional[TokenLogprob] = None
    at: float = 0.0  # when the token counts as made (time.monotonic), for the latencies
    candidates: Candidates = ()


@dataclass(frozen=True)
class Update:
    """What a step produced for one request: its sequence (the whole answer so far, in
    sequence.sampling) and the step's Delta (the last one has the finish reason)."""

    sequence: Sequence
    delta: Delta


class Engine:
    def __init__(self, model: Transformer, tokenizer, max_prefill_tokens: int, speculator: Optional[Speculator] = None,
                 grammars: "Optional[Callable[[], Grammars]]" = None, observer: Optional[Observer] = None,
                 text: bool = False, pool: Optional[BlockPool] = None, overlap: Optional[bool] = None):
        """max_prefill_tokens: prompt tokens fed a step beside the generating rows.
        grammars: the model's structured.grammars.Grammars, made when a first request asks for a
        constraint. observer: told of admissions, tokens, ends and the load (the server's metrics).
        text: every request's deltas carry its text (a server's, a stream's); otherwise only
        requests with stop strings watch their text. pool: the blocks of the model's KV cache, with
        the prefixes they hold from the engines before (by default a fresh one, holding none).
        overlap: report a step's tokens (text, deltas, metrics) after the next step is launched,
        while the device runs it (by default where the device runs apart from the host, a GPU, and
        without a speculator, whose rounds stop at a stop string's token)."""
        self.model = model
        self.tokenizer = tokenizer
        self.device = model.rotary.device
        self.scheduler = Scheduler(model.prefix_cache, max_prefill_tokens, pool or BlockPool(model.cache_blocks),
                                   lookahead=speculator.k if speculator is not None else 0, window=model.window)
        self.speculator = speculator  # None: one token a step
        self.grammars = grammars
        self.observer = observer
        self.text = text
        # Each cache row's tokens, for the repetition penalty: kept on the device, grown a token a step.
        self.history = TokenHistory(model.max_batch_size, model.max_seq_len, self.device)
        self.next_report = SPECULATION_REPORT_ROWS
        self.overlap = self.device.type == "cuda" and speculator is None if overlap is None else overlap
        if self.overlap and speculator is not None:
            raise ValueError("a speculating engine reports each token as it is made: it cannot overlap")
        self.made: list[Made] = []  # tokens and ends not yet reported
        self.launched = False  # whether this step has run a pass of the model yet
        self.updates: list[Update] = []  # the current step's
        self.beams = BeamSearches(self.scheduler, tokenizer, model.max_seq_len)

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    def find(self, request_id: str) -> Optional[Sequence]:
        return self.scheduler.find(request_id)

    def choose_slot(self, prompt: tuple[int, ...], taken: set[int]) -> Optional[int]:
        """The free cache row a new request should take, not one of those taken this step (rank 0
        decides; the others are told); None if there is none, or if the blocks of its prompt are
        not available (scheduler.py)."""
        return self.scheduler.choose_slot(prompt, taken)

    def choose_slots(self, request: GenerationRequest, taken: set[int]) -> Optional[tuple[int, ...]]:
        """choose_slot for a request: a beam search takes a slot for each of its beams."""
        count = request.beams.width if request.beams is not None else 1
        return self.scheduler.choose_slots(request.prompt_tokens, count, taken)

    # Admitting and cancelling

    def admit(self, admission: Admission, grammar: "Optional[xgrammar.CompiledGrammar]" = None) -> Sequence:
        """Start a request in its free cache row, sharing the cached blocks that hold a start of its
        prompt. grammar: its constraint's, compiled already (else compiled, or taken from the cache, here)."""
        request = admission.request
        # `n`'s later choices share the blocks of the first's prefill when it still runs
        follows = self.scheduler.find(request.shares_prefill_with) if request.shares_prefill_with else None
        sequence = self.scheduler.admit(request, admission.slot, follows)
        if sequence.reused:
            logger.debug(f"reusing the cache: {sequence.reused} of {sequence.prompt_length} prompt tokens held "
                         "from a request before")
        # The host's: a GPU step's rows then draw their numbers without a kernel each (sampler.on_device).
        generator = torch.Generator().manual_seed(admission.seed)
        watches_text = self.text or bool(request.stop)
        decoder = IncrementalDecoder(self.tokenizer, request.stop) if watches_text else None
        # structured outputs (llama_tp/structured): each rank keeps its own grammar state
        adjustment = make_adjustment(self.grammars, request.constraint, request.logit_bias, request.presence_penalty,
                                     request.frequency_penalty, request.thinking, grammar, request.bad_words)
        sequence.sampling = Progress(generator, decoder, adjustment)
        if request.beams is not None:
            self.beams.start(sequence, admission.beam_slots)
        if request.prompt_logprobs:
            # the prompt's first token, which nothing predicts (a one-token prompt is fed as a step, never scored)
            sequence.sampling.prompt_logprobs.append(0.0)
        if _penalises_repeats(request):
            self.history.reset(admission.slot, request.prompt_tokens)
        if self.observer is not None:
            self.observer.admitted(sequence)
            self._report_load()
        return sequence

    def cancel(self, request_id: str) -> list[Update]:
        """End a running request now (its client left): its last Update, "cancelled"."""
        self._report_made()
        sequence = self.scheduler.find(request_id)
        if sequence is not None:
            self._finish(sequence, "cancelled")
            self._report_made()
        return self._take_updates()

    def end_all(self) -> list[Update]:
        """End every running request cleanly with what it has (the server stopping)."""
        self._report_made()
        for sequence in self.scheduler.running:
            self._finish(sequence, "cancelled")
        self._report_made()
        return self._take_updates()

    # Steps

    @torch.inference_mode()
    def step(self) -> list[Update]:
        """Feed every running sequence what its cache row lacks (within the prefill budget), and
        advance each one whose pending tokens are all fed: what the step produced."""
        self.launched = False
        plan = self.scheduler.plan()
        self.model.block_tables.give_all(plan.tables)  # blocks handed out, shared, given back: one copy
        # starts shorter than a block, and blocks that beams shared, copied before one writes its own
        self.model.copy_blocks(plan.copies)
        # A prompt whose own log probabilities are asked for needs every position's logits: a pass
        # of its own (not again for one preempted after its first token, fed its tokens anew).
        scored = [chunk for chunk in plan.prefill if _scores_prompt(chunk.sequence)]
        prefill = [chunk for chunk in plan.prefill if not _scores_prompt(chunk.sequence)]
        for chunk in scored:
            self._prefill([chunk], every_position=True)
        if self.speculator is None and self.model.can_mix_batches:
            # One pass for all: every prompt chunk (unpadded) and the generating rows read the
            # weights once together, instead of once in a prompt pass and again in a decoding pass.
            batches = [[chunk] for chunk in prefill] + ([plan.decode] if plan.decode else [])
            if batches:
                self._feed(*batches, segments=True)
        else:
            # Compiled steps that take no prompts in (fixed shapes) and speculation's rounds:
            # prompt chunks first, in passes of their own, so that a new request's first token
            # waits for its own prefill only, not also for the batch's decoding pass (chunks are
            # at most max_prefill_tokens long).
            for chunks in prefill_passes(prefill, self.model.max_seq_len):
                self._prefill(chunks)
            if plan.decode:
                self._decode(plan.decode)
        if not (self.overlap and self.launched and self.scheduler.running):  # no next step to overlap
            self._report_made()
        if self.observer is not None:
            self._report_load()  # the running requests' answers grew
        return self._take_updates()

    def _prefill(self, chunks: list[Chunk], every_position: bool = False) -> None:
        """One pass over prompt chunks; the draft (if any) reads them too, chunk by chunk, rather
        than all at once in the sequence's first round, which would hold up the other rows' round."""
        self._feed(chunks, every_position=every_position)
        if self.speculator is not None and self.speculator.draft is not None:
            self.speculator.draft.catch_up([chunk.sequence.slot.index for chunk in chunks],
                                           [chunk.sequence.tokens[: chunk.start + len(chunk.tokens)] for chunk in chunks],
                                           plain=True)

    def _decode(self, chunks: list[Chunk]) -> None:
        """The generating sequences' next tokens: in a round of speculation, or a step."""
        if self.speculator is None:
            self._feed(chunks)
            return
        # structured outputs (llama_tp/structured): a draft's guesses are not checked against a
        # grammar, so adjusted rows decode a token a step beside the rounds
        adjusted = [chunk for chunk in chunks if not _speculates(chunk.sequence)]
        free = [chunk for chunk in chunks if _speculates(chunk.sequence)]
        if free:
            self._speculate(free)
        if adjusted:
            self._feed(adjusted)

    def _feed(self, *batches: list[Chunk], every_position: bool = False, segments: bool = False) -> None:
        """One pass over batches of chunks (prompt chunks, the shorter padded to the longest; or one
        token of each generating request), then the next token of each sequence whose pending tokens
        it fed. Several batches share the pass (Transformer.forward_segments). every_position: one
        batch of one prompt chunk, whose positions' logits give its prompt's log probabilities.
        segments: each batch is one prompt chunk but the last, which may be the generating rows;
        where steps run whole with prompts in them, a lone prompt chunk runs so too."""
        chunks = [chunk for batch in batches for chunk in batch]
        plain_greedy = not every_position and all(_takes_best_logit(c.sequence.request) for c in chunks if c.completes)
        lone_prompt_whole = segments and self.model.mixed_graphs is not None and len(chunks[0].tokens) > 1
        if len(batches) == 1 and not lone_prompt_whole:
            tokens, starts, slots, lengths = batch_tensors(chunks)
            width = tokens.shape[1]
            logits = self.model.forward(tokens, starts, last_only=not every_position, vocab_slice=plain_greedy,
                                        slots=slots, lengths=None if min(lengths) == width else lengths)
        else:
            logits = self.model.forward_segments([batch_tensors(batch)[:3] for batch in batches],
                                                 vocab_slice=plain_greedy)
        self.launched = True
        self._report_made()  # the step before's tokens, while the device runs this pass (overlap)
        for chunk in chunks:
            if chunk.sequence.sampling.ended is None:  # not ended by its text just now
                self.scheduler.fed(chunk)
        if every_position:
            self._keep_prompt_logprobs(chunks[0], logits[0])
            logits = logits[:, -1:]
        completing = [row for row, chunk in enumerate(chunks) if chunk.completes and chunk.sequence.sampling.ended is None]
        full = [row for row in completing if self._is_full(chunks[row].sequence)]
        for row in full:  # a prompt that fills the context: nothing more to choose
            self._finish(chunks[row].sequence, "length")
        completing = [row for row in completing if row not in full]
        if not completing:  # prompts' chunks before their last: nothing to choose yet
            return
        sequences = [chunks[row].sequence for row in completing]
        logits = logits[completing, -1] if len(completing) < len(chunks) else logits[:, -1]  # bsz, vocab (or a slice)
        searching = [row for row, sequence in enumerate(sequences) if sequence.request.beams is not None]
        if searching:  # beam searches choose their beams together (beams.py)
            self._search([sequences[row] for row in searching], logits[searching])
            kept = [row for row in range(len(sequences)) if row not in searching]
            if not kept:
                return
            sequences, logits = [sequences[row] for row in kept], logits[kept]
        # structured outputs, logit_bias, penalties, banned words (llama_tp/structured): free rows pay nothing
        logits = adjust_rows([s.sampling.adjustment for s in sequences], logits,
                             parallel.model_parallel_rank() * logits.shape[-1] if plain_greedy else 0,
                             self.model.args.vocab_size, [s.tokens for s in sequences])
        if parallel.model_parallel_rank() == 0:  # Python's logits processors, on rank 0's choice path only
            logits = apply_processors(logits, [(s.request.logits_processors, s.request.prompt_tokens,
                                                s.tokens[s.prompt_length :]) for s in sequences])
        if plain_greedy:  # each rank offers the best of its slice: no logits gathered, and every
            # rank picks the winner from the same gathered pairs, so they agree without rank 0's word
            picks = [(token, None, ()) for token in parallel.vocab_argmax(logits).tolist()]
        else:
            picks = self._choose(sequences, logits)
        now = time.monotonic()
        for sequence, (token, logprob, candidates) in zip(sequences, picks):
            self._advance(sequence, token, logprob, now, candidates)

    def _search(self, sequences: list[Sequence], logits: torch.Tensor) -> None:
        """A step of the beam searches whose beams these are (beams.py); those that end, end."""
        now = time.monotonic()
        for sequence in sequences:
            progress = sequence.sampling
            if progress.last_token_at != now:  # once a search (its beams share their progress)
                if self.observer is not None:
                    self.observer.token(sequence, now)
                progress.first_token_at = progress.first_token_at or now
                progress.last_token_at = now
        for sequence in self.beams.step(sequences, logits):
            self._finish(sequence, "stop")

    def _keep_prompt_logprobs(self, chunk: Chunk, logits: torch.Tensor) -> None:
        """The log probability of each prompt token the chunk's logits [width, vocab] predict, read
        back as rank 0 computed it."""
        progress = chunk.sequence.sampling
        if chunk.start == 0:  # scored again from its start (preempted during its prompt): the first's 0.0 stays
            del progress.prompt_logprobs[1:]
        targets = prompt_targets(chunk)
        if targets:
            progress.prompt_logprobs += [line[0] for line in read_back([prompt_logprobs(logits, targets)])[1]]

    def _choose(self, sequences: list[Sequence], logits: torch.Tensor) -> list[tuple[int, Optional[TokenLogprob], Candidates]]:
        """The next token of every sequence from its logits [rows, vocab], each with its own options
        and generator, in one call; its log probability under the model and the sampler's likeliest
        candidates where asked. The host reads the step back once (tokens and what is asked beside
        them, as rank 0 chose them: choices.py), twice in a step where some row's nucleus needed
        the full sort."""
        requests = [s.request for s in sequences]
        options = [request.options for request in requests]
        # Only rows that penalise repeats keep their tokens on the device (penalty 1 leaves the others' as they are).
        penalised = [row for row, request in enumerate(requests) if _penalises_repeats(request)]
        history = None
        if penalised:
            slots = torch.tensor([s.slot.index for s in sequences], device=self.device)
            history = self.history.ids[slots, : max(len(s.tokens) for s in sequences)]
        ban = stop_bans(requests, [s.generated for s in sequences], logits.shape[-1], self.device)
        draw = sample(logits, options, [s.sampling.generator for s in sequences], history, ban)
        top = max(request.top_logprobs for request in requests)
        most = max(request.top_candidates for request in requests)
        asks_logprobs = any(request.logprobs for request in requests)
        logprobs = F.log_softmax(logits.float(), dim=-1) if asks_logprobs else None
        candidates = candidate_columns(requests, logits, history, ban) if most else []
        tokens, rows = agreed_tokens(draw, lambda chosen: [*logprob_columns(chosen, logprobs, top), *candidates],
                                     exchange=any(request.logits_processors for request in requests))
        if penalised:
            at = torch.tensor(penalised, device=self.device)
            self.history.append(slots[at], torch.tensor([len(sequences[row].tokens) for row in penalised],
                                                        device=self.device), tokens[at])
        picks = []
        after = 3 + 2 * top if asks_logprobs else 2  # where the candidates' columns start
        for request, row in zip(requests, rows):
            token = int(row[0])
            logprob = read_logprob(row[2:], token, top, request.top_logprobs) if request.logprobs else None
            shown = read_candidates(row[after:], most, request.top_candidates) if request.top_candidates else ()
            picks.append((token, logprob, shown))
        return picks

    def _speculate(self, chunks: list[Chunk]) -> None:
        """A round of guesses for the generating sequences (each chunk the one token its slot
        lacks): one pass of the target verifies them all, each sequence gains a token or more."""
        sequences = [chunk.sequence for chunk in chunks]
        rows = [Row(s.slot.index, s.tokens, s.request.options, s.sampling.generator, s.prompt_length,
                    sorted(s.request.stop_tokens),
                    # guesses are written where the row holds blocks
                    min(s.request.max_tokens - s.generated, self.model.max_seq_len - len(s.tokens),
                        len(s.blocks) * BLOCK_POSITIONS - len(s.tokens) + 1))
                for s in sequences]
        requests = [s.request for s in sequences]
        outcomes = self.speculator.round(self.model, rows,
                                         want_logits=any(r.logprobs or r.top_candidates for r in requests))
        extras = round_extras(requests, rows, outcomes)
        now = time.monotonic()
        for sequence, outcome, gained in zip(sequences, outcomes, extras):
            if _penalises_repeats(sequence.request):
                self.history.write(sequence.slot.index, len(sequence.tokens), outcome.tokens)
            previous = sequence.sampling.last_token_at or now
            for index, token in enumerate(outcome.tokens):
                at = previous + (now - previous) * (index + 1) / len(outcome.tokens)  # the round's time, shared
                logprob, candidates = gained[index] if gained else (None, ())
                if self._advance(sequence, token, logprob, at, candidates):
                    break
        stats = self.speculator.stats
        if stats.verified_rows >= self.next_report:
            logger.debug(f"speculation ({self.speculator.mode}) so far: {stats.describe()}")
            self.next_report = stats.verified_rows + SPECULATION_REPORT_ROWS

    def _advance(self, sequence: Sequence, token: int, logprob: Optional[TokenLogprob], at: float,
                 candidates: Candidates = ()) -> bool:
        """Append a chosen token, ending the sequence where its token or its length ends it (then
        True); its text and Delta follow (_report_made). at: when the token counts as made
        (time.monotonic), for the latencies."""
        progress = sequence.sampling
        if progress.adjustment is not None and not progress.adjustment.accept(token):  # structured outputs
            # its grammar allowed no token at all: this answer ends, the others go on
            self._finish(sequence, "error")
        else:
            sequence.tokens.append(token)
            sequence.generated += 1
            end = "stop" if token in sequence.request.stop_tokens else "length" if self._is_full(sequence) else None
            if end is not None:
                self._end(sequence, end)
            self.made.append(Made(sequence, token, end, logprob, at, candidates))
        if not self.overlap:
            self._report_made()  # a speculation round's next token waits for this one's stop strings
        return progress.ended is not None

    def _is_full(self, sequence: Sequence) -> bool:
        """Whether sequence has reached its token limit, or the end of its cache row."""
        return sequence.generated >= sequence.request.max_tokens or len(sequence.tokens) >= self.model.max_seq_len

    # Ends

    def _finish(self, sequence: Sequence, reason: str) -> None:
        """End a running sequence without a token. reason "error": the one way a running answer
        fails alone, its grammar's dead end."""
        if sequence.request.beams is not None:  # every beam ends, in one last delta with the answers (beams.py)
            last = self.beams.end(sequence, reason)
            if last is not None:
                self._ended(Update(sequence, last), reason)
            return
        self._end(sequence, reason)
        self.made.append(Made(sequence, None, reason))

    def _end(self, sequence: Sequence, reason: str) -> None:
        """A sequence ends: its slot and blocks are free for the next plan."""
        self.scheduler.release(sequence)
        sequence.sampling.ended = reason

    # Reports: text, Deltas, metrics

    def _report_made(self) -> None:
        """Each token and end made since the last report: its text (and whether a stop string ends
        it there), its Delta and the metrics, in the order they were made."""
        made, self.made = self.made, []
        for item in made:
            if item.token is None:
                self._close(item.sequence, item.end, [])
            else:
                self._report_token(item)

    def _report_token(self, item: Made) -> None:
        sequence, token = item.sequence, item.token
        request, progress = sequence.request, sequence.sampling
        stopped = token in request.stop_tokens
        if not stopped:
            progress.answer.append(token)
            if item.logprob is not None:
                progress.logprobs.append(item.logprob)
            if request.top_candidates:
                progress.candidates.append(item.candidates)
        piece = progress.decoder.push(progress.answer) if progress.decoder is not None and not stopped else ""
        stopped = stopped or (progress.decoder is not None and progress.decoder.stopped)
        if self.observer is not None:  # before the times move on: it reads the last token's
            self.observer.token(sequence, item.at)
        if progress.first_token_at is None:
            progress.first_token_at = item.at
        progress.last_token_at = item.at
        delta = Delta(piece, () if token in request.stop_tokens else (token,), (item.logprob,) if item.logprob else ())
        if not stopped and item.end is None:
            self.updates.append(Update(sequence, delta))
            return
        if progress.ended is None:  # a stop string in its text
            self._end(sequence, "stop")
        self._close(sequence, "stop" if stopped else item.end, [delta])

    def _close(self, sequence: Sequence, reason: str, deltas: list[Delta]) -> None:
        """An ended sequence's last deltas, the last with its text's end and counts."""
        progress = sequence.sampling
        if progress.decoder is not None:
            text = cut_at_stop(self.tokenizer.decode(progress.answer), sequence.request.stop)
            deltas = deltas or [Delta()]
            deltas[-1] = _with_text(deltas[-1], deltas[-1].text + progress.decoder.finish(text))
        deltas = deltas or [Delta()]
        self.updates += [Update(sequence, delta) for delta in deltas[:-1]]
        last = Delta(deltas[-1].text, deltas[-1].tokens, deltas[-1].logprobs, reason, sequence.prompt_length,
                     sequence.generated, sequence.reused,
                     stop_string=progress.decoder.matched if progress.decoder is not None else None)
        if reason == "error":
            last = replace(last, error=DEAD_END, error_code="grammar_dead_end", error_status=400)
        self._ended(Update(sequence, last), reason)

    def _ended(self, update: Update, reason: str) -> None:
        self.updates.append(update)
        if self.observer is not None:
            self.observer.finished(update.sequence, reason)
            self._report_load()

    def _take_updates(self) -> list[Update]:
        updates, self.updates = self.updates, []
        return updates

    def _report_load(self) -> None:
        """The observer's gauges of the running requests: how many, and the cache blocks they hold."""
        requests = {id(sequence.request) for sequence in self.scheduler.running}  # a beam search's beams: one request
        self.observer.load(len(requests), self.cache_use())

    def cache_use(self) -> CacheUse:
        """The KV cache's blocks: held, cached, and the preemptions so far."""
        pool = self.scheduler.pool
        return CacheUse(pool.size, pool.held, len(pool.cached), self.scheduler.preemptions)


def _scores_prompt(sequence: Sequence) -> bool:
    """Whether a sequence's prompt chunks give its prompt's own log probabilities."""
    return bool(sequence.request.prompt_logprobs) and sequence.generated == 0


def _penalises_repeats(request: GenerationRequest) -> bool:
    return request.options.repetition_penalty != 1.0


def _takes_best_logit(request: GenerationRequest) -> bool:
    """Whether a request's next token is the model's best logit, with nothing read beside it."""
    return (request.options.takes_best_logit and not request.logprobs and not request.top_candidates
            and request.beams is None and not request.logits_processors)


def _speculates(sequence: Sequence) -> bool:
    """Whether a generating sequence gains its tokens in speculation's rounds: not where each token
    must pass its grammar, adjustments, beam search or Python's logits processors first."""
    request = sequence.request
    return sequence.sampling.adjustment is None and request.beams is None and not request.logits_processors


def _with_text(delta: Delta, text: str) -> Delta:
    return Delta(text, delta.tokens, delta.logprobs, delta.finish_reason)
