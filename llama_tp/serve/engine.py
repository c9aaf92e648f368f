"""The loop every rank runs in lockstep: each step rank 0 says what changed, then all of them feed
the model the same tokens and choose the same next tokens.

Rank 0 alone talks to the HTTP side (through the Mailbox): it keeps the waiting line, admits
requests into free cache rows and hears of clients that left. At the start of every step the
ranks exchange News: rank 0's admissions and cancellations, and every rank's wish to stop
(Ctrl-C or SIGTERM reach ranks one by one). Everything after that is decided alike on every rank
from what they all hold: the scheduler's plan, each step's tokens (rank 0's choices, which reach
the others with the step's read-back: choices.py), the stop tokens and strings.
While nothing runs, rank 0 waits for a request, sending a heartbeat now and then so that the
other ranks, waiting in the exchange, never reach the process group's timeout.
"""

import random
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Iterable, Optional

import torch
import torch.nn.functional as F

from .. import parallel
from ..logs import logger
from ..choices import agreed_tokens
from ..sampler import TokenHistory, sample
from ..speculative import Outcome, Row
from ..structured.constraint import Constraint
from ..structured.rows import RowAdjustment, adjust_rows, make_adjustment
from ..text.streaming import IncrementalDecoder, cut_at_stop
from .grammar_shelf import HeldRequests, Shelf
from .mailbox import ENGINE_FAILED, Cancel, Mailbox, ServerState
from .requests import Delta, GenerationRequest, RequestState, RequestStream, TokenLogprob
from .scheduler import Chunk, Scheduler, Sequence, prefill_passes

if TYPE_CHECKING:  # the generation API runs batch jobs through this engine (run_job)
    from ..generation import Llama

# The most a rank waits for news while nothing runs before the next heartbeat, in seconds.
MAX_HEARTBEAT_SECONDS = 10.0
# How often rank 0 asks the ranks, while nothing else runs, whether held requests' grammars are ready.
GRAMMAR_POLL_SECONDS = 0.05
# A constrained answer whose grammar allows no next token (the client's 400, code grammar_dead_end).
DEAD_END = ("the answer's grammar allows no next token: it cannot go on from where it is; loosen the "
            "schema, regex or grammar")


# With speculation, the acceptance so far is logged (debug) each time this many more rows are verified.
SPECULATION_REPORT_ROWS = 1000


@dataclass(frozen=True)
class Admission:
    request: GenerationRequest
    slot: int
    seed: int  # the request's own, or one rank 0 drew: every rank samples alike
    grammar: Optional[int] = None  # its grammar's number on every rank's Shelf (a batch job's: None)


@dataclass(frozen=True)
class News:
    """What changed since the last step, as rank 0 saw it."""

    admitted: tuple[Admission, ...] = ()
    cancelled: tuple[str, ...] = ()  # ids of running requests whose clients left
    stop: bool = False  # some rank was asked to stop: end every request and leave
    compile: tuple[tuple[int, Constraint], ...] = ()  # grammars every rank starts compiling, by number
    release: tuple[int, ...] = ()  # grammars no request uses any more


@dataclass
class Progress:
    """A running request's sampling and text: its random generator, and on rank 0 (or wherever
    stop strings must be watched) the decoder that turns its tokens into text."""

    generator: torch.Generator
    decoder: Optional[IncrementalDecoder]
    answer: list[int] = field(default_factory=list)  # generated tokens, without a stop token
    logprobs: list[TokenLogprob] = field(default_factory=list)  # the answer's, where the request asks
    first_token_at: Optional[float] = None
    last_token_at: Optional[float] = None
    adjustment: Optional[RowAdjustment] = None  # its grammar, logit_bias, penalties (None: free)


