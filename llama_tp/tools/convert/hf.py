"""Hugging Face folders of the Llama family (config.json, *.safetensors, tokenizer files) to Meta's layout."""

from pathlib import Path
from typing import Optional

import torch

from ...optional import require
from ...checkpoint.record import SAMPLING_SETTINGS, ModelRecord, check_sampling
from ...text.hf_tokenizer import HFTokenizer, read_json_object
from .chat_template import END_OF_TURN, chat_format_of, default_system_prompt
from .writer import TensorLoader, ffn_params, meta_name, resolve_dtype, write_checkpoint

# Per layer, Hugging Face's module names to Meta's.
LAYER_NAMES = {
    "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk",
    "self_attn.q_norm": "attention.q_norm", "self_attn.k_norm": "attention.k_norm",
    "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
    "mlp.up_proj": "feed_forward.w3", "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}
TOP_NAMES = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
             "lm_head.weight": "output.weight"}
TORCH_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
# The model_types that convert: Meta's Llama with switches (ModelArgs) for its cousins' twists.
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
# Config keys of what llama_tp does not compute, refused when set, with what they mean.
UNSUPPORTED_KEYS = {
    "num_experts": "mixture of experts", "num_local_experts": "mixture of experts",
    "n_routed_experts": "mixture of experts", "vision_config": "a vision tower",
    "audio_config": "an audio tower", "attn_logit_softcapping": "attention logit soft-capping",
    "final_logit_softcapping": "logit soft-capping",
}


def convert_hf(source: str, dest: str, mp: int = 1, dtype: Optional[str] = None,
               quantize: Optional[str] = None) -> Path:
    """Convert a Hugging Face Llama folder into a Meta-layout checkpoint folder with mp shards.

    dtype defaults to the precision config.json names (bf16 if it names none); quantize="int8"
    or "int4" writes a quantized checkpoint (checkpoint/quantized.py). The sampling settings
    generation_config.json recommends (temperature, top_p, top_k, repetition_penalty) are recorded
    in llama_tp.json.
    """
    src = Path(source)
    config = _read_json(src / "config.json", required=True)
    params = model_params(config, src)
    dtype = dtype or TORCH_DTYPES.get(config.get("dtype") or config.get("torch_dtype"), "bf16")
    tensors = meta_tensors(src, params, tie=config.get("tie_word_embeddings", False))
    files, tokenizer = tokenizer_files(src)
    template = chat_template(src)
    chat_format = chat_format_of(template)
    generation = _read_json(src / "generation_config.json")
    stop_tokens = _as_list(generation.get("eos_token_id", config.get("eos_token_id")))
    if isinstance(tokenizer, HFTokenizer) and chat_format in END_OF_TURN:
        stop_tokens.append(tokenizer.special_id(END_OF_TURN[chat_format]))
    system = default_system_prompt(template) if chat_format == "chatml" else None
    sampling = {name: generation[name] for name in SAMPLING_SETTINGS if generation.get(name) is not None}
    check_sampling(sampling, str(src / "generation_config.json"))
    record = ModelRecord(chat_format, system, tuple(stop_tokens), converted_from=src.name, sampling=sampling,
                         chat_template=template, context_length=config.get("max_position_embeddings"))
    return write_checkpoint(Path(dest), params, tensors, mp, resolve_dtype(dtype), files, record, quantize)


def model_params(config: dict, src: Path) -> dict:
    """params.json for a Hugging Face config of the Llama family (ARCHITECTURES); refuses, naming the
    config key, what llama_tp's model does not compute."""
    where = src / "config.json"
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"{where}: model_type {model_type!r} does not convert; llama_tp runs "
                         f"{', '.join(ARCHITECTURES)} (see the README's table of architectures)")
    for key in UNSUPPORTED_KEYS:
        if config.get(key):
            raise ValueError(f"{where}: {key} is {config[key]!r}: {UNSUPPORTED_KEYS[key]} is not supported; "
                             f"llama_tp runs dense decoder-only {model_type} models")
    for key, expected in (("hidden_act", "silu"), ("mlp_bias", False), ("partial_rotary_factor", 1.0)):
        if config.get(key, expected) != expected:
            raise ValueError(f"{where}: {key} is {config[key]!r}; llama_tp's {model_type} needs {expected!r}")
    # Llama and Qwen3 name a bias on all four projections attention_bias; Qwen2 always has q/k/v biases.
    if config.get("attention_bias"):
        raise ValueError(f"{where}: attention_bias is true (a bias on wo too); llama_tp has biases on "
                         "q, k and v only (Qwen2's)")
    # One kind of attention in every layer: Mistral's window everywhere, or none.
    windowed = model_type == "mistral" and bool(config.get("sliding_window"))
    one_kind = {"sliding_attention" if windowed else "full_attention"}
    attention_kinds = set(config.get("layer_types") or one_kind)
    if config.get("use_sliding_window") and model_type != "mistral" or attention_kinds != one_kind:
        raise ValueError(f"{where}: layer_types {sorted(attention_kinds)} (use_sliding_window "
                         f"{config.get('use_sliding_window')!r}) mixes attention kinds; llama_tp runs one "
                         "kind in every layer")
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or dim // n_heads
    # transformers 5 nests rope settings in rope_parameters; 4.x has rope_theta and rope_scaling.
    rope = {"rope_theta": config.get("rope_theta") or 10000.0, **(config.get("rope_scaling") or {}),
            **(config.get("rope_parameters") or {})}
    params = {
        "dim": dim,
        "n_layers": config["num_hidden_layers"],
        "n_heads": n_heads,
        "n_kv_heads": config.get("num_key_value_heads") or n_heads,
        "vocab_size": config["vocab_size"],
        **ffn_params(dim, config["intermediate_size"]),
        "norm_eps": config.get("rms_norm_eps", 1e-6),
        "rope_theta": float(rope["rope_theta"]),
        **({"head_size": head_dim} if head_dim * n_heads != dim else {}),
        **({"qkv_bias": True} if model_type == "qwen2" else {}),
        **({"qk_norm": True} if model_type == "qwen3" else {}),
        **({"sliding_window": config["sliding_window"]} if windowed else {}),
    }
    return params | rope_params(rope, where)


