"""Which request runs in which cache row, which blocks of the KV cache it holds, and what each
step feeds the model.

Pure bookkeeping, with no model and no process group: every rank holds the same scheduler, is
told the same admissions and cancellations, and so makes the same decisions.

A cache row (slot) is one of the max_batch_size rows a step runs; the keys and values live in the
pool's blocks (blocks.py), which a sequence holds as it grows (its block table). A request is
admitted to a free slot when the blocks of its prompt are available, taking at once the full
blocks that an earlier sequence filled with the same start (running or ended: a system prompt, a
conversation's turn before, the same question again), shared by reference, and fresh blocks for
the rest, the first of them a copy of a filled block that holds the next part of its start (a
system turn shorter than a block) where one does. Each step feeds the model the tokens of each
sequence that its slot does not hold yet (the model's PrefixCache record): one for a request
that is generating (these rows make one batch), a chunk of its prompt for a request being
prefilled (within a per-step budget, so that a long prompt never stalls the generating rows for
long; several prompts' chunks share a pass where padding them to one length costs little:
prefill_passes). A block that a sequence has filled is named (its key chains its tokens on its
parent's) so that later prompts can share it; a sequence that ends releases its blocks, the named
ones staying cached until the pool needs them back.
A generating sequence that needs a block when none is available preempts the newest sequence:
that one gives its blocks back and keeps its slot, its tokens, its random generator and the rest
of its state, and resumes when its blocks are available again by prefilling its tokens anew (from
what of them is still cached), so that it goes on as it would have.
A request's `n` choices run in n slots: the first prefills the prompt, the others wait for it,
then share the blocks it filled and feed only the rest.
A beam search's beams (beams.py) run in slots of their own, reserved at its admission: the first
prefills the prompt; at each step the beams that go on take over their parents' blocks by
reference (fork), and a beam that writes a block its siblings share copies it first
(copy-on-write: the step's copies, made before its pass). Its beams step together or not at all:
they are preempted together, and a beam that resumes prefills all its tokens but its last, which
it feeds with the others'.
Under a sliding window (Mistral's), a sequence gives back the blocks wholly before the window of
the next token it feeds, which no token of it will read again: a long answer holds about
window / BLOCK_POSITIONS + 1 blocks, not its length's (a block another sequence holds too stays
held by that one; a named one stays cached for prompts that start the same way). Its block table
names them NO_BLOCK (the scratch block, which the window's mask hides).
"""

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from ..model.kv_cache import BLOCK_POSITIONS, NO_BLOCK, blocks_for
from ..model.prefix_cache import PrefixCache
from .blocks import BlockKey, BlockPool, block_keys
from .requests import GenerationRequest


@dataclass
class Sequence:
    """A request in its slot: the prompt, then the tokens generated so far, and the blocks that hold them."""

    request: GenerationRequest
    slot: "Slot"
    tokens: list[int]
    admitted: int  # the admission's number: older requests' prompts are fed first, the newest preempted first
    reused: int = 0  # prompt tokens held already (shared blocks) at admission
    generated: int = 0
    sampling: Any = None  # the engine's per-request state (progress.py): random generator, text decoder
    follows: Optional["Sequence"] = None  # the choice whose prefill this one waits for, then shares
    blocks: list[int] = field(default_factory=list)  # its block table: the pool's blocks holding its positions
    behind: int = 0  # its first blocks, given back behind a sliding window (NO_BLOCK in blocks)
    keys: list[BlockKey] = field(default_factory=list)  # the keys of its first blocks, filled and named
    preempted: bool = False  # gave its blocks back; waits to be fed its tokens again

    @property
    def pending(self) -> list[int]:
        """Tokens the slot does not hold yet: what the next passes feed."""
        return self.tokens[len(self.slot.cached):]

    @property
    def prompt_length(self) -> int:
        return len(self.request.prompt_tokens)

    @property
    def held(self) -> list[int]:
        """The blocks it holds: its table but those given back behind a sliding window."""
        return self.blocks[self.behind:]


@dataclass
class Slot:
    """One row of a step: the sequence running there, if any."""

    index: int
    cached: list[int]  # tokens whose keys and values its blocks hold, from position 0 (the PrefixCache's row)
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
class StepPlan:
    decode: list[Chunk]  # one token each: one batch
    prefill: list[Chunk]  # in passes of their own (prefill_passes)
    tables: dict[int, list[int]] = field(default_factory=dict)  # slots' new block tables, given first
    copies: list[tuple[int, int]] = field(default_factory=list)  # (source, target) blocks copied before the pass


