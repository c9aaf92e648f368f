"""The server's limits on what one request may make it do, checked before the work they bound:
a body's size and the time it takes to arrive (edge.py), the nesting of its JSON, a prompt's
text against max_seq_len before it is tokenized, and a grammar's size and compile time
(GrammarLimits, structured/constraint.py). Each is a 4xx naming what was too much, never a stalled
server: found by fuzzing the running server (issue 54)."""

import weakref
from dataclasses import dataclass, field
from typing import Any

from ..structured.constraint import GrammarLimits

# Arrays and objects nested in a body, and in the JSON text it carries (a tool call's arguments,
# a schema sent as a string): deeper is refused, before anything recurses through it.
MAX_JSON_DEPTH = 64
# A tokenizer's normalizer may join a few characters into one before tokenizing (NFC joins a
# letter and up to three marks): a token can stand for this many times its own text.
NORMALIZED_CHARACTERS = 4


@dataclass(frozen=True)
class ServerLimits:
    """What the HTTP side takes from one request (launch/serve.py's options of the same names)."""

    max_body_bytes: int = 16 * 2**20  # a request's body; beyond: 413
    read_timeout: float = 30.0  # seconds for a request's headers to arrive, then for its body; beyond: closed, 408
    grammar: GrammarLimits = field(default_factory=GrammarLimits)


def nesting_depth(value: Any) -> int:
    """How deep arrays and objects nest in a JSON value (0 for a scalar), without recursing."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


_LONGEST_TOKEN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def longest_token_chars(tokenizer) -> int:
    """The most characters of text one token of tokenizer's can stand for: its longest token's
    text (one more, for SentencePiece's leading space), computed once per tokenizer."""
    longest = _LONGEST_TOKEN.get(tokenizer)
    if longest is None:
        longest = _LONGEST_TOKEN[tokenizer] = 1 + max(len(tokenizer.decode([token])) for token in range(tokenizer.n_words))
    return longest


def text_beyond(characters: int, tokenizer, max_seq_len: int) -> bool:
    """Whether text of this many characters surely holds more than max_seq_len tokens, without
    tokenizing it: more characters than max_seq_len of the longest token could stand for."""
    if characters <= max_seq_len * NORMALIZED_CHARACTERS:  # as short as that needs no look at the vocabulary
        return False
    return characters > max_seq_len * longest_token_chars(tokenizer) * NORMALIZED_CHARACTERS
