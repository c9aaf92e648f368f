"""`convert gguf` of a file whose vocabulary is SentencePiece's (tokenizer.ggml.model "llama", as
llama.cpp writes Llama 2, Mistral and Mixtral): the tokenizer.json it writes encodes and decodes
as the original tokenizer.model does, here the real Llama 2 one."""

import random

import numpy as np
import pytest
import sentencepiece
from gguf import GGUFWriter

from llama_tp import Llama
from llama_tp.tools.convert.__main__ import main as convert
from tiny_checkpoint import LLAMA2_TOKENIZER

DIM, HEADS, FFN = 64, 4, 128
TEXTS = ["Hello world", " a leading space", "  two spaces", "new\nline\n\n", "tabs\tand\t\ttabs",
         "emoji 🦙🚀 and bytes", "日本語のテキスト", "Ünïcödé ß ñ", "digits 1234567890 3.14", "", " ",
         "</s> <s> [INST] typed, not control tokens [/INST]", "print('hi')\n    return x**2"]
# llama.cpp's token types: normal, unknown, control, byte
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6


def vocabulary(sp: sentencepiece.SentencePieceProcessor) -> tuple[list[str], list[float], list[int]]:
    """A tokenizer.model's pieces, scores and token types, as llama.cpp's converter reads them."""
    ids = range(sp.vocab_size())
    types = [UNKNOWN if sp.is_unknown(i) else CONTROL if sp.is_control(i) else BYTE if sp.is_byte(i) else NORMAL
             for i in ids]
    return [sp.id_to_piece(i) for i in ids], [sp.get_score(i) for i in ids], types


def write_gguf(path, sp: sentencepiece.SentencePieceProcessor) -> None:
    """A one-layer Llama GGUF of random fp32 weights with the tokenizer.model's vocabulary."""
    rng = np.random.default_rng(0)
    tokens, scores, types = vocabulary(sp)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(4096)
    writer.add_embedding_length(DIM)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(DIM // HEADS)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.add_add_bos_token(True)
    for name, rows, cols in (("token_embd", len(tokens), DIM), ("output", len(tokens), DIM),
                             ("blk.0.attn_q", DIM, DIM), ("blk.0.attn_k", DIM, DIM), ("blk.0.attn_v", DIM, DIM),
                             ("blk.0.attn_output", DIM, DIM), ("blk.0.ffn_gate", FFN, DIM),
                             ("blk.0.ffn_up", FFN, DIM), ("blk.0.ffn_down", DIM, FFN)):
        writer.add_tensor(f"{name}.weight", (0.05 * rng.standard_normal((rows, cols))).astype(np.float32))
    for name in ("blk.0.attn_norm", "blk.0.ffn_norm", "output_norm"):
        writer.add_tensor(f"{name}.weight", np.ones(DIM, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Llama, sentencepiece.SentencePieceProcessor]:
    root = tmp_path_factory.mktemp("spm_gguf")
    sp = sentencepiece.SentencePieceProcessor(model_file=str(LLAMA2_TOKENIZER))
    write_gguf(root / "llama2.gguf", sp)
    convert("gguf", str(root / "llama2.gguf"), str(root / "mp1"), mp=1)
    llama = Llama.build(str(root / "mp1"), str(root / "mp1" / "tokenizer.json"), max_seq_len=64, max_batch_size=1)
    return llama, sp


def test_the_converted_tokenizer_encodes_as_sentencepiece(converted):
    llama, sp = converted
    tokenizer = llama.tokenizer
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.n_words) == (sp.bos_id(), sp.eos_id(), sp.vocab_size())
    for text in TEXTS:
        ids = sp.encode(text)
        assert tokenizer.encode(text, bos=True, eos=False) == [sp.bos_id()] + ids, text
        assert tokenizer.decode(ids) == sp.decode(ids)


def test_random_text_encodes_as_sentencepiece(converted):
    """Pieces of words, spaces, punctuation, accents, CJK, emoji (bytes), and control tokens' names."""
    llama, sp = converted
    rng = random.Random(0)
    alphabet = list("abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789.,!?'\"-_()[]<>/\\\n\t") + [
        "é", "ß", "日", "本", "🦙", "ñ", "Ж", "\u00a0", "  ", "</s>", "<s>", "<unk>", "\u2581"]
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        assert llama.tokenizer.encode(text, bos=False, eos=False) == sp.encode(text), repr(text)


def test_a_converted_model_generates(converted):
    llama, _ = converted
    (tokens,), _ = llama.generate([llama.tokenizer.encode("Hello", bos=True, eos=False)], max_gen_len=4, temperature=0)
    assert len(tokens) == 4
