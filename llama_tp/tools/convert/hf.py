"""Hugging Face Llama folders (config.json, *.safetensors, tokenizer files) to Meta's layout."""

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
    "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
    "mlp.up_proj": "feed_forward.w3", "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}
TOP_NAMES = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
             "lm_head.weight": "output.weight"}
TORCH_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
# Llama 3.1's rope scaling, as llama_tp implements it (ModelArgs.use_scaled_rope).
LLAMA31_ROPE = {"low_freq_factor": 1.0, "original_max_position_embeddings": 8192}


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
    record = ModelRecord(chat_format, system, tuple(stop_tokens), converted_from=src.name, sampling=sampling)
    return write_checkpoint(Path(dest), params, tensors, mp, resolve_dtype(dtype), files, record, quantize)


def model_params(config: dict, src: Path) -> dict:
    """params.json for a Hugging Face LlamaConfig; refuses what llama_tp's model does not compute."""
    where = src / "config.json"
    if config.get("model_type") != "llama":
        raise ValueError(f"{where}: model_type {config.get('model_type')!r} is not 'llama'; only "
                         "Llama-architecture models convert")
    for key, expected in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if config.get(key, expected) != expected:
            raise ValueError(f"{where}: {key} is {config[key]!r}; llama_tp's Llama needs {expected!r}")
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    if config.get("head_dim", dim // n_heads) != dim // n_heads:
        raise ValueError(f"{where}: head_dim {config['head_dim']} is not hidden_size / num_attention_heads "
                         f"({dim // n_heads}); llama_tp does not support that")
    # transformers 5 nests rope settings in rope_parameters; 4.x has rope_theta and rope_scaling.
    rope = {"rope_theta": config.get("rope_theta", 10000.0), **(config.get("rope_scaling") or {}),
            **(config.get("rope_parameters") or {})}
    params = {
        "dim": dim,
        "n_layers": config["num_hidden_layers"],
        "n_heads": n_heads,
        "n_kv_heads": config.get("num_key_value_heads", n_heads),
        "vocab_size": config["vocab_size"],
        **ffn_params(dim, config["intermediate_size"]),
        "norm_eps": config.get("rms_norm_eps", 1e-6),
        "rope_theta": float(rope["rope_theta"]),
    }
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "llama3" and all(rope.get(k) == v for k, v in LLAMA31_ROPE.items()):
        params |= {"use_scaled_rope": True, "rope_scaling_factor": float(rope["factor"]),
                   "rope_high_freq_factor": float(rope["high_freq_factor"])}
    elif rope_type != "default":
        raise ValueError(f"{where}: rope scaling {rope!r} is not supported; llama_tp knows plain rotary "
                         f"embeddings and Llama 3.1's ({LLAMA31_ROPE})")
    return params


def unpermute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Hugging Face's rotate-half row order of wq/wk back to Meta's interleaved channel pairs."""
    rows, cols = weight.shape
    halves = weight.view(n_heads, 2, rows // n_heads // 2, cols)  # heads, (first, second half), pairs, dim
    return halves.transpose(1, 2).reshape(rows, cols)


def meta_tensors(src: Path, params: dict, tie: bool) -> dict[str, TensorLoader]:
    """A lazy loader per Meta tensor name, reading safetensors files only when called."""
    safe_open = require("safetensors").safe_open
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {src}; llama_tp converts safetensors weights "
                                "(re-save the model with save_pretrained(..., safe_serialization=True))")
    loaders = {}
    for file in files:
        handle = safe_open(str(file), framework="pt")
        for name in handle.keys():
            target = meta_name(name, TOP_NAMES, r"model\.layers\.(\d+)\.(\w+\.\w+|\w+)\.weight", LAYER_NAMES)
            if target is None:
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # older exports store the rotary table, which the model recomputes
                raise ValueError(f"{file} holds tensor {name!r}, which has no place in a Llama model")
            if target in loaders:
                raise ValueError(f"{name} appears in two files of {src}; remove the stale safetensors file")
            heads = {"wq": params["n_heads"], "wk": params["n_kv_heads"]}.get(target.split(".")[-2])
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
