"""Tokenizers: Llama 2's SentencePiece model, behind the interface generation relies on."""

from pathlib import Path

from sentencepiece import SentencePieceProcessor


class Tokenizer:
    """Llama 2's SentencePiece tokenizer."""

    def __init__(self, model_path: str):
        path = Path(model_path)
        if not path.is_file():
            raise FileNotFoundError(
                f"tokenizer file {path} does not exist; pass --tokenizer_path with the "
                "tokenizer.model that came with the checkpoint"
            )
        self.sp_model = SentencePieceProcessor()
        try:
            loaded = self.sp_model.Load(str(path))  # raises on most bad files, returns False on others
        except RuntimeError:  # "could not parse ModelProto"
            loaded = False
        if not loaded:
            raise ValueError(
                f"{path} is not a SentencePiece tokenizer model; pass --tokenizer_path with the "
                "tokenizer.model that came with the checkpoint"
            )
        self.n_words: int = self.sp_model.vocab_size()
        self.bos_id: int = self.sp_model.bos_id()
        self.eos_id: int = self.sp_model.eos_id()
        self.pad_id: int = self.sp_model.pad_id()  # -1 in Llama 2: there is no padding token
        self.stop_tokens: set[int] = {self.eos_id}

    def encode(self, s: str, bos: bool, eos: bool) -> list[int]:
        _check_text(s)
        ids = self.sp_model.encode(s)
        return [self.bos_id] * bos + ids + [self.eos_id] * eos

    def decode(self, ids: list[int]) -> str:
        return self.sp_model.decode(ids)


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer for the file at path."""
    return Tokenizer(path)


def _check_text(s: str) -> None:
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
