"""Compiling constraints into xgrammar grammars for one model's tokenizer, once per constraint.

xgrammar (what vLLM, SGLang and TensorRT-LLM use) turns a grammar and a vocabulary into a token
mask per step in microseconds. The vocabulary description (TokenizerInfo) is built from our own
tokenizers, once per model and only when a first constrained request comes: it takes about half a
second for a vocabulary of 49152.
"""

import json
import threading
import weakref
from typing import Iterable

from ..optional import require

from ..text.hf_tokenizer import HFTokenizer
from ..text.tokenizer import Llama3Tokenizer, Tokenizer
from .constraint import Constraint

xgrammar = require("xgrammar", "structured outputs (response_format, tool_choice)")

# Most compiled grammars kept; a schema sent again after it was evicted compiles again.
CACHE_SIZE = 256


def tokenizer_info(tokenizer, vocab_size: int, stop_tokens: Iterable[int]) -> xgrammar.TokenizerInfo:
    """What xgrammar needs of our tokenizer: each token's text (special tokens as "", which
    xgrammar never lets a grammar produce), how that text encodes bytes, and the stop tokens a
    finished grammar allows."""
    encoded: list = [""] * vocab_size
    add_prefix_space = False
    if isinstance(tokenizer, HFTokenizer):
        special = set(tokenizer.special_tokens.values())
        for text, token in tokenizer.backend.get_vocab(with_added_tokens=True).items():
            if token < vocab_size and token not in special:
                encoded[token] = text
        metadata = xgrammar.TokenizerInfo._detect_metadata_from_hf(tokenizer.backend.to_str())
        vocab_type, add_prefix_space = metadata["vocab_type"], metadata["add_prefix_space"]
    elif isinstance(tokenizer, Llama3Tokenizer):
        special = set(tokenizer.special_tokens.values())
        for token in range(min(vocab_size, tokenizer.n_words)):
            if token not in special:
                encoded[token] = tokenizer.model.decode_single_token_bytes(token)
        vocab_type = xgrammar.VocabType.RAW
    elif isinstance(tokenizer, Tokenizer):
        sp = tokenizer.sp_model
        for token in range(min(vocab_size, tokenizer.n_words)):
            if not (sp.is_control(token) or sp.is_unknown(token)):
                encoded[token] = sp.id_to_piece(token)
        vocab_type, add_prefix_space = xgrammar.VocabType.BYTE_FALLBACK, True
    else:
        raise TypeError(f"no grammar support for a {type(tokenizer).__name__} tokenizer")
    return xgrammar.TokenizerInfo(encoded, vocab_type, vocab_size=vocab_size, stop_token_ids=sorted(stop_tokens),
                                  add_prefix_space=add_prefix_space)


class Grammars:
    """Compiled grammars for one model, cached by constraint; safe to use from several threads
    (the HTTP side checks a constraint while the engine compiles another)."""

    def __init__(self, info: xgrammar.TokenizerInfo):
        self.info = info
        self.stop_tokens = frozenset(info.stop_token_ids)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        self._compiled: dict[Constraint, xgrammar.CompiledGrammar] = {}
        self._lock = threading.Lock()

    def compile(self, constraint: Constraint) -> xgrammar.CompiledGrammar:
        """The constraint's grammar; raises ValueError saying what xgrammar refused."""
        with self._lock:
            compiled = self._compiled.get(constraint)
        if compiled is None:
            try:
                compiled = self._compile(constraint)
            except RuntimeError as error:  # xgrammar's parse errors: "[time] file:line: what"
                raise ValueError(str(error).split(": ", 1)[-1].strip()) from None
            with self._lock:
                if len(self._compiled) >= CACHE_SIZE:
                    self._compiled.pop(next(iter(self._compiled)))
                self._compiled[constraint] = compiled
        return compiled

    def matcher(self, constraint: Constraint) -> xgrammar.GrammarMatcher:
        """A fresh matcher for one answer."""
        return xgrammar.GrammarMatcher(self.compile(constraint))

    def _compile(self, constraint: Constraint) -> xgrammar.CompiledGrammar:
        kind, source = constraint.kind, constraint.source
        if kind in ("json_object", "json_schema"):
            # No free whitespace between tokens: a small model could otherwise loop on newlines.
            # OpenAI's JSON mode answers an object, where xgrammar's built-in JSON allows any value.
            return self.compiler.compile_json_schema(source or '{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return self.compiler.compile_regex(source)
        if kind == "choice":
            return self.compiler.compile_regex("|".join(_regex_literal(choice) for choice in json.loads(source)))
        if kind == "grammar":
            return self.compiler.compile_grammar(source)
        if kind == "tool_call":  # a forced tool call: fixed text around a JSON schema (tools.py)
            parts = json.loads(source)
            pieces = [xgrammar.Grammar.from_json_schema(json.dumps(parts["schema"]), any_whitespace=False)]
            if parts["before"]:
                pieces.insert(0, xgrammar.Grammar.from_ebnf(f"root ::= {json.dumps(parts['before'])}"))
            if parts["after"]:
                pieces.append(xgrammar.Grammar.from_ebnf(f"root ::= {json.dumps(parts['after'])}"))
            return self.compiler.compile_grammar(xgrammar.Grammar.concat(*pieces) if len(pieces) > 1 else pieces[0])
        raise ValueError(f"unknown constraint kind {kind!r}")


def _regex_literal(text: str) -> str:
    """text as a regular expression matching exactly it (xgrammar's regex syntax is ECMAScript's)."""
    return "".join("\\" + char if char in r"\^$.|?*+()[]{}/" else char for char in text)


_BY_GENERATOR: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_BY_GENERATOR_LOCK = threading.Lock()


def grammars_for(generator) -> Grammars:
    """The Grammars of a Llama, made on first use: its stop tokens are the tokenizer's and the
    chat format's end of turn, so that a finished grammar ends a completion and a chat turn alike."""
    with _BY_GENERATOR_LOCK:
        grammars = _BY_GENERATOR.get(generator)
        if grammars is None:
            stop_tokens = set(generator.tokenizer.stop_tokens) | set(generator.formatter.stop_tokens)
            info = tokenizer_info(generator.tokenizer, generator.model.args.vocab_size, stop_tokens)
            grammars = _BY_GENERATOR[generator] = Grammars(info)
        return grammars
