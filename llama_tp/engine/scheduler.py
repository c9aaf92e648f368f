"""Which request runs in which cache row, and what each step feeds the model.

Pure bookkeeping, with no model and no process group: every rank holds the same scheduler, is
told the same admissions and cancellations, and so makes the same decisions.

Each cache row (slot) remembers the tokens whose keys and values it holds (the model's
PrefixCache). A request runs in a slot until it ends; each step feeds the model the tokens of its
sequence that the slot does not hold yet: one for a request that is generating (these rows make
one batch), a chunk of its prompt for a request being prefilled (within a per-step budget, so
that a long prompt never stalls the generating rows for long; several prompts' chunks share a
pass where padding them to one length costs little: prefill_passes).
A request that ended leaves its tokens in its slot: a later request that begins with them (the
next turn of a conversation, the same question again) takes that slot and skips their prefill;
one that shares a shorter start with another slot, ended or running (a system prompt), takes a
free slot and a copy of that start (a Copy in the step's plan), so that conversations stay
cached until their slots are the least recently used.
A request's `n` choices run in n slots: the first prefills the prompt, the others wait for it,
then copy what its slot holds of the prompt (a Copy in the step's plan) and feed only the rest.
"""

from dataclasses import dataclass, field
from typing import Any, Optional

from ..model.prefix_cache import MIN_COPIED_TOKENS, PrefixCache
from .requests import GenerationRequest


@dataclass
class Sequence:
    """A request in its slot: the prompt, then the tokens generated so far."""

    request: GenerationRequest
    slot: "Slot"
    tokens: list[int]
    admitted: int  # the admission's number: older requests' prompts are fed first
    reused: int = 0  # prompt tokens the slot held already
    generated: int = 0
    sampling: Any = None  # the engine's per-request state (progress.py): random generator, text decoder
    follows: Optional["Sequence"] = None  # the choice whose prefill this one waits for, then copies
    copy: Optional["Copy"] = None  # a start of its prompt held by another slot, copied before the next passes

    @property
    def pending(self) -> list[int]:
        """Tokens the slot does not hold yet: what the next passes feed."""
        return self.tokens[len(self.slot.cached):]

    @property
    def prompt_length(self) -> int:
        return len(self.request.prompt_tokens)


@dataclass
class Slot:
    """One row of the KV cache."""

    index: int
    cached: list[int]  # tokens whose keys and values it holds, from position 0 (the PrefixCache's row)
    sequence: Optional[Sequence] = None


@dataclass(frozen=True)
class Chunk:
    """Part of a sequence's pending tokens fed in one pass, from position start."""

    sequence: Sequence
    start: int
    tokens: list[int]

    @property
    def completes(self) -> bool:
        """Whether this chunk feeds the last pending token: its last logits choose the next token."""
        return self.start + len(self.tokens) == len(self.sequence.tokens)


@dataclass(frozen=True)
class Copy:
    """Cache row dest takes row source's keys and values at positions [start, end), before the step's passes."""

    source: int
    dest: int
    start: int
    end: int


@dataclass(frozen=True)
class StepPlan:
    decode: list[Chunk]  # one token each: one batch
    prefill: list[Chunk]  # in passes of their own (prefill_passes)
    copies: list[Copy] = field(default_factory=list)  # done first


