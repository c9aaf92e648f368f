"""Tokenizers: Llama 2's SentencePiece model and Llama 3's and 4's tiktoken BPE, behind the interface generation relies on."""

import base64
import binascii
import re
from pathlib import Path
from typing import AbstractSet, Iterator, Literal, Optional, Union

import tiktoken
from sentencepiece import SentencePieceProcessor

from .hf_tokenizer import HFTokenizer, is_hf_tokenizer_file
from .checks import check_text


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
            self.sp_model.Load(str(path))
        except (RuntimeError, OSError) as error:
            raise ValueError(
                f"{path} is not a SentencePiece tokenizer model ({error}); pass the "
                "tokenizer.model that came with the checkpoint"
            ) from None
        self.n_words: int = self.sp_model.vocab_size()
        self.bos_id: int = self.sp_model.bos_id()
        self.eos_id: int = self.sp_model.eos_id()
        self.pad_id: int = self.sp_model.pad_id()  # -1 in Llama 2: there is no padding token
        self.stop_tokens: set[int] = {self.eos_id}

    def encode(self, s: str, bos: bool, eos: bool) -> list[int]:
        check_text(s)
        ids = self.sp_model.encode(s)
        return [self.bos_id] * bos + ids + [self.eos_id] * eos

    def decode(self, ids: list[int]) -> str:
        return self.sp_model.decode(ids)


class Llama3Tokenizer:
    """Llama 3's tokenizer: tiktoken byte-pair ranks from the file, then 256 special tokens."""

    # Meta's split pattern (GPT-4's cl100k): contractions, letters, 1-3 digits, punctuation, spaces.
    pat_str = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    num_special_tokens = 256
    # The named special tokens in id order from 128000, as in Meta's llama-models (Llama 3.1 and
    # later; Llama 3.0 called 128004-128005, 128008 and 128010-128011 reserved, with the same ids
    # for begin/end of text, the header markers and eot).
    named_special_tokens = (
        "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
        "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
        "<|image|>",
    )
    first_reserved = 2  # the number the reserved tokens after the named ones start from
    # The special tokens that end a turn, end a message awaiting a tool's answer, and pad.
    eot, eom, pad = "<|eot_id|>", "<|eom_id|>", "<|finetune_right_pad_id|>"
    # tiktoken panics on inputs longer than this ...
    max_encode_chars = 400_000
    # ... and is quadratic on long runs of whitespace or of non-whitespace (tiktoken issue 195).
    max_run_chars = 25_000

    def __init__(self, model_path: str, ranks: Optional[dict[bytes, int]] = None):
        """ranks: the file's, where the caller has read them already (load_tokenizer)."""
        path = Path(model_path)
        ranks = ranks if ranks is not None else read_bpe_ranks(path)
        reserved = [
            f"<|reserved_special_token_{self.first_reserved + i}|>"
            for i in range(self.num_special_tokens - len(self.named_special_tokens))
        ]
        names = list(self.named_special_tokens) + reserved
        self.special_tokens: dict[str, int] = {name: len(ranks) + i for i, name in enumerate(names)}
        self.model = tiktoken.Encoding(
            name=path.name, pat_str=self.pat_str, mergeable_ranks=ranks, special_tokens=self.special_tokens
        )
        self.n_words: int = len(ranks) + len(names)
        self.bos_id: int = self.special_tokens["<|begin_of_text|>"]
        self.eos_id: int = self.special_tokens["<|end_of_text|>"]
        self.eot_id: int = self.special_tokens[self.eot]  # end of a turn
        self.eom_id: int = self.special_tokens[self.eom]  # end of a message that awaits a tool's answer
        self.pad_id: int = self.special_tokens[self.pad]
        self.stop_tokens: set[int] = {self.eos_id, self.eot_id, self.eom_id}

    def encode(self, s: str, bos: bool, eos: bool,
               allowed_special: Union[Literal["all"], AbstractSet[str]] = frozenset()) -> list[int]:
        """Token ids of s; special-token text in s is plain text unless allowed_special names it."""
        check_text(s)
        ids: list[int] = []
        for start in range(0, len(s), self.max_encode_chars):
            for part in split_long_runs(s[start : start + self.max_encode_chars], self.max_run_chars):
                ids += self.model.encode(part, allowed_special=allowed_special, disallowed_special=())
        return [self.bos_id] * bos + ids + [self.eos_id] * eos

    def decode(self, ids: list[int]) -> str:
        """The text of ids; bytes that do not form whole characters become U+FFFD."""
        return self.model.decode(list(ids))


