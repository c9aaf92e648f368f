"""Words an answer must never hold (vLLM's bad_words, transformers' bad_words_ids): each word as
the token sequences it takes, and which tokens a row may not take next.

A word is several tokens more often than one, and its tokens differ with a leading space (Llama
3's " darn" is one token, "darn" two) and at the start of a line or after punctuation. So each
word is banned as it is tokenized glued to what comes before and after a space, as vLLM does
(its tokens after a newline, whose own tokens come first and are dropped: a tokenizer that adds
a space at the start of a text, as SentencePiece does, adds it to the newline). A sequence's last
token is banned where the tokens before it end with the rest of it: a word of one token always,
"d" "arn" only right after "d", so that other words that start with "d" stay possible.
"""

from typing import Sequence

# What a word's tokens are read after: a character that no tokenizer merges with a letter or a space.
ANCHOR = "\n"


def word_sequences(tokenizer, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Every token sequence that spells one of words, glued to what comes before or after a
    space, without repeats; ValueError for an empty word."""
    if not words:  # nothing to ask the tokenizer (the benchmarks' stand-in has no encode)
        return ()
    anchor = tokenizer.encode(ANCHOR, bos=False, eos=False)
    sequences: list[tuple[int, ...]] = []
    for index, word in enumerate(words):
        if not isinstance(word, str) or not word.strip():
            raise ValueError(f"bad_words[{index}] must be a word or phrase, found {word!r}")
        for text in (word.strip(), " " + word.strip()):
            tokens = tokenizer.encode(ANCHOR + text, bos=False, eos=False)
            if tokens[: len(anchor)] == anchor:  # else the anchor merged with the word: taken as it is
                tokens = tokens[len(anchor):]
            if tokens and tuple(tokens) not in sequences:
                sequences.append(tuple(tokens))
    return tuple(sequences)


def banned_next(tokens: Sequence[int], sequences: Sequence[tuple[int, ...]]) -> list[int]:
    """The tokens a row whose tokens so far are `tokens` may not take next: each sequence's last
    token, where tokens end with the rest of the sequence (a one-token sequence's, always)."""
    banned = []
    for sequence in sequences:
        before = len(sequence) - 1
        if before <= len(tokens) and (before == 0 or tuple(tokens[-before:]) == sequence[:-1]):
            banned.append(sequence[-1])
    return banned
