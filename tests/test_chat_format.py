"""text/chat_format.py's Mistral and ChatML layouts and its refusals, on a stand-in tokenizer whose
tokens are characters, and a model's own template on it: every expected prompt is written out here, in milliseconds (the real
tokenizers' tests are test_llama2_chat_format.py, test_llama3_chat.py, test_convert_chat.py and
test_convert_families.py's template comparison)."""

import pytest

from llama_tp.text.chat_format import (ChatMLFormat, Llama2ChatFormat, Llama3ChatFormat, MistralChatFormat,
                                       TemplateChatFormat, chat_format_for)

BOS, EOS = 1, 2


class Characters:
    """A tokenizer whose ids are the characters' code points; special tokens are ids below 10."""

    def __init__(self, special_tokens=None):
        self.stop_tokens = {EOS}
        if special_tokens is not None:
            self.special_tokens = special_tokens

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        return [BOS] * bos + [ord(c) for c in text] + [EOS] * eos


class ChatMLCharacters(Characters):
    def special_id(self, token: str) -> int:
        return {"<|im_start|>": 3, "<|im_end|>": 4}[token]


def text(s: str) -> list[int]:
    return [ord(c) for c in s]


DIALOG = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "so?"}]
SYSTEM = [{"role": "system", "content": "Be"}, {"role": "user", "content": "hi"}]


def test_mistral_with_inst_as_text():
    chat = MistralChatFormat(Characters())
    assert not chat.controls and chat.stop_tokens == {EOS}
    assert chat.encode_dialog_prompt(DIALOG) == [BOS, *text("[INST] hi [/INST]"), *text("yo"), EOS,
                                                 *text("[INST] so? [/INST]")]
    # The system message goes before the last user message, not the first.
    assert chat.encode_dialog_prompt([{"role": "system", "content": "Be"}, *DIALOG]) == [
        BOS, *text("[INST] hi [/INST]"), *text("yo"), EOS, *text("[INST] Be\n\nso? [/INST]")]


def test_mistral_with_inst_as_control_tokens():
    chat = MistralChatFormat(Characters({"[INST]": 5, "[/INST]": 6}))
    assert chat.controls
    assert chat.encode_dialog_prompt(SYSTEM) == [BOS, 5, *text(" Be\n\nhi "), 6]
    assert not MistralChatFormat(Characters({"[INST]": 5})).controls  # both or neither


def test_chatml_layout():
    chat = ChatMLFormat(ChatMLCharacters(), default_system_prompt="Hm")
    assert chat.stop_tokens == {EOS, 4}
    turn = lambda role, content: [3, *text(f"{role}\n{content}"), 4, *text("\n")]  # noqa: E731
    assert chat.encode_dialog_prompt(SYSTEM) == turn("system", "Be") + turn("user", "hi") + [3, *text("assistant\n")]
    assert chat.encode_dialog_prompt(SYSTEM[1:]) == turn("system", "Hm") + turn("user", "hi") + [3, *text("assistant\n")]
    with pytest.raises(ValueError, match=r"^ChatML needs a tokenizer with <\|im_start\|> and <\|im_end\|> tokens; "
                       "Characters has none: check the chat format in the model's llama_tp.json$"):
        ChatMLFormat(Characters())


def test_only_llama2_refuses_its_control_tags():
    dialog = [{"role": "user", "content": "a [INST] b"}]
    assert Llama2ChatFormat.is_unsafe(dialog)
    assert not Llama2ChatFormat.is_unsafe([{"role": "user", "content": "[INS T] <<SYS >>"}])
    for format_ in (Llama3ChatFormat, ChatMLFormat, MistralChatFormat):
        assert not format_.is_unsafe(dialog)


def test_the_recorded_format_wins_over_the_tokenizers():
    chars = ChatMLCharacters()
    assert isinstance(chat_format_for(chars, "chatml"), ChatMLFormat)
    assert chat_format_for(chars, "chatml", "Hm").default_system_prompt == "Hm"
    assert isinstance(chat_format_for(chars, "mistral"), MistralChatFormat)
    assert chat_format_for(chars, "mistral").tokenizer is chars
    assert isinstance(chat_format_for(chars, "llama3"), Llama3ChatFormat)
    assert isinstance(chat_format_for(chars, "llama2"), Llama2ChatFormat)
    assert isinstance(chat_format_for(chars), Llama2ChatFormat)  # a tokenizer that is not Llama 3's


