"""Meta's Llama 4 layout written as its tools write it, from a transformers Llama 4 text model:
params.json with moe_args, eight consolidated.XX.pth shards of fused tensors (wqkv, fc1_weight,
every expert of a layer in one tensor) with TransformerEngine's io.BytesIO extra states beside
them, and a tiktoken tokenizer.model of o200k's 200,000 ranks."""

import base64
import io
import json
from pathlib import Path

import torch

from tiny_checkpoint import SHARED_DATA

LLAMA3_TOKENIZER = SHARED_DATA / "llama3-tokenizer.model"
BPE_RANKS = 200_000
VOCAB = BPE_RANKS + 2048  # the ranks, then Llama 4's special tokens

# Meta's params.json keys for a tiny Llama 4 (dim / n_heads heads of 8), nested under "model" as
# some copies are: experts of 256 (Meta's MoE rule: 2/3 of 4 * dim, times 1.2, halved for the
# shared expert, rounded up to 64) every second layer, dense layers of 448 between.
PARAMS = {"model": {
    "dim": 128, "n_layers": 4, "n_heads": 16, "n_kv_heads": 8, "vocab_size": VOCAB, "multiple_of": 64,
    "ffn_dim_multiplier": 1.2, "ffn_exp": 4.0, "norm_eps": 1e-5, "rope_theta": 500000.0, "use_scaled_rope": True,
    "rope_scaling_factor": 16.0, "rope_high_freq_factor": 1.0, "nope_layer_interval": 4, "use_qk_norm": True,
    "attn_temperature_tuning": True, "floor_scale": 4, "attn_scale": 0.1, "attention_chunk_size": 8,
    "moe_args": {"num_experts": 4, "capacity_factor": 1.0, "auto_scale_F": True, "top_k": 1,
                 "interleave_moe_layer_step": 2},
    "vision_args": {"image_size": {"height": 28, "width": 28}, "patch_size": {"height": 14, "width": 14}, "dim": 32,
                    "n_layers": 1, "n_heads": 2, "mlp_ratio": 4.0, "output_dim": 32, "pixel_shuffle_ratio": 0.5},
    "max_batch_size": 32, "max_seq_len": 2048,
}}
# The same model as transformers' config keys.
HF_CONFIG = dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=8, intermediate_size=256, intermediate_size_mlp=448, rms_norm_eps=1e-5, num_local_experts=4,
                 interleave_moe_layer_step=2, attention_chunk_size=8, floor_scale=4, attn_scale=0.1,
                 rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "high_freq_factor": 1.0,
                                  "low_freq_factor": 1.0, "original_max_position_embeddings": 8192})


def tokenizer_file(path: Path) -> Path:
    """A tiktoken file of 200,000 ranks: Llama 3's 128,000, then tokens no text can reach (byte 0xff
    is never UTF-8), so that Llama 4's special tokens take their real ids from 200,000."""
    lines = LLAMA3_TOKENIZER.read_bytes().splitlines()
    filler = [base64.b64encode(b"\xff" + rank.to_bytes(3, "big")) + b" %d" % rank for rank in range(len(lines), BPE_RANKS)]
    path.write_bytes(b"\n".join(lines + filler) + b"\n")
    return path


def write_meta_llama4(folder: Path, model: torch.nn.Module, n_shards: int = 8) -> Path:
    """model's weights (a Llama4ForCausalLM) as Meta's n_shards Llama 4 shards, with params.json
    and tokenizer.model."""
    folder.mkdir(parents=True)
    (folder / "params.json").write_text(json.dumps(PARAMS))
    tokenizer_file(folder / "tokenizer.model")
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    config = model.config
    for rank in range(n_shards):
        def part(tensor: torch.Tensor, dim: int) -> torch.Tensor:
            return tensor.chunk(n_shards, dim=dim)[rank]

        shard = {"tok_embeddings.weight": part(state["model.embed_tokens.weight"], 0),
                 "output.weight": part(state["lm_head.weight"], 0), "norm.weight": state["model.norm.weight"],
                 "rope.freqs": torch.ones(config.head_dim // 2),
                 # the vision tower's, which llama_tp leaves out
                 "vision_projection.weight": part(torch.ones(config.hidden_size, 32), 0),
                 "vision_embeddings.vision_encoder.conv1._linear.weight": torch.ones(32, 588)}
        for layer in range(config.num_hidden_layers):
            hf, meta = f"model.layers.{layer}.", f"layers.{layer}."
            qkv = [part(state[hf + f"self_attn.{p}_proj.weight"], 0) for p in "qkv"]
            shard |= {meta + "attention.wqkv.weight": torch.cat(qkv),
                      meta + "attention.wqkv.layer_norm_weight": state[hf + "input_layernorm.weight"],
                      meta + "attention.wo.weight": part(state[hf + "self_attn.o_proj.weight"], 1),
                      meta + "attention.wqkv._extra_state": io.BytesIO(b"TransformerEngine fp8 metadata"),
                      meta + "attention.wo._extra_state": io.BytesIO(b"")}
            ffn = hf + "feed_forward."
            if layer in config.moe_layers:
                gate, up = state[ffn + "experts.gate_up_proj"].chunk(2, dim=2)  # experts, dim, hidden
                experts = len(gate)
                shard |= {
                    meta + "feed_forward.norm.weight": state[hf + "post_attention_layernorm.weight"],
                    meta + "feed_forward.router_DE": state[ffn + "router.weight"].T.contiguous(),
                    meta + "feed_forward.experts.moe_w_in_eD_F": part(gate, 2).reshape(experts * config.hidden_size, -1),
                    meta + "feed_forward.experts.moe_w_swiglu_eD_F": part(up, 2).reshape(experts * config.hidden_size, -1),
                    meta + "feed_forward.experts.moe_w_out_eF_D": part(state[ffn + "experts.down_proj"], 1).reshape(
                        -1, config.hidden_size),
                    meta + "feed_forward.w_in_shared_FD.weight": part(state[ffn + "shared_expert.gate_proj.weight"], 0),
                    meta + "feed_forward.w_swiglu_FD.weight": part(state[ffn + "shared_expert.up_proj.weight"], 0),
                    meta + "feed_forward.w_out_shared_DF.weight": part(state[ffn + "shared_expert.down_proj.weight"], 1),
                    meta + "feed_forward.expert_activation_DE": torch.zeros(config.hidden_size, experts),
                    meta + "feed_forward.experts.mlp._extra_state": io.BytesIO(b"\x00\x01"),
                }
            else:
                shard |= {
                    meta + "feed_forward.mlp.layer_norm_weight": state[hf + "post_attention_layernorm.weight"],
                    meta + "feed_forward.mlp.fc1_weight": torch.cat([part(state[ffn + "gate_proj.weight"], 0),
                                                                     part(state[ffn + "up_proj.weight"], 0)]),
                    meta + "feed_forward.mlp.fc2_weight": part(state[ffn + "down_proj.weight"], 1),
                }
        shard = {name: value.to(torch.bfloat16).clone() if isinstance(value, torch.Tensor) else value
                 for name, value in shard.items()}
        torch.save(shard, folder / f"consolidated.{rank:02d}.pth")
    return folder
