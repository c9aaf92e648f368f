"""Chat formats read from templates, the converter's record, and ChatML prompts."""

import json

import pytest

from llama_tp import Llama
from llama_tp.checkpoint.record import ModelRecord, read_record
from llama_tp.sampling import SamplingOptions
from llama_tp.text.chat_format import ChatMLFormat, chat_format_for
from llama_tp.tools.convert.chat_template import chat_format_of, default_system_prompt
from llama_tp.text.hf_tokenizer import HFTokenizer
from llama_tp.text.tokenizer import load_tokenizer
from test_convert_hf import CHATML_TEMPLATE, byte_level_tokenizer
from tiny_checkpoint import LLAMA2_TOKENIZER

# Qwen2.5's template: a system message from the dialog, else a fixed default.
QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
    "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
)
LLAMA3_TEMPLATE = "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"


def test_convert_chat_format_and_default_system_prompt_from_templates():
    assert chat_format_of(CHATML_TEMPLATE) == chat_format_of(QWEN_TEMPLATE) == "chatml"
    assert chat_format_of(LLAMA3_TEMPLATE) == "llama3"
    assert chat_format_of("{{ '[INST] ' + message['content'] + ' [/INST]' }}") == "mistral"
    assert chat_format_of("{{ '[INST] ' + '<<SYS>>\\n' + system + ' [/INST]' }}") == "llama2"
    assert chat_format_of(None) is None and chat_format_of("{{ message['content'] }}") is None
    assert default_system_prompt(CHATML_TEMPLATE) == "You are tiny."
    assert default_system_prompt(QWEN_TEMPLATE) == "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    assert default_system_prompt("{{ '<|im_start|>' + message['role'] }}") is None


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> HFTokenizer:
    folder = tmp_path_factory.mktemp("tokenizer")
    byte_level_tokenizer(folder)
    return load_tokenizer(str(folder / "tokenizer.json"))


def test_convert_chat_load_tokenizer_chooses_by_file(tokenizer):
    assert isinstance(tokenizer, HFTokenizer)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (1, 0, -1)
    assert tokenizer.special_tokens == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    assert tokenizer.encode("the fox", bos=True, eos=True)[-1] == 0
    assert tokenizer.encode("the fox", bos=True, eos=False)[0] != 1  # add_bos_token false: no bos
    assert not isinstance(load_tokenizer(str(LLAMA2_TOKENIZER)), HFTokenizer)


def test_convert_chat_chatml_prompt_layout(tokenizer):
    chat = ChatMLFormat(tokenizer, default_system_prompt="Be brief.")
    im_start, im_end = chat.im_start, chat.im_end
    assert chat.stop_tokens == {tokenizer.eos_id, im_end}

    def turn(role, content):
        return [im_start, *tokenizer.encode(f"{role}\n{content}", bos=False, eos=False), im_end,
                *tokenizer.encode("\n", bos=False, eos=False)]

    reply = [im_start, *tokenizer.encode("assistant\n", bos=False, eos=False)]
    dialog = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the fox"},
              {"role": "user", "content": "and?"}]
    assert chat.encode_dialog_prompt(dialog) == (
        turn("system", "Be brief.") + turn("user", "hi") + turn("assistant", "the fox") + turn("user", "and?") + reply)
    own_system = [{"role": "system", "content": "Be long."}, dialog[0]]
    assert chat.encode_dialog_prompt(own_system) == turn("system", "Be long.") + turn("user", "hi") + reply
    with pytest.raises(ValueError, match="message 1 has role 'user' where 'assistant' was expected"):
        chat.encode_dialog_prompt([dialog[0], dialog[0]])
    with pytest.raises(ValueError, match="must end with a user message"):
        chat.encode_dialog_prompt(dialog[:2])


def test_convert_chat_record_round_trip_and_errors(tmp_path, tokenizer):
    assert read_record(tmp_path) == ModelRecord()  # Meta's own checkpoints have none
    (tmp_path / "llama_tp.json").write_text(json.dumps({"chat_format": "chatml", "stop_tokens": [2]}))
    record = read_record(tmp_path)
    assert record == ModelRecord(chat_format="chatml", stop_tokens=(2,))
    assert isinstance(chat_format_for(tokenizer, record.chat_format), ChatMLFormat)
    written = ModelRecord("chatml", "Be brief.", (7, 2, 7), "model.gguf", {"temperature": 0.2, "top_k": 40})
    (tmp_path / "llama_tp.json").write_text(written.to_json())
    assert read_record(tmp_path) == ModelRecord("chatml", "Be brief.", (2, 7), "model.gguf", {"temperature": 0.2, "top_k": 40})
    for bad, message in (({"chat_format": "vicuna"}, "chat_format 'vicuna' is not one of"),
                         ({"stop_tokens": "2"}, "stop_tokens must be a list of token ids"),
                         ({"chat_fromat": "chatml"}, "keys among"),
                         ({"sampling": {"temp": 0.7}}, "sampling setting 'temp' is not one of temperature, top_p"),
                         ({"sampling": {"top_k": 0.5}}, "sampling top_k must be a int, found 0.5")):
        (tmp_path / "llama_tp.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            read_record(tmp_path)


def test_recommended_sampling_fills_what_the_caller_leaves_out(tokenizer):
    meta = Llama(None, tokenizer)  # no record: Meta's defaults
    assert meta.sampling_options() == SamplingOptions(temperature=0.6, top_p=0.9, top_k=None, repetition_penalty=1.0)
    tuned = Llama(None, tokenizer, sampling_defaults={"temperature": 0.2, "top_k": 40, "repetition_penalty": 1.1})
    assert tuned.sampling_options() == SamplingOptions(temperature=0.2, top_p=0.9, top_k=40, repetition_penalty=1.1)
    chosen = tuned.sampling_options(temperature=0, top_k=0, repetition_penalty=1.0, seed=3)  # 0: no top-k cut
    assert chosen == SamplingOptions(temperature=0, top_p=0.9, top_k=0, repetition_penalty=1.0, seed=3)