class Engine:
    def __init__(self, generator: "Llama", max_prefill_tokens: int, mailbox: Optional[Mailbox] = None,
                 on_finish: Optional[Callable[[Sequence, str], None]] = None):
        """mailbox: rank 0's, from the HTTP side; None on the other ranks (and in a batch job).
        on_finish: a batch job's: told of each sequence as it ends, with its finish reason."""
        self.generator = generator
        self.model = generator.model
        self.tokenizer = generator.tokenizer
        self.device = generator.model.rotary.device
        self.scheduler = Scheduler(generator.model.prefix_cache, max_prefill_tokens)
        self.mailbox = mailbox
        self.waiting: deque[RequestStream] = deque()  # rank 0: submitted, not yet admitted
        self.streams: dict[str, RequestStream] = {}  # rank 0: admitted requests' streams
        # Grammars compiled before their requests are admitted (grammar_shelf.py): every rank's, and rank 0's held requests.
        self.shelf = Shelf(generator)
        self.held = HeldRequests(parallel.model_parallel_size()) if mailbox is not None else None
        self.heartbeat = min(MAX_HEARTBEAT_SECONDS, parallel.collective_timeout().total_seconds() / 3)
        self.speculator = generator.speculator  # None: one token a step
        # Each cache row's tokens, for the repetition penalty: kept on the device, grown a token a step.
        self.history = TokenHistory(self.model.max_batch_size, self.model.max_seq_len, self.device)
        self.next_report = SPECULATION_REPORT_ROWS
        self.on_finish = on_finish

    def run(self, stop_requested: Callable[[], bool]) -> None:
        """Serve until some rank is asked to stop (then every request ends cleanly) or a rank is
        lost (then every request ends with an error, and the error is raised)."""
        try:
            while True:
                news = self._exchange(stop_requested())
                self._apply(news)
                if news.stop:
                    self._end_everything()
                    return
                if self.scheduler.running:
                    self._step()
                    if self.mailbox is not None:
                        self._report_load()  # the running requests' answers grew
        except BaseException as error:
            self._fail_everything(error)
            raise

    @torch.inference_mode()
    def run_job(self, requests: Iterable[tuple[GenerationRequest, int]]) -> None:
        """A batch job (Llama.generate's): every rank holds every request and its seed, so there
        is no news to exchange; each rank admits them in order as rows free up (a row that ends
        takes the next request at the next step) and steps until all have ended."""
        waiting = deque(requests)
        for request, _ in waiting:  # every rank compiles every grammar before the first step
            if request.constraint is not None:
                from ..structured.grammars import grammars_for  # xgrammar: only where a grammar is asked for

                grammars_for(self.generator).compile(request.constraint)
        while waiting or self.scheduler.running:
            admitted, taken = [], set()
            while waiting:
                slot = self.scheduler.choose_slot(waiting[0][0].prompt_tokens, taken)
                if slot is None:
                    break
                request, seed = waiting.popleft()
                taken.add(slot)
                admitted.append(Admission(request, slot, seed))
            self._apply(News(tuple(admitted)))
            self._step()

    # News

    def _exchange(self, stop_wish: bool) -> News:
        """Every rank's wish to stop, and rank 0's news, on every rank."""
        news = self._gather_news(stop_wish) if self.mailbox is not None else None
        compiled = self.shelf.finished()
        # A step without news, a wish to stop or a grammar compiled exchanges one byte a rank, no pickles.
        votes = parallel.gather_objects_if_any((news, stop_wish, compiled),
                                               stop_wish or bool(compiled) or (news is not None and news != News()))
        if votes is None:
            return News()
        if self.held is not None:
            for rank, (_, _, reports) in enumerate(votes):
                self.held.heard(rank, reports)
        news = votes[0][0]
        stop = any(wish for _, wish, _ in votes)
        return replace(news, stop=stop)

    def _gather_news(self, stop_wish: bool) -> News:
        """Rank 0: take the mailbox's messages (waiting for one while idle), admit what fits."""
        idle = not self.scheduler.running and not self.waiting and not stop_wish
        # Alone, nothing needs a heartbeat: wait until a request (or the stop signal's wake-up) comes.
        timeout = (self.heartbeat if parallel.model_parallel_size() > 1 else None) if idle else 0
        if idle and self.held.streams:  # a grammar compiles somewhere: ask again soon
            timeout = GRAMMAR_POLL_SECONDS
        cancelled = []
        for message in self.mailbox.take(timeout):
            if isinstance(message, RequestStream):
                if not self.held.hold(message):
                    self.waiting.append(message)
            elif message.request_id:  # an empty id is a wake-up only
                cancelled += self._cancel_request(message)
        for stream, failure in self.held.failed():
            self.mailbox.left_waiting()
            self._end_stream(stream, Delta(finish_reason="error", error=f"the request's grammar: {failure}",
                                           error_code="invalid_value", error_status=400), RequestState.FAILED)
        self.waiting.extend(self.held.ready())
        admitted, taken = [], set()
        while self.waiting and not stop_wish:
            stream = self.waiting[0]
            slot = self.scheduler.choose_slot(stream.request.prompt_tokens, taken)
            if slot is None:
                break
            self.waiting.popleft()
            self.mailbox.left_waiting()
            taken.add(slot)
            seed = stream.request.options.seed
            admitted.append(Admission(stream.request, slot, random.getrandbits(63) if seed is None else seed,
                                      self.held.number(stream.request)))
            self.streams[stream.request.id] = stream
        return News(tuple(admitted), tuple(cancelled), stop_wish, *self.held.news())

    def _cancel_request(self, message: Cancel) -> list[str]:
        """A client left: drop its request from the waiting line (or the held ones) here, or tell every rank."""
        waiting = next((s for s in [*self.waiting, *self.held.streams] if s.request.id == message.request_id), None)
        if waiting is not None:
            (self.waiting if waiting in self.waiting else self.held.streams).remove(waiting)
            self.mailbox.left_waiting()
            self._end_stream(waiting, Delta(finish_reason="cancelled"), RequestState.CANCELLED)
            return []
        return [message.request_id] if self.scheduler.find(message.request_id) else []

    def _apply(self, news: News) -> None:
        self.shelf.start(news.compile)
        self.shelf.release(news.release)
        for request_id in news.cancelled:
            sequence = self.scheduler.find(request_id)
            if sequence is not None:
                self._finish(sequence, "cancelled", [])
        for admission in news.admitted:
            request = admission.request
            # `n`'s later choices copy the first's prefill (scheduler.Copy) when it still runs
            follows = self.scheduler.find(request.shares_prefill_with) if request.shares_prefill_with else None
            sequence = self.scheduler.admit(request, admission.slot, follows)
            generator = torch.Generator(device=self.device).manual_seed(admission.seed)
            watches_text = self.mailbox is not None or bool(admission.request.stop)
            decoder = IncrementalDecoder(self.tokenizer, admission.request.stop) if watches_text else None
            # structured outputs (llama_tp/structured): each rank keeps its own grammar state
            grammar = None if admission.grammar is None else self.shelf.grammar(admission.grammar)
            adjustment = make_adjustment(self.generator, request.constraint, request.logit_bias,
                                         request.presence_penalty, request.frequency_penalty, request.thinking,
                                         grammar)
            sequence.sampling = Progress(generator, decoder, adjustment=adjustment)
            self.history.reset(admission.slot, request.prompt_tokens)
            if self.mailbox is not None:
                self.mailbox.metrics.prompt_tokens.inc(sequence.prompt_length)
                self.mailbox.metrics.cached_prompt_tokens.inc(sequence.reused)
                self._report_load()

    # Steps

    def _step(self) -> None:
        plan = self.scheduler.plan()
        for copy in plan.copies:  # a shared start of a prompt, or a prompt prefilled once for several choices
            self.model.copy_cache_positions(copy.source, copy.dest, copy.start, copy.end)
        if self.speculator is None and self.model.can_mix_batches:
            # One pass for all: every prompt chunk (unpadded) and the generating rows read the
            # weights once together, instead of once in a prompt pass and again in a decoding pass.
            batches = [[chunk] for chunk in plan.prefill] + ([plan.decode] if plan.decode else [])
            if batches:
                self._feed(*batches)
            return
        # Compiled steps (fixed shapes) and speculation's rounds: prompt chunks first, in passes of
        # their own, so that a new request's first token waits for its own prefill only, not also
        # for the batch's decoding pass (chunks are at most max_prefill_tokens long).
        for chunks in prefill_passes(plan.prefill, self.model.max_seq_len):
            self._feed(chunks)
            if self.speculator is not None and self.speculator.draft is not None:
                # The draft reads the prompt chunk by chunk too, rather than all at once in the
                # sequence's first round, which would hold up the other rows' round.
                self.speculator.draft.catch_up([chunk.sequence.slot.index for chunk in chunks],
                                               [chunk.sequence.tokens[: chunk.start + len(chunk.tokens)] for chunk in chunks],
                                               plain=True)
        if plan.decode:
            if self.speculator is not None:
                # structured outputs (llama_tp/structured): a draft's guesses are not checked
                # against a grammar, so adjusted rows decode a token a step beside the rounds
                adjusted = [chunk for chunk in plan.decode if chunk.sequence.sampling.adjustment is not None]
                free = [chunk for chunk in plan.decode if chunk.sequence.sampling.adjustment is None]
                if free:
                    self._speculate(free)
                if adjusted:
                    self._feed(adjusted)
            else:
                self._feed(plan.decode)

    def _report_load(self) -> None:
        """Rank 0's gauges of the running requests: how many, and the cache positions they hold."""
        running = self.scheduler.running
        self.mailbox.metrics.requests_running.set(len(running))
        held = sum(len(sequence.tokens) for sequence in running)
        self.mailbox.metrics.kv_cache_usage.set(held / (self.model.max_batch_size * self.model.max_seq_len))

    def _speculate(self, chunks: list[Chunk]) -> None:
        """A round of guesses for the generating sequences (each chunk the one token its slot
        lacks): one pass of the target verifies them all, each sequence gains a token or more."""
        sequences = [chunk.sequence for chunk in chunks]
        rows = [Row(s.slot.index, s.tokens, s.request.options, s.sampling.generator, s.prompt_length,
                    sorted(s.request.stop_tokens),
                    min(s.request.max_tokens - s.generated, self.model.max_seq_len - len(s.tokens)))
                for s in sequences]
        requests = [s.request for s in sequences]
        outcomes = self.speculator.round(self.model, rows, want_logits=any(r.logprobs for r in requests))
        logprobs = _round_logprobs(requests, outcomes)
        now = time.monotonic()
        for sequence, outcome, row_logprobs in zip(sequences, outcomes, logprobs):
            self.history.write(sequence.slot.index, len(sequence.tokens), outcome.tokens)
            previous = sequence.sampling.last_token_at or now
            for index, token in enumerate(outcome.tokens):
                at = previous + (now - previous) * (index + 1) / len(outcome.tokens)  # the round's time, shared
                if self._advance(sequence, token, row_logprobs[index] if row_logprobs else None, at):
                    break
        stats = self.speculator.stats
        if stats.verified_rows >= self.next_report:
            logger.debug(f"speculation ({self.speculator.mode}) so far: {stats.describe()}")
            self.next_report = stats.verified_rows + SPECULATION_REPORT_ROWS

    def _feed(self, *batches: list[Chunk]) -> None:
        """One pass over batches of chunks (prompt chunks, the shorter padded to the longest; or one
        token of each generating request), then the next token of each sequence whose pending tokens
        it fed. Several batches share the pass (Transformer.forward_segments)."""
        chunks = [chunk for batch in batches for chunk in batch]
        plain_greedy = all(c.sequence.request.options.takes_best_logit and not c.sequence.request.logprobs
                           for c in chunks if c.completes)
        if len(batches) == 1:
            tokens, starts, slots, lengths = self._batch_tensors(chunks)
            width = tokens.shape[1]
            logits = self.model.forward(tokens, starts, last_only=True, vocab_slice=plain_greedy, slots=slots,
                                        lengths=None if min(lengths) == width else lengths)
        else:
            logits = self.model.forward_segments([self._batch_tensors(batch)[:3] for batch in batches],
                                                 vocab_slice=plain_greedy)
        for chunk in chunks:
            self.scheduler.fed(chunk)
        completing = [row for row, chunk in enumerate(chunks) if chunk.completes]
        if not completing:  # prompts' chunks before their last: nothing to choose yet
            return
        sequences = [chunks[row].sequence for row in completing]
        logits = logits[completing, -1] if len(completing) < len(chunks) else logits[:, -1]  # bsz, vocab (or a slice)
        # structured outputs, logit_bias, penalties (llama_tp/structured): free rows pay nothing
        logits = adjust_rows([s.sampling.adjustment for s in sequences], logits,
                             parallel.model_parallel_rank() * logits.shape[-1] if plain_greedy else 0,
                             self.model.args.vocab_size)
        if plain_greedy:  # each rank offers the best of its slice: no logits gathered, and every
            # rank picks the winner from the same gathered pairs, so they agree without rank 0's word
            picks = [(token, None) for token in parallel.vocab_argmax(logits).tolist()]
        else:
            picks = self._choose(sequences, logits)
        now = time.monotonic()
        for sequence, (token, logprob) in zip(sequences, picks):
            self._advance(sequence, token, logprob, now)

    def _batch_tensors(self, chunks: list[Chunk]) -> tuple[torch.Tensor, list[int], list[int], list[int]]:
        """chunks' tokens as one batch [rows, longest], the shorter padded on the right; their start
        positions, cache rows and lengths."""
        lengths = [len(chunk.tokens) for chunk in chunks]
        width = max(lengths)
        tokens = torch.tensor([chunk.tokens + [0] * (width - len(chunk.tokens)) for chunk in chunks], device=self.device)
        return tokens, [chunk.start for chunk in chunks], [c.sequence.slot.index for c in chunks], lengths

    def _choose(self, sequences: list[Sequence], logits: torch.Tensor) -> list[tuple[int, Optional[TokenLogprob]]]:
        """The next token of every sequence from its logits [rows, vocab], each with its own options
        and generator, in one call; and its log probability under the model where asked. The host
        reads the step back once (tokens, log probabilities and the likeliest alternatives
        together, as rank 0 chose them: choices.py), twice in a step where some row's nucleus needed
        the full sort."""
        slots = torch.tensor([s.slot.index for s in sequences], device=self.device)
        options = [s.request.options for s in sequences]
        lengths = [len(s.tokens) for s in sequences]
        history = None
        if any(o.repetition_penalty != 1.0 for o in options):
            history = self.history.ids[slots, : max(lengths)]
        draw = sample(logits, options, [s.sampling.generator for s in sequences], history,
                      self._stop_bans(sequences, logits.shape[-1]))
        top = max(s.request.top_logprobs for s in sequences)
        logprobs = F.log_softmax(logits.float(), dim=-1) if any(s.request.logprobs for s in sequences) else None
        tokens, rows = agreed_tokens(draw, lambda chosen: _logprob_columns(chosen, logprobs, top))
        self.history.append(slots, torch.tensor(lengths, device=self.device), tokens)
        picks = []
        for sequence, row in zip(sequences, rows):
            token, request = int(row[0]), sequence.request
            logprob = None
            if request.logprobs:
                n = request.top_logprobs
                ids, values = row[3 : 3 + top][:n], row[3 + top :][:n]
                logprob = TokenLogprob(token, row[2], tuple((int(i), v) for i, v in zip(ids, values)))
            picks.append((token, logprob))
        return picks

    def _stop_bans(self, sequences: list[Sequence], vocab: int) -> Optional[torch.Tensor]:
        """Each row's stop tokens, banned while it has generated fewer than its min_gen_len:
        [rows, vocab] bool, or None when no row bans any."""
        rows, tokens = [], []
        for row, sequence in enumerate(sequences):
            if sequence.generated < sequence.request.options.min_gen_len:  # no end of answer yet
                stop_tokens = sorted(sequence.request.stop_tokens)
                rows += [row] * len(stop_tokens)
                tokens += stop_tokens
        if not rows:
            return None
        ban = torch.zeros(len(sequences), vocab, dtype=torch.bool, device=self.device)
        ban[torch.tensor(rows, device=self.device), torch.tensor(tokens, device=self.device)] = True
        return ban

    def _advance(self, sequence: Sequence, token: int, logprob: Optional[TokenLogprob], at: float) -> bool:
        """Append a chosen token and end the sequence where it ends (then True); rank 0 hands the
        client its text. at: when the token counts as made (time.monotonic), for the latencies."""
        request, progress = sequence.request, sequence.sampling
        if progress.adjustment is not None and not progress.adjustment.accept(token):  # structured outputs
            # its grammar allowed no token at all: this answer ends, the others go on
            self._finish(sequence, "error", [])
            return True
        sequence.tokens.append(token)
        sequence.generated += 1
        stopped = token in request.stop_tokens
        if not stopped:
            progress.answer.append(token)
            if logprob is not None:
                progress.logprobs.append(logprob)
        piece = progress.decoder.push(progress.answer) if progress.decoder is not None and not stopped else ""
        stopped = stopped or (progress.decoder is not None and progress.decoder.stopped)
        full = sequence.generated >= request.max_tokens or len(sequence.tokens) >= self.model.max_seq_len
        if self.mailbox is not None:
            if progress.first_token_at is None:
                progress.first_token_at = at
                self.mailbox.metrics.time_to_first_token.observe(at - request.arrival)
            else:
                self.mailbox.metrics.inter_token_latency.observe(at - progress.last_token_at)
            progress.last_token_at = at
            self.mailbox.metrics.generation_tokens.inc()
        delta = Delta(piece, () if token in request.stop_tokens else (token,), (logprob,) if logprob else ())
        if stopped or full:
            self._finish(sequence, "stop" if stopped else "length", [delta])
        elif self.mailbox is not None:
            self.streams[request.id].put(delta)
        return stopped or full

    # Ends

    def _finish(self, sequence: Sequence, reason: str, deltas: list[Delta]) -> None:
        """End a running sequence on every rank; rank 0 sends its last text and counts. reason
        "error": the one way a running answer fails alone, its grammar's dead end (a 400)."""
        self.scheduler.release(sequence)
        if self.on_finish is not None:
            self.on_finish(sequence, reason)
        if self.mailbox is None:
            return
        stream = self.streams.pop(sequence.request.id)
        progress = sequence.sampling
        if progress.decoder is not None:
            text = cut_at_stop(self.tokenizer.decode(progress.answer), sequence.request.stop)
            deltas = deltas or [Delta()]
            deltas[-1] = _with_text(deltas[-1], deltas[-1].text + progress.decoder.finish(text))
        for delta in deltas[:-1]:
            stream.put(delta)
        last = Delta(deltas[-1].text, deltas[-1].tokens, deltas[-1].logprobs, reason, sequence.prompt_length,
                     sequence.generated, sequence.reused,
                     stop_string=progress.decoder.matched if progress.decoder is not None else None)
        if reason == "error":
            last = replace(last, error=DEAD_END, error_code="grammar_dead_end", error_status=400)
        if progress.first_token_at is not None and sequence.generated > 1:
            per_token = (progress.last_token_at - progress.first_token_at) / (sequence.generated - 1)
            self.mailbox.metrics.time_per_output_token.observe(per_token)
        if reason != "cancelled":
            self.mailbox.metrics.request_latency.observe(time.monotonic() - sequence.request.arrival)
        state = {"cancelled": RequestState.CANCELLED, "error": RequestState.FAILED}.get(reason, RequestState.FINISHED)
        self._end_stream(stream, last, state)
        self._report_load()

    def _end_stream(self, stream: RequestStream, delta: Delta, state: RequestState) -> None:
        """Rank 0: a request's last delta, wherever it was (held, waiting or running)."""
        stream.put(delta)
        self.held.ended(stream.request)
        self.mailbox.metrics.requests_ended.labels(state.value).inc()

    def _end_everything(self) -> None:
        """Stopping: running requests end cleanly with what they have; waiting ones are refused."""
        for sequence in self.scheduler.running:
            self._finish(sequence, "cancelled", [])
        if self.mailbox is not None:
            self.mailbox.set_state(ServerState.STOPPING)
            refused = Delta(finish_reason="error", error="the server is shutting down", error_code="service_unavailable")
            for stream in [*self.waiting, *self.held.streams, *self.mailbox.drain()]:
                self.mailbox.left_waiting()
                self._end_stream(stream, refused, RequestState.CANCELLED)
            self.waiting.clear()
            self.held.streams.clear()

    def _fail_everything(self, error: BaseException) -> None:
        """A rank is lost (or this one broke): /health says 503 and nothing more is queued, then
        every request, running, waiting or still in the mailbox, ends with OpenAI's error
        (engine_failed). Why goes to the log: the error's text can hold internal addresses."""
        if self.mailbox is None:
            return
        self.mailbox.set_state(ServerState.FAILED)
        reason = parallel.describe_peer_failure(error) if parallel.is_peer_failure(error) else f"{type(error).__name__}: {error}"
        logger.error(f"the engine stopped: {reason}")
        failed = Delta(finish_reason="error", error=ENGINE_FAILED)
        for stream in [*self.streams.values(), *self.waiting, *self.held.streams, *self.mailbox.drain()]:
            self._end_stream(stream, failed, RequestState.FAILED)
        self.streams.clear()
        self.waiting.clear()
        self.held.streams.clear()
        self.mailbox.metrics.requests_running.set(0)
        self.mailbox.metrics.requests_waiting.set(0)
        self.mailbox.metrics.kv_cache_usage.set(0)