def _reserved(name: str, count: int, first: int = 0) -> tuple[str, ...]:
    return tuple(f"<|{name}_reserved_special_token_{i}|>" for i in range(first, first + count))


class Llama4Tokenizer(Llama3Tokenizer):
    """Llama 4's tokenizer: 200,000 tiktoken ranks split by o200k's pattern, then 2048 special
    tokens (header markers, <|eot|>, the vision and reasoning ones), as Meta's llama-models names them."""

    bpe_ranks = 200_000  # how load_tokenizer tells its file from Llama 3's (128,000)
    # o200k's split pattern: words split before capitals, contractions kept with their word.
    pat_str = "|".join((
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+",
    ))
    num_special_tokens = 2048
    named_special_tokens = (
        "<|begin_of_text|>", "<|end_of_text|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
        # from 200005: the text model's
        "<|header_start|>", "<|header_end|>", "<|eom|>", "<|eot|>", "<|step|>", *_reserved("text_post_train", 6),
        "<|python_start|>", "<|python_end|>", "<|finetune_right_pad|>", *_reserved("text_post_train", 61, 8),
        # from 200080: the vision model's
        "<|image_start|>", "<|image_end|>", *_reserved("vision", 2), "<|tile_x_separator|>",
        "<|tile_y_separator|>", *_reserved("vision", 4, 2), "<|image|>", *_reserved("vision", 1, 6), "<|patch|>",
        *_reserved("vision", 1041, 7),
        # from 201134: reasoning's
        *_reserved("reasoning", 8), "<|reasoning_thinking_start|>", "<|reasoning_thinking_end|>",
    )
    first_reserved = 0
    eot, eom, pad = "<|eot|>", "<|eom|>", "<|finetune_right_pad|>"


def split_long_runs(s: str, max_run: int) -> Iterator[str]:
    """Cut s into consecutive parts none of which holds more than max_run whitespace or non-whitespace
    characters in a row; cutting inside such a run changes no token boundary that matters."""
    run, run_is_space, part_start = 0, s[:1].isspace(), 0
    for i, char in enumerate(s):
        if char.isspace() != run_is_space:
            run, run_is_space = 1, not run_is_space
            continue
        run += 1
        if run > max_run:
            yield s[part_start:i]
            part_start, run = i, 1
    yield s[part_start:]


# A tiktoken BPE file is text, one "<base64 token> <rank>" per line; SentencePiece's is a protobuf.
_BPE_LINE = re.compile(rb"[A-Za-z0-9+/]+=* \d+\r?\n")


def read_bpe_ranks(path: Path) -> dict[bytes, int]:
    """The byte-pair ranks of a tiktoken BPE file.

    Read here rather than with tiktoken.load, which keeps a cached copy under /tmp keyed by the
    path, so an edited file at the same path would be read stale.
    """
    if not path.is_file():
        raise FileNotFoundError(
            f"tokenizer file {path} does not exist; pass --tokenizer_path with the "
            "tokenizer.model that came with the checkpoint"
        )
    ranks = {}
    for number, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise ValueError(
                f"{path} line {number} is {line[:60]!r}; a Llama 3 tokenizer.model has one "
                "'<base64 token> <rank>' per line: the file may be truncated or corrupt"
            ) from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: the ranks are not 0 to {len(ranks) - 1} each once; the file is corrupt")
    return ranks


def is_tiktoken_bpe(path: Path) -> bool:
    """Whether the file at path is a tiktoken BPE file (Llama 3) rather than SentencePiece (Llama 2)."""
    with open(path, "rb") as file:
        return _BPE_LINE.match(file.readline(1024)) is not None


def load_tokenizer(path: str) -> Union[Tokenizer, Llama3Tokenizer, HFTokenizer]:
    """The tokenizer for the file at path, told apart by the file's content, never its name: a
    tiktoken file of o200k's 200,000 ranks is Llama 4's, any other Llama 3's (128,000)."""
    if Path(path).is_file() and is_tiktoken_bpe(Path(path)):
        ranks = read_bpe_ranks(Path(path))
        return (Llama4Tokenizer if len(ranks) == Llama4Tokenizer.bpe_ranks else Llama3Tokenizer)(path, ranks)
    if is_hf_tokenizer_file(path):  # a Hugging Face tokenizer.json, e.g. from llama_tp.convert
        return HFTokenizer(path)
    return Tokenizer(path)
