"""Hugging Face tokenizer.json tokenizers (byte-level BPE such as SmolLM2's), through `tokenizers`."""

import json
from pathlib import Path
from typing import Optional

from ..optional import require
from .checks import check_text


def is_hf_tokenizer_file(path: str) -> bool:
    """Whether path is a tokenizer.json (a JSON object) rather than a binary tokenizer model."""
    try:
        with open(path, "rb") as file:
            return file.read(64).lstrip().startswith(b"{")
    except OSError:
        return str(path).endswith(".json")


class HFTokenizer:
    """A tokenizer.json, with bos/eos/pad read from the tokenizer_config.json beside it."""

    def __init__(self, path: str):
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"tokenizer file {path} does not exist; pass --tokenizer_path with the "
                "tokenizer.json that came with the checkpoint"
            )
        backend = require("tokenizers", f"the tokenizer {path}").Tokenizer
        try:
            self.backend = backend.from_file(str(path))
        except Exception as error:  # the Rust library raises a bare Exception for malformed files
            raise ValueError(f"{path} is not a Hugging Face tokenizer.json ({error})") from None
        # Text is text: "<|im_end|>" typed by a user is spelled out, never the control token.
        self.backend.encode_special_tokens = True
        # Control tokens by name, as Llama3Tokenizer.special_tokens: chat formats look theirs up here.
        self.special_tokens: dict[str, int] = {
            token.content: token_id for token_id, token in self.backend.get_added_tokens_decoder().items()
            if token.special
        }
        config = read_json_object(path.with_name("tokenizer_config.json"))
        self.n_words: int = self.backend.get_vocab_size(with_added_tokens=True)
        self.bos_id: int = self._config_id(config, "bos_token")
        self.eos_id: int = self._config_id(config, "eos_token")
        self.pad_id: int = self._config_id(config, "pad_token")  # -1: no padding token, as in Llama 2
        # The named tokens' text, which a chat template writes as bos_token, eos_token, ... (transformers' special_tokens_map)
        self.named_tokens: dict[str, str] = {key: text for key in ("bos_token", "eos_token", "unk_token", "pad_token")
                                             if (text := _token_text(config.get(key))) is not None}
        self.stop_tokens: set[int] = {self.eos_id} if self.eos_id >= 0 else set()
        # Models such as SmolLM2 are trained without a begin token: bos=True adds it only where
        # the tokenizer's own settings would.
        default = self.bos_id >= 0 and self.backend.encode("a").ids[:1] == [self.bos_id]
        self.adds_bos: bool = bool(config.get("add_bos_token", default)) and self.bos_id >= 0

    def encode(self, s: str, bos: bool, eos: bool) -> list[int]:
        check_text(s)
        ids = self.backend.encode(s, add_special_tokens=False).ids
        return [self.bos_id] * (bos and self.adds_bos) + ids + [self.eos_id] * (eos and self.eos_id >= 0)

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)

    def special_id(self, token: str) -> int:
        """The id of a control token such as <|im_start|>; ValueError if the vocabulary lacks it."""
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"the tokenizer has no {token} token; check that the chat format fits the model")
        return token_id

    def _config_id(self, config: dict, key: str) -> int:
        token = _token_text(config.get(key))
        return -1 if token is None else self.special_id(token)


def _token_text(token: "Optional[str | dict]") -> Optional[str]:
    """A tokenizer_config.json token's text: a string, or in older files {"content": "<s>", "lstrip": false, ...}."""
    return token.get("content") if isinstance(token, dict) else token


def read_json_object(path: Path) -> dict:
    """The JSON object in path, {} if there is no such file; ValueError naming the file if malformed."""
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}); fix or replace the file") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, found {type(config).__name__}")
    return config
