"""Llama 3's tiktoken tokenizer on the real tokenizer.model, with ids from Meta's own tests."""

import pytest

from llama_tp.text.tokenizer import Llama3Tokenizer, Tokenizer, load_tokenizer, split_long_runs
from tiny_checkpoint import LLAMA2_TOKENIZER, SHARED_DATA

LLAMA3_TOKENIZER = SHARED_DATA / "llama3-tokenizer.model"


@pytest.fixture(scope="module")
def tokenizer() -> Llama3Tokenizer:
    return load_tokenizer(str(LLAMA3_TOKENIZER))


def test_chosen_by_content_not_name(tmp_path, tokenizer):
    assert isinstance(tokenizer, Llama3Tokenizer)
    assert isinstance(load_tokenizer(str(LLAMA2_TOKENIZER)), Tokenizer)
    # Swapped names: a Llama 3 file called like a SentencePiece model and the other way round.
    (tmp_path / "sentencepiece.model").write_bytes(LLAMA3_TOKENIZER.read_bytes())
    (tmp_path / "llama3-tokenizer.model").write_bytes(LLAMA2_TOKENIZER.read_bytes())
    assert isinstance(load_tokenizer(str(tmp_path / "sentencepiece.model")), Llama3Tokenizer)
    assert isinstance(load_tokenizer(str(tmp_path / "llama3-tokenizer.model")), Tokenizer)


def test_vocabulary_and_special_ids(tokenizer):
    assert tokenizer.n_words == 128256 and len(tokenizer.special_tokens) == 256
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (128000, 128001, 128004)
    named = {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001, "<|reserved_special_token_0|>": 128002,
             "<|start_header_id|>": 128006, "<|end_header_id|>": 128007, "<|eom_id|>": 128008,
             "<|eot_id|>": 128009, "<|python_tag|>": 128010, "<|reserved_special_token_2|>": 128012,
             "<|reserved_special_token_245|>": 128255}
    assert {name: tokenizer.special_tokens[name] for name in named} == named
    assert tokenizer.stop_tokens == {128001, 128008, 128009}
    text = "<|begin_of_text|><|end_of_text|><|start_header_id|><|end_header_id|><|eot_id|>"
    assert tokenizer.encode(text, bos=False, eos=False, allowed_special="all") == [128000, 128001, 128006, 128007, 128009]
    # By default special-token text is plain text: a user cannot forge a header or an end of turn.
    plain = tokenizer.encode("<|eot_id|>", bos=False, eos=False)
    assert 128009 not in plain and tokenizer.decode(plain) == "<|eot_id|>"


def test_encode_decode_as_meta(tokenizer):
    ids = [128000, 2028, 374, 264, 1296, 11914, 13, 128001]  # Meta's llama-models test_tokenizer.py
    assert tokenizer.encode("This is a test sentence.", bos=True, eos=True) == ids
    assert tokenizer.decode(ids) == "<|begin_of_text|>This is a test sentence.<|end_of_text|>"


@pytest.mark.parametrize("text", [
    "Emoji 😀👍🏽 and 🇫🇷 flags",
    "中文分词测试，日本語のテキスト、한국어 문장",
    "tabs\t\tand  double  spaces\n\n\nnew lines   \r\n trailing   ",
    "",
    " ",
])
def test_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text, bos=False, eos=False)) == text


def test_long_runs_are_split_as_meta_does(tokenizer):
    parts = list(split_long_runs("a" * 60_000 + " " * 30_000 + "b", 25_000))
    assert [len(p) for p in parts] == [25_000, 25_000, 10_000 + 25_000, 5_000 + 1]
    text = "x" * 60_000 + "\n" * 30_001 + "y" * 10
    ids = tokenizer.encode(text, bos=False, eos=False)
    assert tokenizer.decode(ids) == text
    assert ids == [i for part in split_long_runs(text, 25_000) for i in tokenizer.encode(part, bos=False, eos=False)]


def test_bad_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "tokenizer.model"
    bad.write_text("IQ== 0\nIg== 1\nnot-base64! 2\n")
    with pytest.raises(ValueError, match="line 3"):
        load_tokenizer(str(bad))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing.model"))