class Scheduler:
    def __init__(self, prefix_cache: PrefixCache, max_prefill_tokens: int):
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be positive, found {max_prefill_tokens}")
        self.prefix_cache = prefix_cache
        self.slots = [Slot(index, cached) for index, cached in enumerate(prefix_cache.rows)]
        self.max_prefill_tokens = max_prefill_tokens
        self.admissions = 0

    @property
    def running(self) -> list[Sequence]:
        return [slot.sequence for slot in self.slots if slot.sequence is not None]

    def free_slots(self) -> list[int]:
        return [slot.index for slot in self.slots if slot.sequence is None]

    def choose_slot(self, prompt: tuple[int, ...], taken: set[int]) -> Optional[int]:
        """The free slot a new request should take, not one of those already taken this step
        (rank 0 decides; the others are told): the one holding the longest start of its prompt,
        else the least recently used; None if there is none."""
        free = [index for index in self.free_slots() if index not in taken]
        return self.prefix_cache.best_row(prompt, free) if free else None

    def admit(self, request: GenerationRequest, slot_index: int, follows: Optional[Sequence] = None) -> Sequence:
        """Start request in the given free slot, reusing what the slot holds of its prompt, or a
        longer start of it that another slot holds (copied); follows: a running sequence with the
        same prompt, whose prefill this one will copy."""
        slot = self.slots[slot_index]
        assert slot.sequence is None, f"slot {slot_index} is taken"
        prompt = request.prompt_tokens
        # A prompt whose own log probabilities are asked for is computed whole: they need its logits.
        reuse = not request.prompt_logprobs
        reused = self.prefix_cache.reusable(slot_index, prompt) if reuse else 0
        self.prefix_cache.keep(slot_index, reused)
        source, held = self.prefix_cache.longest_start(prompt, [s.index for s in self.slots if s.index != slot_index])
        copy = None
        if reuse and held - reused >= MIN_COPIED_TOKENS:
            # Planned now, done first in this step: before any pass writes the source slot again.
            self.prefix_cache.copy(source, slot_index, held)
            copy, reused = Copy(source, slot_index, reused, held), held
        self.admissions += 1
        slot.sequence = Sequence(request, slot, list(prompt), self.admissions, reused, follows=follows, copy=copy)
        return slot.sequence

    def find(self, request_id: str) -> Optional[Sequence]:
        return next((s for s in self.running if s.request.id == request_id), None)

    def release(self, sequence: Sequence) -> None:
        """The sequence has ended: its slot is free, holding no start that was to be copied and never was."""
        if sequence.copy is not None:  # ended before its first step (the server stopping)
            self.prefix_cache.keep(sequence.slot.index, sequence.copy.start)
        sequence.slot.sequence = None

    def plan(self) -> StepPlan:
        """What this step feeds: every generating sequence's one token, and prompt chunks up to
        max_prefill_tokens, oldest request first."""
        decode, prefill, copies, budget = [], [], [], self.max_prefill_tokens
        for sequence in sorted(self.running, key=lambda s: s.admitted):
            if sequence.copy is not None:  # in the order of admission: a copy may read the one before
                copies.append(sequence.copy)
                sequence.copy = None
            if sequence.follows is not None:
                if _prefilling(sequence.follows):
                    continue  # its prompt's keys and values are on their way
                copies += self._take_prefill(sequence)
            pending, start = sequence.pending, len(sequence.slot.cached)
            if len(pending) == 1:
                decode.append(Chunk(sequence, start, pending))
            elif pending and budget > 0:
                prefill.append(Chunk(sequence, start, pending[:budget]))
                budget -= len(prefill[-1].tokens)
        # In cache-row order: rows that fill a block of the cache are read in place, not gathered.
        decode.sort(key=lambda chunk: chunk.sequence.slot.index)
        return StepPlan(decode, prefill, copies)

    def _take_prefill(self, sequence: Sequence) -> list[Copy]:
        """What the followed sequence's slot holds of sequence's prompt beyond what its own slot
        does, as a copy (none if nothing more); the record says so from now on."""
        source, dest = sequence.follows.slot.index, sequence.slot.index
        sequence.follows = None
        held = self.prefix_cache.held(source, sequence.request.prompt_tokens)
        if held <= sequence.reused:
            return []
        self.prefix_cache.copy(source, dest, held)
        copy = Copy(source, dest, sequence.reused, held)
        sequence.reused = held
        return [copy]

    def fed(self, chunk: Chunk) -> None:
        """The chunk's keys and values are in its slot now."""
        self.prefix_cache.extend(chunk.sequence.slot.index, chunk.start, chunk.tokens)


def prefill_passes(chunks: list[Chunk], max_seq_len: int) -> list[list[Chunk]]:
    """The step's prompt chunks grouped into passes, longest first, the shorter chunks of a pass
    padded on the right to its first's length: one pass reads the weights once for all its rows
    (and on a GPU launches its kernels once), where a pass a chunk would read them once a chunk.
    A chunk joins a pass while the padded pass stays within MAX_PADDING times the tokens it
    feeds, and while its padding ends inside the cache."""
    passes: list[list[Chunk]] = []
    for chunk in sorted(chunks, key=lambda chunk: -len(chunk.tokens)):
        if passes:
            group, width = passes[-1], len(passes[-1][0].tokens)
            fed = sum(len(member.tokens) for member in group) + len(chunk.tokens)
            if (len(group) + 1) * width <= MAX_PADDING * fed and chunk.start + width <= max_seq_len:
                group.append(chunk)
                continue
        passes.append([chunk])
    return passes


# The most a prefill pass may compute, as a multiple of the prompt tokens it feeds (the rest is
# padding): a little wasted arithmetic buys reading the weights once for several prompts.
MAX_PADDING = 1.5


def _prefilling(sequence: Sequence) -> bool:
    """Whether sequence still runs and has prompt tokens its slot does not hold yet."""
    return sequence.slot.sequence is sequence and len(sequence.pending) > 1
