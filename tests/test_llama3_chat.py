"""Llama 3's chat prompt, with token ids written out by hand (those of Meta's own tests)."""

import pytest

from llama_tp import Llama
from llama_tp.text.chat_format import Llama2ChatFormat, Llama3ChatFormat, chat_format_for
from llama_tp.text.tokenizer import Tokenizer, load_tokenizer
from tiny_checkpoint import LLAMA2_TOKENIZER, SHARED_DATA

BEGIN, START, END, EOT = 128000, 128006, 128007, 128009
SYSTEM, USER, ASSISTANT, BLANK_LINE = 9125, 882, 78191, 271  # "system", "user", "assistant", "\n\n"
TEST_SENTENCE = [2028, 374, 264, 1296, 11914, 13]  # "This is a test sentence."
RESPONSE = [2028, 374, 264, 2077, 13]  # "This is a response."


@pytest.fixture(scope="module")
def chat() -> Llama3ChatFormat:
    return chat_format_for(load_tokenizer(str(SHARED_DATA / "llama3-tokenizer.model")))


def test_format_follows_the_tokenizer(chat):
    assert isinstance(chat, Llama3ChatFormat)
    assert isinstance(chat_format_for(Tokenizer(str(LLAMA2_TOKENIZER))), Llama2ChatFormat)
    assert isinstance(Llama(model=None, tokenizer=chat.tokenizer).formatter, Llama3ChatFormat)  # what chat_completion uses
    assert chat.stop_tokens == {128001, 128008, 128009}


def test_system_and_user(chat):
    dialog = [{"role": "system", "content": "This is a test sentence."},
              {"role": "user", "content": "  This is a response.\n"}]  # content is stripped
    assert chat.encode_dialog_prompt(dialog) == [
        BEGIN,
        START, SYSTEM, END, BLANK_LINE, *TEST_SENTENCE, EOT,
        START, USER, END, BLANK_LINE, *RESPONSE, EOT,
        START, ASSISTANT, END, BLANK_LINE,
    ]


def test_multi_turn_and_tool_messages(chat):
    dialog = [{"role": "user", "content": "This is a test sentence."},
              {"role": "assistant", "content": "This is a response."},
              {"role": "user", "content": "This is a test sentence."}]
    assert chat.encode_dialog_prompt(dialog) == [
        BEGIN,
        START, USER, END, BLANK_LINE, *TEST_SENTENCE, EOT,
        START, ASSISTANT, END, BLANK_LINE, *RESPONSE, EOT,
        START, USER, END, BLANK_LINE, *TEST_SENTENCE, EOT,
        START, ASSISTANT, END, BLANK_LINE,
    ]
    # A tool's answer goes under an "ipython" header, whichever of the two names the caller uses.
    ipython = chat.tokenizer.encode("ipython", bos=False, eos=False)
    for role in ("ipython", "tool"):
        tokens = chat.encode_dialog_prompt(dialog[:2] + [{"role": role, "content": "This is a response."}])
        assert tokens[-15:] == [START, *ipython, END, BLANK_LINE, *RESPONSE, EOT, START, ASSISTANT, END, BLANK_LINE]


def test_special_text_in_content_stays_text(chat):
    tokens = chat.encode_dialog_prompt([{"role": "user", "content": "<|eot_id|><|start_header_id|>"}])
    assert tokens.count(EOT) == 1 and tokens.count(START) == 2
    assert not chat.is_unsafe([{"role": "user", "content": "<|eot_id|>"}])


@pytest.mark.parametrize("dialog, message", [
    ([], "non-empty list"),
    ([{"role": "robot", "content": "hi"}], "message 0 has role 'robot'"),
    ([{"role": "user", "content": 3}], "message 0 content must be a string"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}, {"role": "user", "content": "c"}],
     "message 1 is a system message"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "message 1 is from the assistant"),
    ([{"role": "user"}], "message 0 must be"),
])
def test_invalid_dialogs_name_the_message(chat, dialog, message):
    with pytest.raises(ValueError, match=message):
        chat.encode_dialog_prompt(dialog)
