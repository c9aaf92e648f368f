"""Our logits equal Hugging Face transformers' LlamaForCausalLM, an independent implementation."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from llama_tp import Llama
from llama_tp.model.args import ModelArgs
from tiny_checkpoint import TINY_LLAMA2, TINY_LLAMA3, full_weights

VOCAB = 32000


def rotate_half_order(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Meta interleaves each head's rotary pairs (0,1),(2,3)...; transformers splits them in halves."""
    rows, cols = weight.shape
    # n_heads, head_dim // 2 pairs, 2, cols  ->  n_heads, 2, head_dim // 2, cols
    return weight.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def hf_model(params: dict, weights: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    args = ModelArgs.from_dict(params).with_vocab_size(VOCAB)
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.use_scaled_rope:
        rope |= {"rope_type": "llama3", "factor": args.rope_scaling_factor, "low_freq_factor": 1.0,
                 "high_freq_factor": args.rope_high_freq_factor, "original_max_position_embeddings": 8192}
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=args.dim, intermediate_size=args.ffn_hidden_dim,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
        num_key_value_heads=args.kv_heads, rms_norm_eps=args.norm_eps, rope_parameters=rope,
        max_position_embeddings=64, tie_word_embeddings=False,
    )
    state = {"model.embed_tokens.weight": weights["tok_embeddings.weight"],
             "model.norm.weight": weights["norm.weight"], "lm_head.weight": weights["output.weight"]}
    for i in range(args.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        state |= {
            theirs + "self_attn.q_proj.weight": rotate_half_order(weights[ours + "attention.wq.weight"], args.n_heads),
            theirs + "self_attn.k_proj.weight": rotate_half_order(weights[ours + "attention.wk.weight"], args.kv_heads),
            theirs + "self_attn.v_proj.weight": weights[ours + "attention.wv.weight"],
            theirs + "self_attn.o_proj.weight": weights[ours + "attention.wo.weight"],
            theirs + "mlp.gate_proj.weight": weights[ours + "feed_forward.w1.weight"],
            theirs + "mlp.down_proj.weight": weights[ours + "feed_forward.w2.weight"],
            theirs + "mlp.up_proj.weight": weights[ours + "feed_forward.w3.weight"],
            theirs + "input_layernorm.weight": weights[ours + "attention_norm.weight"],
            theirs + "post_attention_layernorm.weight": weights[ours + "ffn_norm.weight"],
        }
    model = LlamaForCausalLM(config).float().eval()
    model.load_state_dict({name: tensor.float() for name, tensor in state.items()}, strict=True)
    return model


@pytest.mark.parametrize(
    "family, params",
    [("llama2", TINY_LLAMA2), ("llama3", TINY_LLAMA3)],  # llama3: GQA, rope theta 5e5, 3.1 scaling
)
def test_logits_match_transformers(family, params, checkpoints, tokenizer_path):
    llama = Llama.build(str(checkpoints[family, 1]), tokenizer_path, max_seq_len=64, max_batch_size=2)
    reference = hf_model(params, full_weights(params, VOCAB))
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(tokens).logits
    torch.testing.assert_close(llama.model.forward(tokens, 0), expected, atol=1e-4, rtol=0)


def test_scaled_rope_really_changes_the_model():
    """Guards the test above: with use_scaled_rope the rotary frequencies must differ."""
    from llama_tp.model.rotary import rotary_frequencies

    scaled = ModelArgs.from_dict(TINY_LLAMA3)
    plain = ModelArgs.from_dict({**TINY_LLAMA3, "use_scaled_rope": False})
    assert not torch.allclose(rotary_frequencies(scaled), rotary_frequencies(plain))
