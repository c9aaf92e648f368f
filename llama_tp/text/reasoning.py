"""A reasoning model's thinking told apart from its answer, as vLLM's --reasoning-parser and
llama.cpp's --reasoning-format do: Qwen3's and DeepSeek-R1's `<think>...</think>`.

    parser = parser_for("qwen3", tokenizer)                # or chosen from the chat template
    thinking = parser.thinking(prompt_tokens)              # this answer's: does it begin inside?
    splitter = thinking.splitter()
    for piece in generated_pieces:
        split = splitter.push(piece)                       # split.reasoning, split.content
    rest = splitter.finish()

The reasoning and the content of an answer, joined, are the generated text without the tags that
mark the thinking: the start tag at the answer's very beginning and the first end tag.
"""

from dataclasses import dataclass
from typing import Optional, Sequence

PARSERS = ("qwen3", "deepseek_r1")
THINK_START, THINK_END = "<think>", "</think>"
DEEPSEEK_ASSISTANT = "<｜Assistant｜>"  # the full-width bars of DeepSeek's chat templates
CHATML_START = "<|im_start|>"


@dataclass(frozen=True)
class Split:
    """A piece of an answer's text, as its reasoning's part and its content's."""

    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    """Given an answer's text piece by piece, its reasoning and content pieces as soon as they are
    sure: a piece that may be the beginning of a tag is held until the next one shows which.

    opened: the answer begins inside the thinking (the prompt opened it); else it thinks only if
    it begins with the start tag.
    """

    def __init__(self, start: str = THINK_START, end: str = THINK_END, opened: bool = False):
        self.start, self.end = start, end
        self.reasoning = True  # inside the thinking (at the beginning: maybe)
        self.at_beginning = True  # nothing read yet but what may be a start tag
        self.opened = opened
        self.held = ""

    @property
    def in_reasoning(self) -> bool:
        """Whether the text that comes next belongs to the reasoning, as far as is known now."""
        return self.reasoning and (self.opened or not self.at_beginning)

    def push(self, piece: str) -> Split:
        """The parts of piece (and of what was held) that are now sure."""
        self.held += piece
        if self.at_beginning:
            if self.start.startswith(self.held) and self.held != self.start:
                return Split()  # a start tag, maybe: wait
            self.at_beginning = False
            if self.held.startswith(self.start):  # an opened answer that repeats the tag drops it too
                self.held = self.held[len(self.start):]
            elif not self.opened:
                self.reasoning = False
        if not self.reasoning:
            content, self.held = self.held, ""
            return Split(content=content)
        cut = self.held.find(self.end)
        if cut >= 0:
            reasoning, content = self.held[:cut], self.held[cut + len(self.end):]
            self.reasoning, self.held = False, ""
            return Split(reasoning, content)
        sure = len(self.held) - _tag_prefix_length(self.held, self.end)
        reasoning, self.held = self.held[:sure], self.held[sure:]
        return Split(reasoning=reasoning)

    def finish(self) -> Split:
        """What was held at the answer's end: an unfinished tag is text."""
        held, self.held = self.held, ""
        if self.at_beginning and not self.opened:
            self.reasoning = False
        self.at_beginning = False
        return Split(held, "") if self.reasoning else Split(content=held)


def _tag_prefix_length(text: str, tag: str) -> int:
    """Length of the longest end of text that begins tag (which may complete with more text)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


@dataclass(frozen=True)
class Thinking:
    """How one answer's thinking is marked, small and hashable: it travels with the request to
    every rank, where a structured output's grammar waits for the end of the thinking."""

    start_token: int
    end_token: int
    opened: bool  # the prompt opened the thinking: the answer begins inside it
    start: str = THINK_START
    end: str = THINK_END

    def splitter(self) -> ReasoningSplitter:
        return ReasoningSplitter(self.start, self.end, self.opened)

    def split(self, text: str) -> Split:
        """A whole answer's reasoning and content."""
        splitter = self.splitter()
        first, rest = splitter.push(text), splitter.finish()
        return Split(first.reasoning + rest.reasoning, first.content + rest.content)

    def reasoning_tokens(self, tokens: Sequence[int]) -> int:
        """How many of an answer's tokens are its thinking, its tags included."""
        if not tokens or not (self.opened or tokens[0] == self.start_token):
            return 0
        return tokens.index(self.end_token) + 1 if self.end_token in tokens else len(tokens)


@dataclass(frozen=True)
class ReasoningParser:
    """A model's way of marking its thinking."""

    name: str
    start_token: int
    end_token: int
    # DeepSeek-R1's answer is thinking up to the end tag, whether or not its template wrote the start tag.
    always_opened: bool = False

    def thinking(self, prompt_tokens: Sequence[int]) -> Thinking:
        """The thinking of the answer to prompt_tokens: opened where the prompt's last start tag
        has no end tag after it (DeepSeek-R1's and QwQ's templates end the prompt with
        `<think>\\n`; Qwen3's, with enable_thinking false, with an empty thinking)."""
        opened = self.always_opened or _last_index(prompt_tokens, self.start_token) > _last_index(
            prompt_tokens, self.end_token)
        return Thinking(self.start_token, self.end_token, opened)


def _last_index(tokens: Sequence[int], token: int) -> int:
    return max((index for index, value in enumerate(tokens) if value == token), default=-1)


def parser_in_template(chat_template: Optional[str]) -> Optional[str]:
    """The reasoning parser a chat template clearly calls for: one that writes both tags, in
    DeepSeek's format (deepseek_r1) or ChatML (qwen3: Qwen3, QwQ); else None."""
    if not chat_template or THINK_START not in chat_template or THINK_END not in chat_template:
        return None
    if DEEPSEEK_ASSISTANT in chat_template:
        return "deepseek_r1"
    return "qwen3" if CHATML_START in chat_template else None


def check_parser_name(name: Optional[str]) -> None:
    """ValueError unless name is a parser's, "none" or None (the chat template's choice)."""
    if name not in (None, "none", *PARSERS):
        raise ValueError(f"reasoning_parser {name!r} is not one of {', '.join(PARSERS)} or none")


def parser_for(name: Optional[str], tokenizer, chat_template: Optional[str] = None) -> Optional[ReasoningParser]:
    """The parser named (qwen3, deepseek_r1; "none": off), or with name None the one the chat
    template clearly calls for (else none). ValueError for a name we do not know, or tags the
    tokenizer does not hold as tokens of their own."""
    check_parser_name(name)
    if name is None:
        name = parser_in_template(chat_template)
    if name in (None, "none"):
        return None
    tokens = [_tag_token(tokenizer, tag) for tag in (THINK_START, THINK_END)]
    if None in tokens:
        raise ValueError(f"reasoning_parser {name} needs {THINK_START} and {THINK_END} as tokens of the "
                         "tokenizer's own (as Qwen3's and DeepSeek-R1's have), which this tokenizer lacks; "
                         "pass reasoning_parser none for a model that does not think")
    return ReasoningParser(name, tokens[0], tokens[1], always_opened=name == "deepseek_r1")


def _tag_token(tokenizer, tag: str) -> Optional[int]:
    """The token of tag, if the tokenizer holds it as one token whose text its decoding keeps."""
    backend = getattr(tokenizer, "backend", None)  # a tokenizer.json's (HFTokenizer)
    token_id = backend.token_to_id(tag) if backend is not None else None
    if token_id is None or tag in getattr(tokenizer, "special_tokens", {}):
        return None  # a special token's text is left out of decoded answers
    return token_id
