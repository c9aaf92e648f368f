"""Streaming: pieces concatenate to exactly the final text, multi-byte characters and stop strings included."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llama_tp import Llama
from llama_tp.text.streaming import IncrementalDecoder, TextStream, check_stop, cut_at_stop, find_stop, stop_prefix_len
from llama_tp.text.tokenizer import Tokenizer, load_tokenizer
from torchrun import one_thread  # noqa: F401  (a fixture)
from tiny_checkpoint import LLAMA2_TOKENIZER, SHARED_DATA, TINY_LLAMA2, successor_weights, write_checkpoint

# Byte-fallback tokens (the llama and the rare CJK character have no piece of their own),
# SentencePiece's leading space, accents.
pytestmark = pytest.mark.usefixtures("one_thread")
FORCED_TEXT = "Zürich🦙 naïve 鱻 ok"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(str(LLAMA2_TOKENIZER))


@pytest.fixture(scope="module")
def forced(tmp_path_factory, tokenizer):
    """A tiny model that, after bos and the first token of FORCED_TEXT, greedily writes the rest."""
    chain = tokenizer.encode(FORCED_TEXT, bos=True, eos=True)
    assert len(set(chain)) == len(chain), "the forced text must not repeat a token"
    successor = dict(zip(chain[:-1], chain[1:]))
    directory = tmp_path_factory.mktemp("forced")
    write_checkpoint(directory, TINY_LLAMA2, successor_weights(TINY_LLAMA2, tokenizer.n_words, successor), 1, "dim")
    return Llama.build(str(directory), str(LLAMA2_TOKENIZER), max_seq_len=64, max_batch_size=2), chain


def test_forced_text_has_split_characters(tokenizer):
    pieces = [tokenizer.sp_model.id_to_piece(t) for t in tokenizer.encode(FORCED_TEXT, bos=False, eos=False)]
    assert sum(piece.startswith("<0x") for piece in pieces) >= 4, pieces


def test_incremental_decoder_holds_back_incomplete_characters(tokenizer):
    tokens = tokenizer.encode(FORCED_TEXT, bos=False, eos=False)
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.push(tokens[:n]) for n in range(1, len(tokens) + 1)]
    pieces.append(decoder.finish(tokenizer.decode(tokens)))
    assert "".join(pieces) == FORCED_TEXT
    assert all("\ufffd" not in piece for piece in pieces)
    assert pieces.count("") >= 3  # the steps inside the llama's four bytes emitted nothing


class CountingTokenizer:
    """A tokenizer that counts the tokens it is asked to decode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, tokens: list[int]) -> str:
        self.decoded += len(tokens)
        return self.tokenizer.decode(tokens)


@pytest.mark.parametrize("tokenizer_file", ["llama2-tokenizer.model", "llama3-tokenizer.model"])
def test_long_stream_decodes_each_token_a_bounded_number_of_times(tokenizer_file):
    """A long stream's pieces are the whole text, and decoding them costs linear time: each push
    decodes the new tokens and the last piece's, never the whole stream again."""
    tokenizer = load_tokenizer(str(SHARED_DATA / tokenizer_file))
    text = " ".join(f"{FORCED_TEXT} {n}, line\n\n" for n in range(300))
    tokens = tokenizer.encode(text, bos=False, eos=False)
    counting = CountingTokenizer(tokenizer)
    decoder = IncrementalDecoder(counting, stop=["never appears"])
    pieces = [decoder.push(tokens[:n]) for n in range(1, len(tokens) + 1)]
    pieces.append(decoder.finish(tokenizer.decode(tokens)))
    assert "".join(pieces) == tokenizer.decode(tokens) == text
    assert all("\ufffd" not in piece for piece in pieces)
    assert len(tokens) > 4000 and counting.decoded < 8 * len(tokens)


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet="aé🦙鱻 \n.xy", min_size=1, max_size=25), data=st.data())
def test_pieces_concatenate_to_the_cut_text(tokenizer, text, data):
    tokens = tokenizer.encode(text, bos=False, eos=False)
    start = data.draw(st.integers(0, len(text) - 1))
    stop = [text[start : start + data.draw(st.integers(1, 3))], "🦙."]
    final = cut_at_stop(tokenizer.decode(tokens), stop)
    decoder = IncrementalDecoder(tokenizer, stop)
    emitted = ""
    for n in range(1, len(tokens) + 1):
        emitted += decoder.push(tokens[:n])
        # Nothing past the eventual cut is ever shown.
        assert final.startswith(emitted)
        if cut_at_stop(tokenizer.decode(tokens[:n]), stop) != tokenizer.decode(tokens[:n]):
            break
    assert emitted + decoder.finish(final) == final


