"""Turning tokens into text piece by piece, and cutting text at stop strings.

Pieces are only emitted when they are final: never half a multi-byte character (SentencePiece's
byte-fallback tokens and tiktoken's byte tokens decode an incomplete character to U+FFFD), and
never the beginning of a stop string that may still complete.
"""

from typing import Callable, Iterator, Optional, Sequence

INCOMPLETE = "\ufffd"  # what decoders print for bytes that do not form a whole character yet


def check_stop(stop: Optional[Sequence[str]]) -> tuple[str, ...]:
    """Stop strings as a tuple; a lone string or an empty one is a user mistake."""
    if stop is None:
        return ()
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise ValueError(f"stop must be a list of strings, e.g. ['\\n\\n'], found {stop!r}")
    if any(s == "" for s in stop):
        raise ValueError(f"stop strings must not be empty, found {list(stop)!r}")
    return tuple(stop)


def find_stop(text: str, stop: Sequence[str], start: int = 0) -> int:
    """Where the earliest stop string begins in text[start:], as an index into text; -1 if none."""
    found = [i for i in (text.find(s, start) for s in stop) if i >= 0]
    return min(found) if found else -1


def cut_at_stop(text: str, stop: Sequence[str], start: int = 0) -> str:
    """text up to (not including) the first stop string found at or after start."""
    index = find_stop(text, stop, start)
    return text if index < 0 else text[:index]


def stop_prefix_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest end of text that is the beginning of a stop string (it may complete)."""
    longest = 0
    for s in stop:
        for length in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:length]):
                longest = length
                break
    return longest


class IncrementalDecoder:
    """Decode a growing token list, handing out only the text that can no longer change.

    Each push decodes only the tokens since the last piece, after the last piece's tokens as
    context (a token's text can depend on the one before: SentencePiece's leading space, a
    character's bytes split over tokens), so a stream costs time linear in its length.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.emitted = ""
        self.held = ""  # final text not shown yet: it may be the beginning of a stop string
        self.stopped = False
        self.matched: Optional[str] = None  # the stop string that ended the text
        self.context_start = self.new_start = 0  # tokens[context_start:new_start]: the last piece's

    def push(self, tokens: list[int]) -> str:
        """The new final text after tokens (all tokens generated so far, not just the new ones)."""
        if self.stopped:
            return ""
        context = self.tokenizer.decode(tokens[self.context_start : self.new_start])
        text = self.tokenizer.decode(tokens[self.context_start :])
        if text.endswith(INCOMPLETE) or len(text) <= len(context):
            return ""  # half a character, or tokens with no text: wait for more
        # Our decoders only append: a window's text starts with its first tokens' text.
        assert text.startswith(context), (context, text)
        self.context_start, self.new_start = self.new_start, len(tokens)
        # A stop string not yet seen can only begin in the held-back text or the new text.
        pending = self.held + text[len(context) :]
        cut = find_stop(pending, self.stop)
        # Past a whole stop string nothing more is shown; before it, a partial one may complete.
        self.stopped = cut >= 0
        if self.stopped:
            self.matched = next(s for s in self.stop if pending.startswith(s, cut))
        safe = cut if self.stopped else len(pending) - stop_prefix_len(pending, self.stop)
        piece, self.held = pending[:safe], pending[safe:]
        self.emitted += piece
        return piece

    def finish(self, final_text: str) -> str:
        """The rest of final_text (the whole generation, cut at any stop string)."""
        assert final_text.startswith(self.emitted), (final_text, self.emitted)
        piece = final_text[len(self.emitted) :]
        self.emitted = final_text
        return piece


class TextStream:
    """Iterate over text pieces as they are generated; afterwards tokens and text hold the result.

    Every rank must iterate in lockstep (each step runs the model on all ranks); stopping early
    (break) is fine as long as all ranks stop at the same piece.
    """

    def __init__(self, run: "Callable[[TextStream], Iterator[str]]"):
        self.tokens: list[int] = []  # filled in when the generation ends
        self.text = ""
        self._pieces = run(self)

    def __iter__(self) -> Iterator[str]:
        return self._pieces
