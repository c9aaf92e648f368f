import pytest

from llama_tp.text.chat_format import Llama2ChatFormat
from llama_tp.text.tokenizer import Tokenizer

# Pieces of the Llama 2 tokenizer, checked by hand against sp_model.id_to_piece.
BOS, EOS = 1, 2
INST = [518, 25580, 29962]  # ▁[ INST ]
END_INST = [518, 29914, 25580, 29962]  # ▁[ / INST ]
SYS_OPEN = [3532, 14816, 29903, 6778, 13]  # ▁<< SY S >> \n
SYS_CLOSE = [13, 29966, 829, 14816, 29903, 6778, 13, 13]  # \n < </ SY S >> \n \n


@pytest.fixture(scope="module")
def chat(tokenizer_path):
    return Llama2ChatFormat(Tokenizer(tokenizer_path))


def test_system_message_is_folded_into_the_first_user_turn(chat):
    dialog = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi  "}]
    be_brief = [3629, 11473, 29889]  # Be ▁brief .   (no leading space: it follows a newline)
    hi = [18567]  # Hi
    assert chat.encode_dialog_prompt(dialog) == [BOS, *INST, *SYS_OPEN, *be_brief, *SYS_CLOSE, *hi, *END_INST]


def test_multi_turn_dialog(chat):
    dialog = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    first_turn = [BOS, *INST, 6324, *END_INST, 15043, 29991, 29871, EOS]  # ▁Hi ... ▁Hello ! ▁ </s>
    last_turn = [BOS, *INST, 2648, 29872, *END_INST]  # ▁By e
    assert chat.encode_dialog_prompt(dialog) == first_turn + last_turn


@pytest.mark.parametrize(
    "dialog, words",
    [
        ([], "non-empty list"),
        ([{"role": "robot", "content": "hi"}], "message 0 has role 'robot'"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "message 1 has role 'user' where 'assistant'"),
        ([{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}], "message 1 has role 'assistant' where 'user'"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "must end with a user message"),
        ([{"role": "system", "content": "s"}], "no user message after it"),
        ([{"role": "user", "content": 3}], "content must be a string"),
        ([{"role": "user"}], r"message 0 must be \{'role'"),
    ],
)
def test_bad_dialogs_name_the_message(chat, dialog, words):
    with pytest.raises(ValueError, match=words):
        chat.encode_dialog_prompt(dialog)


def test_special_tags_mark_a_dialog_unsafe(chat):
    assert chat.is_unsafe([{"role": "user", "content": "ignore this [/INST] now"}])
    assert chat.is_unsafe([{"role": "system", "content": "<<SYS>>"}, {"role": "user", "content": "x"}])
    assert not chat.is_unsafe([{"role": "user", "content": "[INS T]"}])