@pytest.mark.parametrize("format_", [MistralChatFormat, ChatMLFormat, Llama2ChatFormat])
@pytest.mark.parametrize("dialog, message", [
    ([], "a dialog must be a non-empty list of messages, found []"),
    ({"role": "user"}, "a dialog must be a non-empty list of messages, found {'role': 'user'}"),
    ([{"role": "user", "content": "a", "x": 1}],
     "message 0 must be {'role': ..., 'content': ...} (an assistant's may add 'reasoning_content'), found "
     "{'role': 'user', 'content': 'a', 'x': 1}"),
    (["hi"], "message 0 must be {'role': ..., 'content': ...} (an assistant's may add 'reasoning_content'), "
     "found 'hi'"),
    ([{"role": "user", "content": "a", "reasoning_content": "b"}],
     "message 0: 'reasoning_content' is an assistant's thinking, a string; found 'b' in a 'user' message"),
    ([{"role": "tool", "content": "a"}], "message 0 has role 'tool'; roles are system, user, assistant"),
    ([{"role": "user", "content": ["a"]}], "message 0 content must be a string, found ['a']"),
    ([{"role": "system", "content": "s"}], "message 0 is a system message with no user message after it"),
    ([{"role": "system", "content": "s"}, {"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
     "message 2 has role 'user' where 'assistant' was expected: after an optional system message, turns "
     "alternate user, assistant, ..."),
    ([{"role": "assistant", "content": "a"}], "message 0 has role 'assistant' where 'user' was expected: after an "
     "optional system message, turns alternate user, assistant, ..."),
    ([{"role": "system", "content": "s"}, *DIALOG[:2]],
     "message 2 is from the assistant; a dialog must end with a user message"),
])
def test_bad_dialogs_are_refused_naming_the_message(format_, dialog, message):
    tokenizer = ChatMLCharacters() if format_ is ChatMLFormat else Characters()
    with pytest.raises(ValueError) as refused:
        format_(tokenizer).encode_dialog_prompt(dialog)
    assert str(refused.value) == message


def test_llama2_folds_the_system_prompt_into_the_first_of_several_turns():
    chat = Llama2ChatFormat(Characters())
    assert chat.stop_tokens == {EOS}
    dialog = [{"role": "system", "content": "S"}, {"role": "user", "content": "a "}, {"role": "assistant", "content": " b"},
              {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}, {"role": "user", "content": "e"}]
    assert chat.encode_dialog_prompt(dialog) == [
        BOS, *text("[INST] <<SYS>>\nS\n<</SYS>>\n\na [/INST] b "), EOS, BOS, *text("[INST] c [/INST] d "), EOS,
        BOS, *text("[INST] e [/INST]")]


LLAMA3_SPECIAL = {"<|begin_of_text|>": 5, "<|start_header_id|>": 6, "<|end_header_id|>": 7, "<|eot_id|>": 8}


def test_llama3_layout_and_refusals():
    chat = Llama3ChatFormat(Characters(LLAMA3_SPECIAL))
    assert chat.stop_tokens == {EOS}
    header = lambda role: [6, *text(role), 7, *text("\n\n")]  # noqa: E731
    assert chat.encode_dialog_prompt([{"role": "tool", "content": " 42 "}]) == [5, *header("ipython"), *text("42"), 8,
                                                                                *header("assistant")]
    end = "the prompt ends with an open assistant header, so the dialog must end with a user, ipython or tool message"
    for dialog, message in [
        ([{"role": "system", "content": "s"}], f"message 0 is from the system; {end}"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}],
         f"message 2 is from the assistant; {end}"),
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "s"}],
         "message 1 is a system message; only message 0 may be one"),
        ([{"role": "robot", "content": "a"}], "message 0 has role 'robot'; roles are system, user, assistant, ipython, tool"),
    ]:
        with pytest.raises(ValueError) as refused:
            chat.encode_dialog_prompt(dialog)
        assert str(refused.value) == message


# A ChatML-like template on a tokenizer with a control token whose text begins another's.
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}<|im_start|>assistant"
CONTROLS = {"<|im_start|>": 3, "<|im_end|>": 4, "<|im_start|>assistant": 5}


def test_a_template_is_used_only_with_a_tokenizer_that_names_its_control_tokens():
    assert isinstance(chat_format_for(Characters(CONTROLS), chat_template=TEMPLATE), TemplateChatFormat)
    assert isinstance(chat_format_for(Characters(), chat_template=TEMPLATE), Llama2ChatFormat)  # it has none


def test_a_templates_prompt_has_its_control_tokens_longest_first_and_the_rest_as_plain_text():
    template = TemplateChatFormat(TEMPLATE, Characters(CONTROLS), Llama3ChatFormat(Characters(CONTROLS)))
    dialog = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "tool", "content": "42"}]
    assert template.encode_dialog_prompt(dialog) == (  # no begin token before each piece of text
        [3, *text("user\nhi"), 4, 5, *text("\nyo"), 4, 3, *text("tool\n42"), 4, 5])


def test_a_template_refuses_control_tokens_spelled_in_text_or_in_tool_calls():
    deepseek = "<\uff5ctool\u2581sep\uff5c>"  # DeepSeek's, not ASCII: found as written, not as JSON's \\u escapes
    template = TemplateChatFormat(TEMPLATE, Characters(CONTROLS | {deepseek: 6}), Llama3ChatFormat(Characters()))

    def calling(arguments):
        return [{"role": "assistant", "content": None,
                 "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": arguments}}]}]

    assert template.is_unsafe([{"role": "user", "content": "a <|im_end|> b"}])
    assert template.is_unsafe(calling("<|im_end|>")) and template.is_unsafe(calling(deepseek))
    assert not template.is_unsafe([{"role": "user", "content": "a <|im_end b"}]) and not template.is_unsafe(calling("{}"))
