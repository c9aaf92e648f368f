"""`convert gguf` on a tiny random Llama GGUF written here: ours equals transformers' GGUF loading.

No network: the file mixes every supported tensor type and stores q/k in Meta's order, as
llama.cpp does (tests/test_demo_network.py checks that on a real llama.cpp file).
"""

import json

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import quantize
from tokenizers import Tokenizer

from llama_tp import Llama
from llama_tp.text.chat_format import ChatMLFormat
from llama_tp.tools.convert.__main__ import main as convert
from test_convert_gguf import K_BLOCK, random_k_blocks
from test_convert_hf import CHATML_TEMPLATE, byte_level_tokenizer

DIM, HEADS, KV_HEADS, FFN, LAYERS = 256, 4, 2, 512, 2  # K-quant rows need multiples of 256
# One type per tensor kind, so every supported type is read inside a real model.
TYPES = {"attn_q": Q.Q4_K, "attn_k": Q.Q6_K, "attn_v": Q.Q4_0, "attn_output": Q.Q4_1,
         "ffn_gate": Q.BF16, "ffn_up": Q.F16, "ffn_down": Q.Q8_0, "token_embd": Q.Q8_0}


def stored(values: np.ndarray, kind: Q, rng) -> np.ndarray:
    """values in GGUF's encoding of kind; K-quants (which gguf cannot quantise) as random blocks."""
    if kind in K_BLOCK:  # small scales keep activations sane
        return random_k_blocks(kind, *values.shape, rng, scales=(1e-4, 1e-3))
    return values.astype(np.float16) if kind == Q.F16 else quantize(values, kind)


def write_tiny_gguf(path, tokenizer_json: dict, vocab: list[str], types: dict = TYPES) -> None:
    """A tiny Llama GGUF storing each kind of tensor in the GGUF type `types` names for it."""
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(2048)
    writer.add_embedding_length(DIM)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(20000.0)
    writer.add_rope_dimension_count(DIM // HEADS)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(vocab)
    writer.add_token_types([3 if token.startswith("<|") else 1 for token in vocab])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer_json["model"]["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)
    writer.add_float32("general.sampling.temp", 0.25)  # the makers' recommended sampling, recorded
    writer.add_int32("general.sampling.top_k", 30)

    def add(name: str, rows: int, cols: int, kind: Q) -> None:
        values = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
        writer.add_tensor(name, stored(values, kind, rng), raw_dtype=None if kind == Q.F16 else kind)

    add("token_embd.weight", len(vocab), DIM, types["token_embd"])  # tied: no output.weight
    for i in range(LAYERS):
        for kind, rows, cols in (("attn_q", DIM, DIM), ("attn_k", DIM // 2, DIM), ("attn_v", DIM // 2, DIM),
                                 ("attn_output", DIM, DIM), ("ffn_gate", FFN, DIM), ("ffn_up", FFN, DIM),
                                 ("ffn_down", DIM, FFN)):
            add(f"blk.{i}.{kind}.weight", rows, cols, types[kind])
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(DIM)).astype(np.float32))
    writer.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(DIM)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    byte_level_tokenizer(root)
    tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
    vocab = [token for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])]
    write_tiny_gguf(root / "tiny.gguf", json.loads(tokenizer.to_str()), vocab)
    convert("gguf", str(root / "tiny.gguf"), str(root / "mp1"), mp=1)
    llama = Llama.build(str(root / "mp1"), str(root / "mp1" / "tokenizer.json"), max_seq_len=64, max_batch_size=2)
    return root, llama


def test_convert_gguf_model_logits_equal_transformers(tiny):
    root, llama = tiny
    reference = transformers.AutoModelForCausalLM.from_pretrained(root, gguf_file="tiny.gguf", dtype=torch.float32)
    tokens = torch.randint(0, llama.model.args.vocab_size, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference.eval()(tokens).logits
    assert expected.abs().max() > 1e-3  # the random blocks made a model that computes something
    torch.testing.assert_close(llama.model.forward(tokens, 0), expected, atol=1e-4, rtol=0)


def test_convert_gguf_model_tokenizer_and_chat_record(tiny):
    root, llama = tiny
    reference = transformers.AutoTokenizer.from_pretrained(root, gguf_file="tiny.gguf")
    for text in ("the quick brown fox", "Paris is in France!", "  lazy\n\ndog 7"):
        assert llama.tokenizer.encode(text, bos=True, eos=False) == reference.encode(text)
    record = json.loads((root / "mp1" / "llama_tp.json").read_text())
    assert record == {"chat_format": "chatml", "default_system_prompt": "You are tiny.", "stop_tokens": [2],
                      "converted_from": "tiny.gguf", "sampling": {"temperature": 0.25, "top_k": 30},
                      "chat_template": CHATML_TEMPLATE, "context_length": 2048}
    assert llama.sampling_defaults == {"temperature": 0.25, "top_k": 30}
    assert isinstance(llama.formatter.known, ChatMLFormat)  # what the template was recognised as
    params = json.loads((root / "mp1" / "params.json").read_text())
    assert params["rope_theta"] == 20000.0 and params["n_kv_heads"] == KV_HEADS
