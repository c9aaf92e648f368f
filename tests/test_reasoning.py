"""Reasoning split from content (text/reasoning.py): streamed in any pieces it is the whole text's
split, which is the text without its thinking's tags; the parser a chat template calls for."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hf_families import tokenizer_files as plain_tokenizer_files
from llama_tp.text.hf_tokenizer import HFTokenizer
from llama_tp.text.reasoning import (ReasoningParser, ReasoningSplitter, Split, Thinking, parser_in_template,
                                     parser_for)
from thinking_model import TEMPLATE, tokenizer_files

START, END = "<think>", "</think>"
# DeepSeek-R1-Distill's template, its end: the assistant's turn opens with the thinking.
DEEPSEEK_R1 = ("{% if add_generation_prompt %}{{'<｜Assistant｜><think>\\n'}}{% endif %}"
               "{% set content = content.split('</think>')[-1] %}")
CHATML = "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'}}{% endfor %}"


def reference(text: str, opened: bool) -> tuple[str, str]:
    """The split, written plainly for a whole text: a start tag at the very beginning opens the
    thinking (or repeats an opened one); the first end tag closes it."""
    if text.startswith(START):
        opened, text = True, text[len(START):]
    if not opened:
        return "", text
    reasoning, _, content = text.partition(END)
    return reasoning, content


def streamed(pieces: list[str], opened: bool) -> list[Split]:
    splitter = ReasoningSplitter(START, END, opened)
    return [splitter.push(piece) for piece in pieces] + [splitter.finish()]


def joined(splits: list[Split]) -> tuple[str, str]:
    return "".join(s.reasoning for s in splits), "".join(s.content for s in splits)


FRAGMENTS = st.sampled_from([START, END, "<", "</", "<th", "think", ">", "k>", "a", " b", "\n", "é", "🦙"])


@given(st.lists(FRAGMENTS, max_size=12).map("".join), st.lists(st.integers(0, 60), max_size=8), st.booleans())
def test_streamed_in_any_pieces_is_the_whole_split(text, cuts, opened):
    bounds = sorted({0, len(text), *(cut for cut in cuts if cut < len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert joined(streamed(pieces, opened)) == reference(text, opened)
    whole = Thinking(0, 1, opened).split(text)
    assert (whole.reasoning, whole.content) == reference(text, opened)


@pytest.mark.parametrize("text, opened, reasoning, content", [
    ("<think>Let me think</think>\n\nParis", False, "Let me think", "\n\nParis"),  # Qwen3 thinking
    ("Paris", False, "", "Paris"),  # enable_thinking false: the prompt held the empty thinking
    ("<think>Let me", False, "Let me", ""),  # max_tokens inside the thinking: no content
    ("Let me</think>Paris", True, "Let me", "Paris"),  # DeepSeek-R1: the prompt opened it
    ("<think>\nLet me</think>Paris", True, "\nLet me", "Paris"),  # ... and the model repeated the tag
    ("Let me", True, "Let me", ""),
    ("Paris <think>x</think>", False, "", "Paris <think>x</think>"),  # a tag inside an answer is text
    ("<think>a</think>b</think>c", False, "a", "b</think>c"),  # the first end tag ends the thinking
    ("<thi", False, "", "<thi"),  # an unfinished tag is text
    ("<think>a</thi", False, "a</thi", ""),
])
def test_split(text, opened, reasoning, content):
    assert Thinking(0, 1, opened).split(text) == Split(reasoning, content)


def test_pieces_come_as_soon_as_they_are_sure():
    splitter = ReasoningSplitter(START, END, opened=False)
    assert splitter.push("<th") == Split() and not splitter.in_reasoning  # a start tag, maybe
    assert splitter.push("ink>Let") == Split(reasoning="Let") and splitter.in_reasoning
    assert splitter.push(" me</") == Split(reasoning=" me")  # "</" may begin the end tag
    assert splitter.push("x") == Split(reasoning="</x")
    assert splitter.push("</think>\n\nParis") == Split(content="\n\nParis") and not splitter.in_reasoning
    assert splitter.push(" <think>") == Split(content=" <think>")
    assert splitter.finish() == Split()


def test_reasoning_tokens_count_the_thinking_and_its_tags():
    assert Thinking(7, 8, opened=False).reasoning_tokens([7, 1, 2, 8, 3]) == 4
    assert Thinking(7, 8, opened=False).reasoning_tokens([1, 2, 8, 3]) == 0  # it did not open the thinking
    assert Thinking(7, 8, opened=True).reasoning_tokens([1, 2, 8, 3]) == 3
    assert Thinking(7, 8, opened=True).reasoning_tokens([1, 2]) == 2  # cut inside the thinking


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> HFTokenizer:
    folder = tmp_path_factory.mktemp("thinking-tokenizer")
    tokenizer_files(folder)
    return HFTokenizer(str(folder / "tokenizer.json"))


def test_the_parser_a_template_calls_for():
    assert parser_in_template(TEMPLATE) == "qwen3"
    assert parser_in_template(DEEPSEEK_R1) == "deepseek_r1"
    assert parser_in_template(CHATML) is None  # no thinking
    assert parser_in_template(None) is None


def test_parser_from_the_template_or_by_name(tokenizer):
    start, end = (tokenizer.backend.token_to_id(tag) for tag in (START, END))
    assert parser_for(None, tokenizer, TEMPLATE) == ReasoningParser("qwen3", start, end)
    assert parser_for(None, tokenizer, CHATML) is None
    assert parser_for("none", tokenizer, TEMPLATE) is None
    assert parser_for("deepseek_r1", tokenizer, CHATML) == ReasoningParser("deepseek_r1", start, end,
                                                                                 always_opened=True)


def test_the_prompt_decides_whether_the_answer_begins_thinking(tokenizer):
    parser = parser_for("qwen3", tokenizer)
    start, end = parser.start_token, parser.end_token
    assert not parser.thinking([5, 6]).opened  # Qwen3: the model writes the start tag itself
    assert parser.thinking([5, start, 6]).opened  # QwQ: the prompt ends with "<think>\n"
    assert not parser.thinking([5, start, 6, end, 6]).opened  # enable_thinking false: an empty thinking
    assert parser_for("deepseek_r1", tokenizer).thinking([5, 6]).opened


def test_unknown_parsers_and_tokenizers_without_the_tags_are_refused(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="reasoning_parser 'qwen' is not one of qwen3, deepseek_r1 or none"):
        parser_for("qwen", tokenizer)
    plain_tokenizer_files(tmp_path, CHATML)  # the converter tests' tokenizer.json: no think tags
    plain = HFTokenizer(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="reasoning_parser qwen3 needs <think> and </think> as tokens"):
        parser_for("qwen3", plain)
