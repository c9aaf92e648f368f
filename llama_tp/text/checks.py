"""Checks on text from the outside world before a tokenizer sees it."""


def check_text(s: str) -> None:
    """Refuse what SentencePiece would fail on with an opaque error: non-strings, lone surrogates."""
    if not isinstance(s, str):
        raise ValueError(f"text to encode must be a string, found {type(s).__name__} {s!r:.80}")
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"text holds {s[error.start:error.end]!r} at character {error.start}, which is not "
            "valid Unicode (a lone surrogate, e.g. from a JSON \\ud800 escape); fix the prompt"
        ) from None
