"""Structured outputs' batched logits adjustments (llama_tp/structured): the pure functions
against hand-made expectations, a rank's vocabulary slice against the whole, real grammars'
masks over the Llama 2 and Llama 3 vocabularies, and free rows left untouched."""

import json

import pytest
import torch

from llama_tp.structured.constraint import Constraint, from_response_format
from llama_tp.structured.grammars import Grammars, tokenizer_info
from llama_tp.structured.rows import RowAdjustment, adjust_rows, allow_token
from llama_tp.structured.logits import allowed_tokens, bias_logits, mask_logits, penalize_logits
from llama_tp.text.tokenizer import Llama3Tokenizer
from tiny_checkpoint import SHARED_DATA


def test_allowed_tokens_unpacks_xgrammars_bits():
    bitmask = torch.tensor([[0b101, -1], [0, -(1 << 31)]], dtype=torch.int32)  # bit j of word i: token 32 i + j
    allowed = allowed_tokens(bitmask, 40)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2, *range(32, 40)]
    assert allowed[1].nonzero().flatten().tolist() == []  # bit 31 of word 1 is token 63, beyond the vocabulary


def test_allow_token_sets_one_bit_the_sign_bit_too():
    bitmask = torch.tensor([[0b101, 0], [0, 0]], dtype=torch.int32)
    for token in (1, 63):
        allow_token(bitmask, 1, token)
    allow_token(bitmask, 0, 31)
    assert allowed_tokens(bitmask, 64)[0].nonzero().flatten().tolist() == [0, 2, 31]
    assert allowed_tokens(bitmask, 64)[1].nonzero().flatten().tolist() == [1, 63]


def test_mask_bias_and_penalties():
    logits = torch.zeros(2, 4)
    masked = mask_logits(logits, torch.tensor([[True, False, True, False], [True] * 4]))
    assert masked[0].tolist() == [0, float("-inf"), 0, float("-inf")] and masked[1].tolist() == [0] * 4
    biased = bias_logits(logits, torch.tensor([0, 0, 1]), torch.tensor([1, 1, 3]), torch.tensor([2.0, 3.0, -100.0]))
    assert biased.tolist() == [[0, 5, 0, 0], [0, 0, 0, -100]]
    counts = torch.tensor([[0, 1, 3, 0], [2, 0, 0, 0]])
    penalized = penalize_logits(logits, counts, torch.tensor([0.5, 0.0]), torch.tensor([1.0, 0.25]))
    assert penalized.tolist() == [[0, -1.5, -3.5, 0], [-0.5, 0, 0, 0]]


@pytest.fixture(scope="module")
def llama3_grammars():
    tokenizer = Llama3Tokenizer(str(SHARED_DATA / "llama3-tokenizer.model"))
    return tokenizer, Grammars(tokenizer_info(tokenizer, tokenizer.n_words, tokenizer.stop_tokens))


def test_digits_only_and_then_only_stop_tokens(llama3_grammars):
    tokenizer, grammars = llama3_grammars
    row = RowAdjustment(grammars.matcher(Constraint("regex", "[0-9]{3}")))
    logits = torch.zeros(1, tokenizer.n_words)
    allowed = adjust_rows([row], logits).isfinite()[0].nonzero().flatten().tolist()
    assert allowed and all(tokenizer.decode([token]).isdigit() for token in allowed)
    assert tokenizer.encode("123", bos=False, eos=False)[0] in allowed
    row.accept(tokenizer.encode("123", bos=False, eos=False)[0])
    done = adjust_rows([row], logits).isfinite()[0].nonzero().flatten().tolist()
    assert set(done) == tokenizer.stop_tokens  # the grammar is complete: only the end


def test_free_rows_untouched_and_a_slice_as_the_whole(llama3_grammars):
    tokenizer, grammars = llama3_grammars
    vocab = tokenizer.n_words
    rows = [None, RowAdjustment(grammars.matcher(Constraint.choice(["yes", "no"])), ((5, 2.0), (vocab - 1, -1.0)),
                                0.5, 0.25, {7: 2, vocab - 2: 1}),
            RowAdjustment(None, (), 1.0, 0.0, {vocab - 2: 3}), None]
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    assert torch.equal(adjust_rows([None] * 4, logits), logits)
    whole = adjust_rows(rows, logits)
    assert torch.equal(whole[0], logits[0]) and torch.equal(whole[3], logits[3])
    half = vocab // 2
    slices = torch.cat([adjust_rows(rows, logits[:, :half], 0, vocab), adjust_rows(rows, logits[:, half:], half, vocab)],
                       dim=-1)
    assert torch.equal(slices, whole)
    allowed = whole[1].isfinite().nonzero().flatten().tolist()
    assert {tokenizer.decode([token]) for token in allowed} <= {"yes", "no", "y", "n", "ye", "es", "o"}
    assert whole[2, vocab - 2] == logits[2, vocab - 2] - 1.0  # presence once, no frequency


def test_llama2_byte_fallback_vocabulary_answers_an_object(llama2_tokenizer):
    grammars = Grammars(tokenizer_info(llama2_tokenizer, llama2_tokenizer.n_words, llama2_tokenizer.stop_tokens))
    row = RowAdjustment(grammars.matcher(Constraint("json_object")))
    allowed = adjust_rows([row], torch.zeros(1, llama2_tokenizer.n_words)).isfinite()[0].nonzero().flatten()
    pieces = [llama2_tokenizer.sp_model.id_to_piece(token) for token in allowed.tolist()]
    assert pieces and all(piece.startswith(("{", "<0x7B>")) for piece in pieces)  # an object, not an array


def test_compile_errors_say_what_was_refused(llama3_grammars):
    _, grammars = llama3_grammars
    with pytest.raises(ValueError, match=r"Unclosed '\['"):
        grammars.compile(Constraint("regex", "a["))
    assert grammars.compile(Constraint("regex", "a")) is grammars.compile(Constraint("regex", "a"))  # cached


def test_response_format_as_a_constraint():
    assert from_response_format(None) is None and from_response_format({"type": "text"}) is None
    assert from_response_format({"type": "json_object"}) == Constraint("json_object")
    schema = {"type": "object", "properties": {"b": {}, "a": {}}}
    constraint = from_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert constraint.kind == "json_schema" and list(json.loads(constraint.source)["properties"]) == ["b", "a"]
    with pytest.raises(ValueError, match="xml"):
        from_response_format({"type": "xml"})
