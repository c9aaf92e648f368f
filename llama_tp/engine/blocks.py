"""Which blocks of the KV cache each sequence holds, which are free, and which hold a prefix that
a later prompt can start from (vLLM's automatic prefix caching).

A block (kv_cache.BLOCK_POSITIONS positions) is free, held by one or more sequences (counted: a
prompt's blocks by the requests that start the same way, a beam search's by its beams), or
cached: held by none, but full, so that its keys and values are a known run of tokens after a
known start. A full block is named by a key made of its tokens and its parent's key (the key of
the block before it in its sequence), so one key names one whole prefix: a prompt whose first
blocks' keys are known starts from those blocks, shared by reference, not copied. Cached blocks
are handed out again, least recently used first, when no free block is left. A prompt that goes
on past its shared blocks as a named block after the same parent starts (a chat template's system
turn, shorter than a block, before a new question) starts from a copy of that block's first
positions, as llama.cpp's server and SGLang reuse a prefix by the token.

Every rank keeps the same pool (the same calls reach every rank) and gives out the same blocks.
"""

import hashlib
import itertools
from array import array
from collections import OrderedDict
from typing import Optional, Sequence

from ..model.prefix_cache import common_length

# A full block's name: a digest of its parent's key and its tokens (16 bytes, the same on every
# rank, as Python's own hash of None is not before 3.12, and far from colliding: two prefixes with
# one key would share keys and values that belong to one of them only).
BlockKey = bytes

# The named blocks after one parent that a prompt's next block is compared with, most recently
# named first: enough for the starts a server's clients share, few enough to cost microseconds.
COMPARED_STARTS = 16


def block_keys(tokens: Sequence[int], block_positions: int) -> list[BlockKey]:
    """The keys of the full blocks of a sequence of tokens, in order (its last, partial block has none)."""
    keys, parent = [], b""
    for start in range(0, len(tokens) - block_positions + 1, block_positions):
        parent = next_key(parent, tokens[start : start + block_positions])
        keys.append(parent)
    return keys


def next_key(parent: BlockKey, block: Sequence[int]) -> BlockKey:
    """The key of a full block of these tokens after the block keyed parent (b"": the first)."""
    return hashlib.blake2b(parent + array("q", block).tobytes(), digest_size=16).digest()


class BlockPool:
    def __init__(self, blocks: int):
        self.free: list[int] = list(range(blocks - 1, -1, -1))  # popped from the end: 0, 1, 2, ... first
        self.holders = [0] * blocks  # how many sequences hold each block
        self.key_of: dict[int, BlockKey] = {}  # full blocks' keys
        self.block_of: dict[BlockKey, int] = {}
        self.cached: OrderedDict[int, None] = OrderedDict()  # held by none, full: least recently used first
        self.parent_of: dict[int, BlockKey] = {}  # named blocks' parents' keys
        self.runs: dict[BlockKey, dict[int, tuple[int, ...]]] = {}  # by parent: named blocks' tokens, oldest first

    @property
    def available(self) -> int:
        """Blocks that can be handed out now: free, or cached (whose prefixes are then forgotten)."""
        return len(self.free) + len(self.cached)

    @property
    def size(self) -> int:
        return len(self.holders)

    @property
    def held(self) -> int:
        return len(self.holders) - self.available

    def cached_run(self, keys: Sequence[BlockKey]) -> list[int]:
        """The blocks that hold the longest run of these keys from the first, as they are (nothing taken)."""
        blocks = []
        for key in keys:
            block = self.block_of.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def take(self, count: int) -> Optional[list[int]]:
        """count blocks for a sequence to write, held by it; None (and nothing taken) if fewer are available."""
        if count > self.available:
            return None
        taken = []
        for _ in range(count):
            if self.free:
                block = self.free.pop()
            else:  # the least recently used cached prefix goes
                block, _ = self.cached.popitem(last=False)
                self._unname(block)
            self.holders[block] = 1
            taken.append(block)
        return taken

    def cached_prefix(self, keys: Sequence[BlockKey]) -> list[int]:
        """The blocks that hold the longest run of these keys from the first (a prompt's full blocks):
        each now held once more by the sequence that asked."""
        blocks = self.cached_run(keys)
        for block in blocks:
            self.cached.pop(block, None)
            self.holders[block] += 1
        return blocks

    def share(self, blocks: Sequence[int]) -> None:
        """Held blocks, each held once more (a beam takes over its parent's: beams.py). Only the
        holder that writes a shared block copies it first (copy-on-write: the scheduler's _grow)."""
        for block in blocks:
            assert self.holders[block], f"block {block} is not held"
            self.holders[block] += 1

    def name(self, block: int, parent: BlockKey, tokens: Sequence[int]) -> BlockKey:
        """A held block has just been filled with tokens after the block keyed parent: a later
        prompt that starts the same way can share it, or copy its start. Where another block holds
        that run already, this one stays unnamed (both hold the same keys and values; the first
        keeps the name). Its key, either way."""
        key = next_key(parent, tokens)
        if key not in self.block_of and block not in self.key_of:
            self.key_of[block] = key
            self.block_of[key] = block
            self.parent_of[block] = parent
            self.runs.setdefault(parent, {})[block] = tuple(tokens)
        return key

    def longest_start(self, parent: BlockKey, tokens: Sequence[int], shortest: int = 1) -> tuple[Optional[int], int]:
        """The named block after parent whose first tokens are the longest start of tokens (of the
        COMPARED_STARTS named last), and how many it shares; (None, 0) where none shares shortest
        or more. A cached block found is used: the last to be handed out again."""
        runs = self.runs.get(parent, {})
        tokens = tuple(tokens)
        best, longest = None, shortest - 1
        for block in itertools.islice(reversed(runs), COMPARED_STARTS):
            shared = common_length(runs[block], tokens)
            if shared > longest:
                best, longest = block, shared
        if best is None:
            return None, 0
        if best in self.cached:
            self.cached.move_to_end(best)
        return best, longest

    def release(self, blocks: Sequence[int]) -> None:
        """A sequence gives up its blocks (it ended, or was preempted): those no other sequence holds
        become cached where they are named, else free."""
        for block in reversed(blocks):  # a sequence's last blocks are the first to go again
            self.holders[block] -= 1
            if self.holders[block]:
                continue
            if block in self.key_of:
                self.cached[block] = None
            else:
                self.free.append(block)

    def forget(self) -> None:
        """No block names a prefix any more (a chat's /reset, a benchmark's cold prompts): the
        cached ones are free again; held ones stay held, unnamed."""
        self.free += reversed(self.cached)
        self.cached.clear()
        self.key_of.clear()
        self.block_of.clear()
        self.parent_of.clear()
        self.runs.clear()

    def _unname(self, block: int) -> None:
        """A cached block is handed out again: the prefix it held is forgotten."""
        del self.block_of[self.key_of.pop(block)]
        parent = self.parent_of.pop(block)
        del self.runs[parent][block]
        if not self.runs[parent]:
            del self.runs[parent]

    def release_all(self) -> None:
        """Every held block given back, as its sequences' release would (the engine that ran them
        is gone: one a caller stopped reading, one that failed)."""
        for block, holders in enumerate(self.holders):
            if holders:
                self.holders[block] = 1
                self.release([block])