class Scheduler:
    def __init__(self, prefix_cache: PrefixCache, max_prefill_tokens: int, pool: BlockPool, lookahead: int = 0,
                 window: Optional[int] = None):
        """pool: the KV cache's blocks. lookahead: positions a generating sequence may write past
        its tokens in a step (a speculation round's guesses), held where blocks are free.
        window: the model's sliding window, where it hides positions (Transformer.window): a
        token sees itself and the window - 1 positions before it."""
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be positive, found {max_prefill_tokens}")
        self.prefix_cache = prefix_cache
        self.slots = [Slot(index, cached) for index, cached in enumerate(prefix_cache.rows)]
        self.max_prefill_tokens = max_prefill_tokens
        self.pool = pool
        self.lookahead = lookahead
        self.window = window
        self.admissions = 0
        self.preemptions = 0
        self.promised = 0  # blocks that slots chosen but not yet admitted will take
        self.tables: dict[int, list[int]] = {}  # slots whose block tables changed since the last plan
        self.copies: list[tuple[int, int]] = []  # blocks to copy before the next pass (copy-on-write)
        self.reserved: set[int] = set()  # free slots a beam search has taken for its beams to come

    @property
    def running(self) -> list[Sequence]:
        """Every sequence in a slot, preempted ones too (they keep theirs)."""
        return [slot.sequence for slot in self.slots if slot.sequence is not None]

    def free_slots(self) -> list[int]:
        return [slot.index for slot in self.slots if slot.sequence is None and slot.index not in self.reserved]

    def choose_slot(self, prompt: tuple[int, ...], taken: set[int]) -> Optional[int]:
        """The free slot a new request should take, not one of those already taken this step
        (rank 0 decides; the others are told); None if there is none, or if its prompt's blocks
        are not available (nor are any while a preempted sequence waits for its own)."""
        slots = self.choose_slots(prompt, 1, taken)
        return None if slots is None else slots[0]

    def choose_slots(self, prompt: tuple[int, ...], count: int, taken: set[int]) -> Optional[tuple[int, ...]]:
        """choose_slot for a request that runs in count slots (a beam search's beams): its
        prompt's blocks, and a block more for each beam's first token (the others' copies of the
        prompt's last block, or every beam's first block where the prompt fills its blocks)."""
        free = [index for index in self.free_slots() if index not in taken]
        if len(free) < count or any(sequence.preempted for sequence in self.running):
            return None
        forks = 0 if count == 1 else count - (1 if len(prompt) % BLOCK_POSITIONS else 0)
        needed = self._blocks_needed(list(prompt), self.prefix_cache.enabled) + forks
        if needed > self.pool.available - self.promised:
            return None
        self.promised += needed
        return tuple(free[:count])

    def _blocks_needed(self, tokens: list[int], reuse: bool) -> int:
        """The blocks that feeding tokens afresh takes from those available: new ones, and cached
        ones its start would share (held from then on, no longer available)."""
        shared = self.pool.cached_run(_shareable_keys(tokens)) if reuse else []
        return blocks_for(len(tokens)) - len(shared) + sum(block in self.pool.cached for block in shared)

    def admit(self, request: GenerationRequest, slot_index: int, follows: Optional[Sequence] = None) -> Sequence:
        """Start request in the given free slot, sharing the cached blocks that hold a start of its
        prompt; follows: a running sequence with the same prompt, whose blocks this one will share."""
        slot = self.slots[slot_index]
        assert slot.sequence is None, f"slot {slot_index} is taken"
        self.promised = 0  # every slot chosen is admitted before the next are chosen
        self.admissions += 1
        slot.sequence = Sequence(request, slot, list(request.prompt_tokens), self.admissions, follows=follows)
        # A prompt whose own log probabilities are asked for is computed whole: they need its logits.
        taken = self._take_blocks(slot.sequence, self.prefix_cache.enabled and not request.prompt_logprobs)
        assert taken, f"the blocks of a prompt of {len(request.prompt_tokens)} tokens are not available"
        slot.sequence.reused = len(slot.cached)
        return slot.sequence

    def _take_blocks(self, sequence: Sequence, reuse: bool) -> bool:
        """Give a sequence that holds none the blocks of its tokens: shared ones for the start that
        cached blocks hold (if reuse), fresh ones for the rest, the first of them a copy of the
        named block that holds the longest start of what follows (if reuse); False (nothing taken)
        if they are not available."""
        if self._blocks_needed(sequence.tokens, reuse) > self.pool.available:
            return False
        keys = _shareable_keys(sequence.tokens)
        shared = self.pool.cached_prefix(keys) if reuse else []
        held = len(shared) * BLOCK_POSITIONS
        source, copied = None, 0
        if reuse:  # short of the last token, which is fed to give the logits of the next
            parent = keys[len(shared) - 1] if shared else b""
            next_tokens = sequence.tokens[held : len(sequence.tokens) - 1]
            source, copied = self.pool.longest_start(parent, next_tokens, MIN_COPIED_START)
        fresh = self.pool.take(blocks_for(len(sequence.tokens)) - len(shared))
        assert fresh is not None
        if copied:  # copied before the next pass, which writes the rest of the block
            self.copies.append((source, fresh[0]))
        sequence.blocks, sequence.keys, sequence.behind = shared + fresh, keys[: len(shared)], 0
        self.prefix_cache.keep(sequence.slot.index, 0)
        self.prefix_cache.extend(sequence.slot.index, 0, sequence.tokens[: held + copied])
        self.tables[sequence.slot.index] = sequence.blocks
        return True

    def find(self, request_id: str) -> Optional[Sequence]:
        return next((s for s in self.running if s.request.id == request_id), None)

    def release(self, sequence: Sequence) -> None:
        """The sequence has ended: its slot is free, its blocks given back (those it filled cached)."""
        self._name_blocks(sequence)
        self.pool.release(sequence.held)
        sequence.blocks, sequence.keys, sequence.behind = [], [], 0
        sequence.slot.sequence = None

    def reserve(self, slots: Iterable[int]) -> None:
        """Free slots kept for a beam search's beams (fork places them there): no request takes them."""
        self.reserved.update(slots)

    def unreserve(self, slots: Iterable[int]) -> None:
        """A beam search has ended: the slots it kept and never filled are free again."""
        self.reserved.difference_update(slots)

    def fork(self, beams: list[Sequence], spare: list[int], parents: list[int], tokens: list[int]) -> list[Sequence]:
        """Beam search's step: new beam i is beams[parents[i]] followed by tokens[i], in a slot of
        the search (its parent's, where no sibling has taken it first; else one of the others, or
        of spare, its reserved slots), holding its parent's blocks by reference (a shared block is
        copied by the beam that writes it first: _grow). The beams that have no child end."""
        held = [(list(beam.tokens), list(beam.blocks), list(beam.keys), list(beam.slot.cached), beam.generated,
                 beam.behind) for beam in beams]
        places: list[Optional[int]] = [None] * len(parents)
        stays = {}  # parent: its first child, which takes over its slot (no record to rewrite)
        for index, parent in enumerate(parents):
            if parent not in stays:
                stays[parent] = index
                places[index] = beams[parent].slot.index
        free = [beam.slot.index for number, beam in enumerate(beams) if number not in stays] + list(spare)
        for index, parent in enumerate(parents):
            if places[index] is None:
                places[index] = free.pop(0)
        for parent in parents:  # the blocks it holds (not those left behind a sliding window)
            self.pool.share(beams[parent].held)
        for beam in beams:
            self.pool.release(beam.held)
            beam.blocks, beam.keys, beam.behind = [], [], 0
            beam.slot.sequence = None
        forked = []
        first = beams[0]
        for index, (parent, token) in enumerate(zip(parents, tokens)):
            parent_tokens, blocks, keys, cached, generated, behind = held[parent]
            slot = self.slots[places[index]]
            beam = Sequence(first.request, slot, parent_tokens + [token], first.admitted, first.reused, generated + 1,
                            first.sampling, blocks=blocks if stays[parent] == index else list(blocks), keys=list(keys),
                            behind=behind)
            if stays[parent] != index:  # the parent's record, in this slot
                self.prefix_cache.keep(slot.index, 0)
                self.prefix_cache.extend(slot.index, 0, cached)
            slot.sequence = beam
            self.reserved.discard(slot.index)
            self.tables[slot.index] = beam.blocks
            forked.append(beam)
        return forked

    def plan(self) -> StepPlan:
        """What this step feeds: every generating sequence's one token, and prompt chunks up to
        max_prefill_tokens, oldest request first; preempted sequences resume where their blocks are
        available, and a generating sequence that needs a block preempts the newest."""
        decode, prefill, budget = [], [], self.max_prefill_tokens
        for sequence in self.running:
            self._name_blocks(sequence)
            self._leave_behind(sequence)
        waiting = {id(sequence) for sequence in self.running if sequence.preempted}  # not those preempted now
        for sequence in sorted(self.running, key=lambda s: s.admitted):
            if sequence.preempted:
                if id(sequence) not in waiting or not self._resume(sequence):
                    continue  # still waiting
            if sequence.follows is not None:
                if _prefilling(sequence.follows):
                    continue  # its prompt's keys and values are on their way
                self._share_prefill(sequence)
            pending, start = sequence.pending, len(sequence.slot.cached)
            if len(pending) == 1:
                if not self._beams_ready(sequence) or not self._grow(sequence):
                    continue  # its beams wait for a sibling's prefill, or it preempted itself
                decode.append(Chunk(sequence, start, pending))
            elif pending and budget > 0:
                # a beam resuming after its first step stops short of its last token, fed with its siblings'
                room = len(pending) - 1 if sequence.request.beams is not None and sequence.generated else len(pending)
                prefill.append(Chunk(sequence, start, pending[: min(budget, room)]))
                budget -= len(prefill[-1].tokens)
        # A beam search preempted whole by its own last beam's growth: its other beams were planned already.
        decode = [chunk for chunk in decode if not chunk.sequence.preempted]
        prefill = [chunk for chunk in prefill if not chunk.sequence.preempted]
        # In cache-row order: rows that fill a block of the cache are read in place, not gathered.
        decode.sort(key=lambda chunk: chunk.sequence.slot.index)
        tables, self.tables = self.tables, {}
        copies, self.copies = self.copies, []
        return StepPlan(decode, prefill, tables, copies)

    def _resume(self, sequence: Sequence) -> bool:
        """A preempted sequence takes the blocks of its tokens again (a beam search's beams all
        together, or none of them); False if they are not available."""
        group = self.group(sequence)
        resumed = []
        for member in group:
            # A prompt whose own log probabilities are asked for is computed whole again.
            reuse = not (member.request.prompt_logprobs and member.generated == 0)
            if not self._take_blocks(member, reuse):
                for taken in resumed:  # not all of them: those that took blocks give them back
                    self.pool.release(taken.blocks)
                    taken.blocks, taken.keys = [], []
                    self.prefix_cache.keep(taken.slot.index, 0)
                    self.tables[taken.slot.index] = []
                return False
            resumed.append(member)
        for member in group:
            member.preempted = False
        return True

    def group(self, sequence: Sequence) -> list[Sequence]:
        """A beam search's running beams (in slot order), or the sequence alone."""
        if sequence.request.beams is None:
            return [sequence]
        return [other for other in self.running if other.request is sequence.request]

    def _beams_ready(self, sequence: Sequence) -> bool:
        """Whether every beam of sequence's search (if it is one) has its one token to feed: they step together."""
        return sequence.request.beams is None or all(
            not beam.preempted and len(beam.pending) == 1 for beam in self.group(sequence))

    def _grow(self, sequence: Sequence) -> bool:
        """Blocks enough for a generating sequence to write its next token (and its lookahead
        where blocks are free), preempting the newest sequences holding blocks for them; False if
        the newest was the sequence itself. The block it writes is its own: where a sibling beam
        holds it too, it writes a copy (copy-on-write)."""
        while len(sequence.blocks) < blocks_for(len(sequence.tokens)):
            taken = self._take_one(sequence)
            if taken is None:
                return False
            sequence.blocks.append(taken)
            self.tables[sequence.slot.index] = sequence.blocks
        index = (len(sequence.tokens) - 1) // BLOCK_POSITIONS  # the block its next token is written to
        while self.pool.holders[sequence.blocks[index]] > 1:
            taken = self._take_one(sequence)
            if taken is None:
                return False
            if self.pool.holders[sequence.blocks[index]] == 1:  # the sibling that shared it was preempted
                self.pool.release([taken])
                break
            self.copies.append((sequence.blocks[index], taken))
            self.pool.release([sequence.blocks[index]])
            sequence.blocks[index] = taken
            self.tables[sequence.slot.index] = sequence.blocks
        wanted = blocks_for(len(sequence.tokens) + self.lookahead) - len(sequence.blocks)
        if wanted > 0 and self.pool.free:
            sequence.blocks += self.pool.take(min(wanted, len(self.pool.free)))
            self.tables[sequence.slot.index] = sequence.blocks
        return True

    def _take_one(self, sequence: Sequence) -> Optional[int]:
        """A block for sequence, preempting the newest sequences holding blocks until one is
        available; None if the newest was the sequence itself (or one of its beam search's)."""
        while True:
            taken = self.pool.take(1)
            if taken is not None:
                return taken[0]
            newest = max((s for s in self.running if s.blocks), key=lambda s: s.admitted)
            self.preempt(newest)
            if sequence.preempted:
                return None

    def preempt(self, sequence: Sequence) -> None:
        """The sequence gives its blocks back (those it filled stay cached) and waits, in its slot,
        to be fed its tokens again; a beam search's beams all do."""
        for member in self.group(sequence):
            self._name_blocks(member)
            self.pool.release(member.held)
            member.blocks, member.keys, member.behind = [], [], 0
            member.follows = None  # resumes by prefilling its prompt, sharing what is still cached
            member.preempted = True
            self.prefix_cache.keep(member.slot.index, 0)
        self.preemptions += 1

    def _leave_behind(self, sequence: Sequence) -> None:
        """Under a sliding window, give back the sequence's blocks wholly before the first position
        that the next token it feeds sees (none of its later tokens sees further back): to the pool,
        cached where named (_name_blocks names every full block first), or still held by the other
        sequences that share them."""
        if self.window is None:
            return
        first_seen = len(sequence.slot.cached) - self.window + 1  # the next token's position is len(cached)
        behind = min(max(first_seen, 0) // BLOCK_POSITIONS, len(sequence.blocks))
        if behind <= sequence.behind:
            return
        self.pool.release(sequence.blocks[sequence.behind : behind])
        sequence.blocks[sequence.behind : behind] = [NO_BLOCK] * (behind - sequence.behind)
        sequence.behind = behind
        self.tables[sequence.slot.index] = sequence.blocks

    def _name_blocks(self, sequence: Sequence) -> None:
        """Name the blocks the sequence has filled since (a later prompt can share them)."""
        held = self.slots[sequence.slot.index].cached
        for index in range(len(sequence.keys), min(len(held) // BLOCK_POSITIONS, len(sequence.blocks))):
            parent = sequence.keys[-1] if sequence.keys else b""
            tokens = held[index * BLOCK_POSITIONS : (index + 1) * BLOCK_POSITIONS]
            sequence.keys.append(self.pool.name(sequence.blocks[index], parent, tokens))

    def _share_prefill(self, sequence: Sequence) -> None:
        """The followed sequence has filled the blocks of the prompt: share the full ones, giving
        back those this one took for them."""
        sequence.follows = None
        keys = _shareable_keys(sequence.tokens)
        shared = self.pool.cached_prefix(keys)
        if len(shared) * BLOCK_POSITIONS <= len(sequence.slot.cached):
            self.pool.release(shared)
            return
        self.pool.release(sequence.blocks[: len(shared)])
        sequence.blocks[: len(shared)] = shared
        sequence.keys = keys[: len(shared)]
        sequence.reused = len(shared) * BLOCK_POSITIONS
        self.prefix_cache.keep(sequence.slot.index, 0)
        self.prefix_cache.extend(sequence.slot.index, 0, sequence.tokens[: sequence.reused])
        self.tables[sequence.slot.index] = sequence.blocks

    def fed(self, chunk: Chunk) -> None:
        """The chunk's keys and values are in its slot now: the blocks it filled can be shared."""
        self.prefix_cache.extend(chunk.sequence.slot.index, chunk.start, chunk.tokens)
        self._name_blocks(chunk.sequence)


# The fewest tokens a prompt copies from the start of a filled block: a shorter start (a BOS, a
# role's header) is not worth copying a block in every layer, and would tie a request's numbers to
# the requests before it for nothing.
MIN_COPIED_START = BLOCK_POSITIONS // 4


def _shareable_keys(tokens: list[int]) -> list[BlockKey]:
    """The keys of the full blocks that a sequence of tokens may share: all but its last token's
    (which is fed again to give the logits of the next, and so written)."""
    return block_keys(tokens[:-1], BLOCK_POSITIONS)


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
    return sequence.slot.sequence is sequence and not sequence.preempted and len(sequence.pending) > 1
