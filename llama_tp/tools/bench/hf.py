"""The Hugging Face transformers side of the benchmark: the same Meta-layout weights in LlamaForCausalLM."""

import torch

from ...model.args import ModelArgs

# Meta's module names -> transformers' names inside one decoder layer.
LAYER_NAMES = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def to_rotate_half(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder wq/wk rows from Meta's interleaved rotary pairs (2i, 2i+1) to transformers' halves (i, i + d/2).

    The inverse of the permute in transformers' convert_llama_weights_to_hf.
    """
    rows, cols = weight.shape
    # heads, pairs, 2, cols -> heads, 2, pairs, cols: all first members of the pairs, then all second
    return weight.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def hf_state_dict(weights: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Unsharded Meta-layout weights renamed (and wq/wk reordered) for LlamaForCausalLM."""
    state = {
        "model.embed_tokens.weight": weights["tok_embeddings.weight"],
        "model.norm.weight": weights["norm.weight"],
        "lm_head.weight": weights["output.weight"],
    }
    for i in range(args.n_layers):
        for meta, hf in LAYER_NAMES.items():
            tensor = weights[f"layers.{i}.{meta}.weight"]
            if meta == "attention.wq":
                tensor = to_rotate_half(tensor, args.n_heads)
            elif meta == "attention.wk":
                tensor = to_rotate_half(tensor, args.kv_heads)
            state[f"model.layers.{i}.{hf}.weight"] = tensor
    return state


def hf_config(args: ModelArgs, max_seq_len: int):
    """The LlamaConfig describing the same architecture as args."""
    from transformers import LlamaConfig

    twists = [key for key in ("head_size", "qkv_bias", "qk_norm", "sliding_window") if getattr(args, key)]
    if twists:
        raise ValueError(f"the transformers comparison builds Meta's Llama, and this model has {', '.join(twists)} "
                         "in its params.json; compare it with --compare llamacpp, or without --compare")
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.use_scaled_rope:
        rope |= {
            "rope_type": "llama3", "factor": args.rope_scaling_factor, "low_freq_factor": args.rope_low_freq_factor,
            "high_freq_factor": args.rope_high_freq_factor,
            "original_max_position_embeddings": args.rope_original_context,
        }
    return LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.ffn_hidden_dim,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
        num_key_value_heads=args.kv_heads, rms_norm_eps=args.norm_eps, rope_parameters=rope,
        max_position_embeddings=max_seq_len, tie_word_embeddings=False,
        attn_implementation="sdpa", bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )


def build_hf_model(weights: dict[str, torch.Tensor], args: ModelArgs, max_seq_len: int,
                   dtype: torch.dtype) -> torch.nn.Module:
    """LlamaForCausalLM holding the given unsharded Meta-layout weights, in dtype, in eval mode."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config(args, max_seq_len))
    state = {name: tensor.to(dtype) for name, tensor in hf_state_dict(weights, args).items()}
    model.load_state_dict(state, strict=True, assign=True)
    # Buffers (the rotary inverse frequencies) were made on the meta device: make them again for real.
    rotary = type(model.model.rotary_emb)(config=model.config)
    model.model.rotary_emb = rotary
    return model.eval()


@torch.inference_mode()
def hf_generate(model: torch.nn.Module, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy continuation of prompts [bsz, seqlen] by exactly new_tokens tokens: [bsz, new_tokens]."""
    prompts = prompts.to(model.device)
    out = model.generate(
        prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
        min_new_tokens=new_tokens, do_sample=False, num_beams=1,
    )
    return out[:, prompts.shape[1]:].cpu()