def rope_params(rope: dict, where: Path) -> dict:
    """ModelArgs' rope scaling for a config's rope settings: none, or Llama 3.1's (as Llama 3.2 too)."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return {}
    if rope_type != "llama3":
        raise ValueError(f"{where}: rope_scaling {rope!r} is not supported; llama_tp knows plain rotary "
                         "embeddings and Llama 3.1's (rope_type 'llama3')")
    return {"use_scaled_rope": True, "rope_scaling_factor": float(rope["factor"]),
            "rope_high_freq_factor": float(rope["high_freq_factor"]),
            "rope_low_freq_factor": float(rope["low_freq_factor"]),
            "rope_original_context": int(rope["original_max_position_embeddings"])}


def unpermute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Hugging Face's rotate-half row order of wq/wk (weight or bias; or q_norm/k_norm, one head)
    back to Meta's interleaved channel pairs."""
    rows = weight.shape[0]
    halves = weight.view(n_heads, 2, rows // n_heads // 2, -1)  # heads, (first, second half), pairs, dim or 1
    return halves.transpose(1, 2).reshape(weight.shape)


def rotated_heads(target: str, params: dict) -> Optional[int]:
    """How many heads tensor `target` holds whose channels rotate (unpermute), or None if none do."""
    module = target.split(".")[-2]
    return {"wq": params["n_heads"], "wk": params["n_kv_heads"], "q_norm": 1, "k_norm": 1}.get(module)


def meta_tensors(src: Path, params: dict, tie: bool) -> dict[str, TensorLoader]:
    """A lazy loader per Meta tensor name, reading safetensors files only when called."""
    safe_open = require("safetensors", "reading Hugging Face weights").safe_open
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {src}; llama_tp converts safetensors weights "
                                "(re-save the model with save_pretrained(..., safe_serialization=True))")
    loaders = {}
    for file in files:
        handle = safe_open(str(file), framework="pt")
        for name in handle.keys():
            target = meta_name(name, TOP_NAMES, r"model\.layers\.(\d+)\.(\w+\.\w+|\w+)\.(weight|bias)", LAYER_NAMES)
            if target is None:
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # older exports store the rotary table, which the model recomputes
                raise ValueError(f"{file} holds tensor {name!r}, which has no place in a Llama model")
            if target in loaders:
                raise ValueError(f"{name} appears in two files of {src}; remove the stale safetensors file")
            heads = rotated_heads(target, params)
            loaders[target] = lambda handle=handle, name=name, heads=heads: _load(handle, name, heads)
    if tie:  # Hugging Face saves tied weights once; Meta's layout has an explicit output matrix
        loaders["output.weight"] = loaders["tok_embeddings.weight"]
    return loaders


def _load(handle, name: str, heads: Optional[int]) -> torch.Tensor:
    tensor = handle.get_tensor(name)
    return tensor if heads is None else unpermute(tensor, heads)


def tokenizer_files(src: Path) -> tuple[dict[str, bytes], object]:
    """The tokenizer files to copy (tokenizer.json with its config, else tokenizer.model) and the tokenizer."""
    if (src / "tokenizer.json").is_file():
        names = [n for n in ("tokenizer.json", "tokenizer_config.json") if (src / n).is_file()]
        return {n: (src / n).read_bytes() for n in names}, HFTokenizer(str(src / "tokenizer.json"))
    if (src / "tokenizer.model").is_file():
        return {"tokenizer.model": (src / "tokenizer.model").read_bytes()}, None
    raise FileNotFoundError(f"no tokenizer.json or tokenizer.model in {src}; copy the model's tokenizer "
                            "files into the folder before converting")


def chat_template(src: Path) -> Optional[str]:
    """The chat template, from chat_template.jinja (transformers 5) or tokenizer_config.json."""
    if (src / "chat_template.jinja").is_file():
        return (src / "chat_template.jinja").read_text()
    template = _read_json(src / "tokenizer_config.json").get("chat_template")
    return template if isinstance(template, str) else None


def _as_list(value) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def _read_json(path: Path, required: bool = False) -> dict:
    if required and not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; pass the Hugging Face model folder "
                                "that holds config.json and the *.safetensors weights")
    return read_json_object(path)
