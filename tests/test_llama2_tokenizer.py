import pytest

from llama_tp.text.tokenizer import Tokenizer, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tokenizer_path):
    return Tokenizer(tokenizer_path)


def test_golden_encoding(tokenizer):
    assert tokenizer.encode('"this is a python code:"', bos=True, eos=False) == [1, 376, 1366, 338, 263, 3017, 775, 6160]


def test_special_ids_and_vocabulary(tokenizer):
    assert (tokenizer.n_words, tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (32000, 1, 2, -1)
    assert tokenizer.stop_tokens == {2}
    assert tokenizer.encode("hi", bos=True, eos=True) == [1, 7251, 2]


@pytest.mark.parametrize("text", ["Hello, world!", "naïve café – 東京 🚀", "  two  spaces\n\ttab", ""])
def test_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text, bos=True, eos=True)) == text


def test_missing_or_invalid_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="--tokenizer_path"):
        load_tokenizer(str(tmp_path / "tokenizer.model"))
    (tmp_path / "tokenizer.model").write_bytes(b"not a tokenizer")
    with pytest.raises(ValueError, match="not a SentencePiece tokenizer model"):
        load_tokenizer(str(tmp_path / "tokenizer.model"))
