"""Compiling constraints into xgrammar grammars for one model's tokenizer, once per constraint.

xgrammar (what vLLM, SGLang and TensorRT-LLM use) turns a grammar and a vocabulary into a token
mask per step in microseconds. The vocabulary description (TokenizerInfo) is built from our own
tokenizers, once per model and only when a first constrained request comes: it takes about half a
second for a vocabulary of 49152.

Compiling can take long (an enum of 20,000 strings: 5 s, of 40,000: 30 s, superlinear), so it
runs on the compiler's own threads, never on a loop that others wait for: the server asks for a
grammar within limits (GrammarLimits, a 400 beyond them), and its engine has every rank compile a
request's grammar before the request is admitted (engine/grammar_shelf.py). A compiled grammar is
checked before it is used: one whose first mask allows no token matches no text at all.
"""

import json
import queue
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Iterable, Optional

from ..optional import require

from ..text.hf_tokenizer import HFTokenizer
from ..text.tokenizer import Llama3Tokenizer, Tokenizer
from .constraint import Constraint, GrammarLimits

xgrammar = require("xgrammar", "structured outputs (response_format, tool_choice)")

# Most compiled grammars kept, and the most memory they may hold together (an enum of 20,000
# strings compiles into 26 MB); a schema sent again after it was evicted compiles again.
CACHE_SIZE = 256
CACHE_BYTES = 512 * 2**20
# Grammars compiled at once, each on one thread: a flood of slow grammars takes these cores, not more.
COMPILE_THREADS = 2
# Grammars refused for their compile time, remembered so that sending one again is refused at once.
REMEMBERED_OVERRUNS = 256


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
    (the HTTP side checks a constraint while the engine prepares another)."""

    def __init__(self, info: xgrammar.TokenizerInfo):
        self.info = info
        self.stop_tokens = frozenset(info.stop_token_ids)
        # xgrammar's own cache is off: this one keeps what it keeps, bounded in count and bytes
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._compiled: "OrderedDict[Constraint, xgrammar.CompiledGrammar]" = OrderedDict()  # least recent first
        self._compiling: dict[Constraint, Future] = {}
        self._overran: "OrderedDict[Constraint, float]" = OrderedDict()  # the limit each overran
        self._lock = threading.Lock()
        self._orders: "queue.SimpleQueue[tuple[Constraint, Future]]" = queue.SimpleQueue()
        # Daemon threads (not an executor's, which the interpreter waits for at exit): a compile
        # that runs on after its request was refused must not hold up the server's stopping.
        for index in range(COMPILE_THREADS):
            threading.Thread(target=self._compile_orders, name=f"llama_tp-grammar-{index}", daemon=True).start()

    def compile(self, constraint: Constraint, limits: Optional[GrammarLimits] = None) -> xgrammar.CompiledGrammar:
        """The constraint's checked grammar (compiled, or from the cache); raises ValueError
        saying what xgrammar refused, that it matches no text, or which limit it passed (a phrase
        with the constraint for its subject: "cannot be compiled into a grammar: ...")."""
        if limits is not None:
            size = len(constraint.source.encode())
            if size > limits.max_bytes:
                raise ValueError(f"is {size} bytes long, more than the server compiles ({limits.max_bytes}, "
                                 "--max_grammar_bytes); make it smaller")
            with self._lock:
                overran = self._overran.get(constraint)
            if overran is not None:
                raise _overran_error(overran)
        future = self.compile_later(constraint)
        try:
            return future.result(None if limits is None else limits.max_seconds)
        except FutureTimeout:  # xgrammar cannot stop midway: it compiles on, and is remembered as too slow
            with self._lock:
                self._overran[constraint] = limits.max_seconds
                if len(self._overran) > REMEMBERED_OVERRUNS:
                    self._overran.popitem(last=False)
            raise _overran_error(limits.max_seconds) from None

    def compile_later(self, constraint: Constraint) -> Future:
        """A future of compile(constraint) without limits: done at once where the cache holds it,
        else compiled on the compiler's threads (once, however many ask)."""
        with self._lock:
            compiled = self._compiled.get(constraint)
            if compiled is not None:
                self._compiled.move_to_end(constraint)
                future = Future()
                future.set_result(compiled)
                return future
            future = self._compiling.get(constraint)
            if future is None:
                future = self._compiling[constraint] = Future()
                self._orders.put((constraint, future))
            return future

    def matcher(self, constraint: Constraint) -> xgrammar.GrammarMatcher:
        """A fresh matcher for one answer."""
        return xgrammar.GrammarMatcher(self.compile(constraint))

    def _compile_orders(self) -> None:
        """A compiler thread: each order's checked grammar into its future and the cache."""
        while True:
            constraint, future = self._orders.get()
            try:
                compiled = self._compile_checked(constraint)
            except Exception as error:  # a refusal (ValueError), or a bug: the asker hears of it either way
                future.set_exception(error)
            else:
                future.set_result(compiled)
            finally:
                with self._lock:
                    self._compiling.pop(constraint, None)

    def _compile_checked(self, constraint: Constraint) -> xgrammar.CompiledGrammar:
        try:
            compiled = self._compile(constraint)
        except (RuntimeError, ValueError, TypeError) as error:  # parse errors: "[time] file:line: what"
            raise ValueError(f"cannot be compiled into a grammar: {str(error).split(': ', 1)[-1].strip()}") from None
        mask = xgrammar.allocate_token_bitmask(1, self.info.vocab_size)
        xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(mask)
        if not mask.any():
            raise ValueError("matches no text at all: its grammar allows no first token")
        with self._lock:
            self._compiled[constraint] = compiled
            while len(self._compiled) > CACHE_SIZE or (
                    len(self._compiled) > 1 and sum(g.memory_size_bytes for g in self._compiled.values()) > CACHE_BYTES):
                self._compiled.popitem(last=False)
        return compiled

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
        if kind == "tool_call":  # fixed text around a call's JSON schema, or else an answer's schema (tools.py)
            parts = json.loads(source)
            pieces = [xgrammar.Grammar.from_json_schema(json.dumps(parts["schema"]), any_whitespace=False)]
            if parts["before"]:
                pieces.insert(0, xgrammar.Grammar.from_ebnf(f"root ::= {json.dumps(parts['before'])}"))
            if parts["after"]:
                pieces.append(xgrammar.Grammar.from_ebnf(f"root ::= {json.dumps(parts['after'])}"))
            call = xgrammar.Grammar.concat(*pieces) if len(pieces) > 1 else pieces[0]
            if "answer" in parts:
                answer = xgrammar.Grammar.from_json_schema(json.dumps(parts["answer"]), any_whitespace=False)
                call = xgrammar.Grammar.union(call, answer)
            return self.compiler.compile_grammar(call)
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


def _overran_error(seconds: float) -> ValueError:
    return ValueError(f"took longer to compile than the server allows ({seconds:g} s, --grammar_timeout); "
                      "make it smaller or simpler")