def _round_logprobs(requests: list[GenerationRequest], outcomes: list[Outcome]) -> list[Optional[list[TokenLogprob]]]:
    """Each asking request's log probabilities of the tokens its speculation round gained (under
    the model's logits, before any sampling option), with the likeliest tokens where asked; None
    for the others. Read back once for every row, after the round's own read-back of its tokens."""
    asking = [row for row, request in enumerate(requests) if request.logprobs]
    if not asking:
        return [None] * len(requests)
    logits = torch.cat([outcomes[row].logits[: len(outcomes[row].tokens)] for row in asking])
    tokens = torch.tensor([token for row in asking for token in outcomes[row].tokens], device=logits.device)
    top = max(requests[row].top_logprobs for row in asking)
    columns = _logprob_columns(tokens, F.log_softmax(logits.float(), dim=-1), top)
    values = iter(torch.cat([column.double() for column in columns], dim=-1).tolist())
    result: list[Optional[list[TokenLogprob]]] = [None] * len(requests)
    for row in asking:
        n = requests[row].top_logprobs
        lines = [next(values) for _ in outcomes[row].tokens]
        result[row] = [TokenLogprob(token, line[0], tuple(zip(map(int, line[1 : 1 + n]), line[1 + top : 1 + top + n])))
                       for token, line in zip(outcomes[row].tokens, lines)]
    return result


def _logprob_columns(tokens: torch.Tensor, logprobs: Optional[torch.Tensor], top: int) -> list[torch.Tensor]:
    """What a step reads back beside its tokens [rows], with logprobs [rows, vocab]: each token's
    log probability, then the `top` likeliest ids and their log probabilities."""
    if logprobs is None:
        return []
    columns = [logprobs.gather(-1, tokens[:, None])]
    if top:
        values, ids = logprobs.topk(top, dim=-1)
        columns += [ids, values]
    return columns


def _with_text(delta: Delta, text: str) -> Delta:
    return Delta(text, delta.tokens, delta.logprobs, delta.finish_reason)