def test_stream_matches_completion_on_forced_non_ascii(forced, tokenizer):
    llama, chain = forced
    prompt = tokenizer.decode(chain[1:2])
    stream = llama.stream_text_completion(prompt, temperature=0, max_gen_len=40)
    pieces = list(stream)
    expected = llama.text_completion([prompt], temperature=0, max_gen_len=40)[0]["generation"]
    assert prompt + "".join(pieces) == FORCED_TEXT
    assert "".join(pieces) == expected == stream.text
    assert stream.tokens == chain[2:-1]  # the eos ends the stream and is not part of it
    assert len(pieces) < len(chain) - 2  # byte tokens were merged into whole characters


def test_stream_cuts_at_stop_string(forced, tokenizer):
    llama, chain = forced
    prompt = tokenizer.decode(chain[1:2])
    stop = ["ïve"]
    stream = llama.stream_text_completion(prompt, temperature=0, max_gen_len=40, stop=stop)
    text = "".join(stream)
    assert prompt + text == "Zürich🦙 na"
    assert text == llama.text_completion([prompt], temperature=0, max_gen_len=40, stop=stop)[0]["generation"]
    # The tokens end with the one that completed the stop string.
    assert "ïve" in tokenizer.decode(stream.tokens) and "ïve" not in tokenizer.decode(stream.tokens[:-1])


def test_stream_chat_in_lockstep_with_chat_completion(forced):
    llama, _ = forced
    dialog = [{"role": "user", "content": "Grüße, 世界"}]
    stream = llama.stream_chat_completion(dialog, temperature=0, max_gen_len=12)
    text = "".join(stream)
    (result,) = llama.chat_completion([dialog], temperature=0, max_gen_len=12, token_ids=True)
    assert text == result["generation"]["content"] == stream.text
    assert stream.tokens == result["token_ids"]


def test_stop_strings_are_checked_by_name():
    assert check_stop(None) == () and check_stop(["a", "\n\n"]) == ("a", "\n\n")
    for wrong in ("a", [1], ["a", 2]):
        with pytest.raises(ValueError, match=re.escape("stop must be a list of strings, e.g. ['\\n\\n'], found "
                                                       + repr(wrong))):
            check_stop(wrong)
    with pytest.raises(ValueError, match=r"stop strings must not be empty, found \['a', ''\]"):
        check_stop(["a", ""])


def test_cut_at_stop_from_the_first_character_and_only_after_start():
    assert cut_at_stop("stop here", ["stop"]) == ""
    assert cut_at_stop("ab stop", ["stop"]) == "ab "
    assert cut_at_stop("ab stop", ["stop"], start=4) == "ab stop"  # before start: the prompt, with echo
    assert cut_at_stop("ab stop stop", ["stop"], start=4) == "ab stop "
    assert cut_at_stop("nothing", ["stop"]) == "nothing"


def test_a_text_stream_holds_nothing_before_it_ends():
    stream = TextStream(lambda stream: iter(()))
    assert (stream.tokens, stream.text, list(stream)) == ([], "", [])


def test_find_stop_and_the_held_back_start_of_a_stop_string():
    assert find_stop("stop stop", ["stop"]) == 0 and find_stop("a stop b stop", ["stop"], start=3) == 9
    assert find_stop("a b", ["stop", "b"]) == 2 and find_stop("nothing", ["stop"]) == -1
    assert stop_prefix_len("abc", ["xyz"]) == 0 and stop_prefix_len("ab st", ["stop"]) == 2
    assert stop_prefix_len("ab stop", ["stop"]) == 0  # a whole stop string is found, not held back


def test_the_decoder_hands_out_text_at_once_and_nothing_after_a_stop_string(tokenizer):
    tokens = tokenizer.encode("Hello world and more", bos=False, eos=False)
    assert IncrementalDecoder(tokenizer).push(tokens) == "Hello world and more"
    decoder = IncrementalDecoder(tokenizer, stop=["world"])
    assert decoder.push(tokens[:3]) == "Hello " and decoder.stopped
    assert decoder.push(tokens) == ""


def test_the_decoder_names_the_stop_string_that_ended_the_text(tokenizer):
    tokens = tokenizer.encode("Hello world and more", bos=False, eos=False)
    decoder = IncrementalDecoder(tokenizer, stop=["more", "and", "xyz"])
    pieces = [decoder.push(tokens[:end]) for end in range(1, len(tokens) + 1)]
    assert ("".join(pieces), decoder.stopped, decoder.matched) == ("Hello world ", True, "and")
    unstopped = IncrementalDecoder(tokenizer, stop=["xyz"])
    assert unstopped.push(tokens) == "Hello world and more" and unstopped.matched is None
