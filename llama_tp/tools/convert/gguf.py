"""GGUF (llama.cpp) files of the Llama family (llama, Mixtral as llama.cpp's llama, qwen2, qwen3,
qwen3moe) to Meta's layout: metadata to params.json, tensors dequantised, or kept as they are where
a quantized checkpoint can hold them (gguf_blocks.py). A mixture of experts' tensors hold every
expert of a layer, [experts, out, in]: each expert's slice becomes its own layer (feed_forward.py).

For the `llama` architecture llama.cpp's converter stores q/k in Meta's interleaved rotary layout
(it undoes Hugging Face's permutation), so tensors are only renamed; tests/test_demo_network.py
checks this against transformers' own GGUF loading. For qwen2, qwen3 and qwen3moe it keeps Hugging
Face's rotate-half order (llama.cpp rotates them "NEOX" style), which is undone here as `convert hf` does.
"""

import dataclasses
import re
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple, Optional

import numpy as np
import torch

from ...model.args import ModelArgs
from ...checkpoint.quantized import QuantizedWeight, tensor_quantization
from ...model.rotary import rotary_frequencies
from ...optional import require
from ...checkpoint.record import ModelRecord, check_sampling
from . import gguf_blocks, gguf_vocab
from .chat_template import END_OF_TURN, chat_format_of, default_system_prompt
from .hf import rotated_heads, unpermute
from .writer import TensorLoader, ffn_params, meta_name, progress, resolve_dtype, write_checkpoint

# Per layer, llama.cpp's tensor names to Meta's.
LAYER_NAMES = {
    "attn_q": "attention.wq", "attn_k": "attention.wk", "attn_v": "attention.wv",
    "attn_output": "attention.wo", "ffn_gate": "feed_forward.w1", "ffn_down": "feed_forward.w2",
    "ffn_up": "feed_forward.w3", "attn_norm": "attention_norm", "ffn_norm": "ffn_norm",
    "attn_q_norm": "attention.q_norm", "attn_k_norm": "attention.k_norm", "ffn_gate_inp": "feed_forward.router",
}
# A layer's experts, each [experts, out, in], by the projection each expert's slice is.
EXPERT_TENSORS = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}
# The architectures that convert, as llama.cpp names them, and what each adds to Meta's Llama.
ARCHITECTURES = {"llama": {}, "qwen2": {"qkv_bias": True}, "qwen3": {"qk_norm": True}, "qwen3moe": {"qk_norm": True}}
# Those whose q/k channels llama.cpp keeps in Hugging Face's rotate-half order.
ROTATE_HALF = ("qwen2", "qwen3", "qwen3moe")
TOP_NAMES = {"token_embd.weight": "tok_embeddings.weight", "output_norm.weight": "norm.weight",
             "output.weight": "output.weight"}
# Llama 3.1's rescaled rotary frequencies, stored by llama.cpp as a tensor of divisors.
ROPE_FREQS = "rope_freqs.weight"


def convert_gguf(source: str, dest: str, mp: int = 1, dtype: str = "fp32", quantize: Optional[str] = None,
                 sampling: Optional[dict] = None) -> Path:
    """Convert a GGUF Llama file into a Meta-layout checkpoint folder with mp shards.

    dtype defaults to fp32: dequantised values are exact only there. quantize="int8" or "int4"
    writes a quantized checkpoint (checkpoint/quantized.py): Q8_0 layers come into int8, Q4_0
    and Q4_1 ones into int4 as the file stores them; other layers are dequantised and rounded by
    llama_tp (which keeps weights from GGUF's 4- and 8-bit blocks in int8 to fp32's rounding),
    and a log line says which. The file's recommended sampling settings (general.sampling.*) are
    recorded; `sampling` adds to or overrides them, for a file that lacks its makers' recommendation.
    """
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist; pass the path of a .gguf file")
    progress(f"reading {path}")
    try:
        reader = require("gguf", "reading GGUF files").GGUFReader(str(path))
    except (ValueError, OSError) as error:
        raise ValueError(f"{path} is not a readable GGUF file ({error})") from None
    metadata = Metadata(reader, path)
    by_name = {tensor.name: tensor for tensor in reader.tensors}
    params = model_params(metadata, by_name)
    tensors = meta_tensors(by_name, path, quantize, params if metadata.arch in ROTATE_HALF else None)
    tokens = metadata.get("tokenizer.ggml.tokens")
    files, stop_tokens, template = tokenizer_files(metadata, tokens)
    chat_format = chat_format_of(template)
    if chat_format in END_OF_TURN and END_OF_TURN[chat_format] in tokens:
        stop_tokens.append(tokens.index(END_OF_TURN[chat_format]))
    system = default_system_prompt(template) if chat_format == "chatml" else None
    recommended = recommended_sampling(metadata) | (sampling or {})
    check_sampling(recommended, "the recommended sampling settings")
    record = ModelRecord(chat_format, system, tuple(stop_tokens), converted_from=path.name, sampling=recommended,
                         chat_template=template, context_length=context_length(metadata))
    return write_checkpoint(Path(dest), params, tensors, mp, resolve_dtype(dtype), files, record, quantize)


class Metadata:
    """The GGUF's key/value metadata, with errors that name the file and the key."""

    def __init__(self, reader, path: Path):
        self.fields, self.path = reader.fields, path
        self.arch = self.get("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"{path}: general.architecture is {self.arch!r}; the architectures that convert "
                             f"are {', '.join(ARCHITECTURES)} (see the README's table)")

    def get(self, key: str, default: Any = ...) -> Any:
        key = key.replace("{arch}", getattr(self, "arch", ""))
        if key not in self.fields:
            if default is ...:
                raise ValueError(f"{self.path} has no {key!r} metadata; is it a complete Llama GGUF?")
            return default
        return self.fields[key].contents()


def context_length(metadata: Metadata) -> Optional[int]:
    """The context the model was trained for, as the file says."""
    tokens = metadata.get("{arch}.context_length", None)
    return int(tokens) if tokens is not None else None


# llama.cpp's keys for the sampling settings a model's makers recommend, by our names. Its repeat
# penalty is the same rule as ours (CTRL's), over the last 64 tokens by default where ours takes
# the whole row.
SAMPLING_KEYS = {"temperature": "general.sampling.temp", "top_p": "general.sampling.top_p",
                 "top_k": "general.sampling.top_k", "repetition_penalty": "general.sampling.penalty_repeat"}


def recommended_sampling(metadata: Metadata) -> dict:
    """The general.sampling.* settings the file holds, by our names (float32 in the file: kept to
    their shortest decimal)."""
    found = {name: metadata.get(key, None) for name, key in SAMPLING_KEYS.items()}
    return {name: value if isinstance(value, int) else float(str(np.float32(value)))
            for name, value in found.items() if value is not None}


def model_params(metadata: Metadata, tensors: dict) -> dict:
    """params.json from the GGUF's metadata (the vocabulary size from its embedding)."""
    dim = metadata.get("{arch}.embedding_length")
    n_heads = metadata.get("{arch}.attention.head_count")
    n_kv_heads = metadata.get("{arch}.attention.head_count_kv", n_heads)
    if not isinstance(n_kv_heads, int):
        raise ValueError(f"{metadata.path}: per-layer KV head counts ({n_kv_heads!r}) are not supported")
    head_dim = metadata.get("{arch}.attention.key_length", dim // n_heads)
    if metadata.get("{arch}.attention.value_length", head_dim) != head_dim:
        raise ValueError(f"{metadata.path}: {metadata.arch}.attention.value_length differs from key_length "
                         f"({head_dim}); llama_tp needs keys and values of one head size")
    rope_dims = metadata.get("{arch}.rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise ValueError(f"{metadata.path}: rotary embedding over {rope_dims} of {head_dim} head "
                         "channels is not supported; llama_tp rotates whole heads")
    if metadata.get("{arch}.attention.sliding_window", 0):
        raise ValueError(f"{metadata.path}: {metadata.arch}.attention.sliding_window is set: a sliding window does "
                         "not convert from GGUF; convert the model's Hugging Face folder with `convert hf`")
    scaling = metadata.get("{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"{metadata.path}: rope scaling {scaling!r} is not supported")
    params = {
        "dim": dim,
        "n_layers": metadata.get("{arch}.block_count"),
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),  # GGUF lists dims fastest first
        **ffn_params(dim, metadata.get("{arch}.feed_forward_length")),
        # float32 in the file: keep its shortest decimal (1e-05, not 9.999999747378752e-06).
        "norm_eps": float(str(np.float32(metadata.get("{arch}.attention.layer_norm_rms_epsilon")))),
        "rope_theta": float(str(np.float32(metadata.get("{arch}.rope.freq_base", 10000.0)))),
        **({"head_size": head_dim} if head_dim * n_heads != dim else {}),
        **ARCHITECTURES[metadata.arch],
        **expert_params(metadata),
    }
    if ROPE_FREQS in tensors:
        params |= llama31_rope(ModelArgs.from_dict(params), dequantized(tensors[ROPE_FREQS]), metadata.path)
    return params


def expert_params(metadata: Metadata) -> dict:
    """params.json's mixture-of-experts keys, routed as llama.cpp routes Mixtral and Qwen3-MoE: the
    top-k of a softmax over every expert, rescaled to sum to 1."""
    experts = metadata.get("{arch}.expert_count", 0)
    if not experts:
        return {}
    hidden = metadata.get("{arch}.expert_feed_forward_length", None) or metadata.get("{arch}.feed_forward_length")
    return {"n_experts": experts, "experts_per_token": metadata.get("{arch}.expert_used_count"),
            "expert_hidden_dim": hidden, "normalize_expert_weights": True}


def llama31_rope(args: ModelArgs, divisors: torch.Tensor, path: Path) -> dict:
    """ModelArgs' Llama 3.1 rope settings that reproduce the file's frequency divisors, or ValueError."""
    settings = {"use_scaled_rope": True, "rope_scaling_factor": float(divisors.max()), "rope_high_freq_factor": 4.0}
    scaled = dataclasses.replace(args, **settings)
    if not torch.allclose(rotary_frequencies(args) / rotary_frequencies(scaled), divisors, rtol=1e-4):
        raise ValueError(f"{path}: its {ROPE_FREQS} is not Llama 3.1's rope scaling with factor "
                         f"{settings['rope_scaling_factor']}; this rope scaling is not supported")
    return settings


def meta_tensors(by_name: dict, path: Path, quantize: Optional[str] = None,
                 rotate_half: Optional[dict] = None) -> dict[str, TensorLoader]:
    """A loader per Meta tensor name; tied embeddings become an explicit output.weight. Under a
    quantize, linear layers whose GGUF type that quantization holds are loaded as they are stored.
    rotate_half: the params of a model whose q/k channels are in rotate-half order, to undo it."""
    sources = {}
    for name, tensor in by_name.items():
        if name == ROPE_FREQS:
            continue  # folded into params.json
        experts = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
        if experts and experts.group(2) in EXPERT_TENSORS:
            projection = EXPERT_TENSORS[experts.group(2)]
            for expert in range(int(tensor.shape[2])):  # GGUF lists dimensions fastest first
                sources[f"layers.{experts.group(1)}.feed_forward.experts.{expert}.{projection}.weight"] = \
                    ExpertSlice.of(tensor, expert)
            continue
        target = meta_name(name, TOP_NAMES, r"blk\.(\d+)\.(\w+)\.(weight|bias)", LAYER_NAMES)
        if target is None:
            raise ValueError(f"{path} holds tensor {name!r}, which has no place in a Llama model")
        sources[target] = tensor
    sources.setdefault("output.weight", sources["tok_embeddings.weight"])
    rounded: Counter = Counter()  # (quantization, GGUF type) of the linear layers rounded here
    loaders = {}
    for target, tensor in sources.items():
        kind = tensor_quantization(target, quantize)
        heads = rotated_heads(target, rotate_half) if rotate_half else None
        if kind and gguf_blocks.kept(tensor.tensor_type.name, kind):
            loaders[target] = lambda tensor=tensor, heads=heads: _in_meta_order(gguf_blocks.quantized_weight(tensor), heads)
            continue
        if kind:
            rounded[kind, tensor.tensor_type.name] += 1
        loaders[target] = lambda tensor=tensor, heads=heads: _in_meta_order(dequantized(tensor), heads)
    if rounded:
        kept = "; ".join(f"{kind}: {', '.join(types)}" for kind, types in gguf_blocks.KEPT_TYPES.items())
        layers = ", ".join(f"{count} {gguf_type} layers to {kind}" for (kind, gguf_type), count in sorted(rounded.items()))
        progress(f"dequantised and rounded by llama_tp (kernels/int4.py, int8.py), their GGUF types not being "
                 f"kept as they are ({kept}): {layers}")
    return loaders


class ExpertSlice(NamedTuple):
    """One expert's part of a GGUF tensor of a layer's experts, read as a tensor of its own (only
    its rows are dequantised or kept, not every expert's)."""

    name: str
    tensor_type: Any
    shape: tuple[int, int]  # fastest first, as GGUF lists them
    data: np.ndarray

    @classmethod
    def of(cls, tensor, expert: int) -> "ExpertSlice":
        return cls(f"{tensor.name}[{expert}]", tensor.tensor_type, tuple(int(n) for n in tensor.shape[:2]),
                   tensor.data[expert])


def _in_meta_order(tensor: "torch.Tensor | QuantizedWeight", heads: Optional[int]) -> "torch.Tensor | QuantizedWeight":
    """tensor with its rows of `heads` rotating heads in Meta's interleaved order (None: as it is)."""
    if heads is None:
        return tensor
    if isinstance(tensor, QuantizedWeight):  # each row's blocks move with it
        return tensor._replace(tensors={name: unpermute(part, heads) for name, part in tensor.tensors.items()})
    return unpermute(tensor, heads)


def dequantized(tensor) -> torch.Tensor:
    """A GGUF tensor as fp32, in PyTorch's dimension order (GGUF lists dimensions fastest first)."""
    quants = require("gguf.quants", "reading GGUF files")
    try:
        values = quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(f"tensor {tensor.name} is stored as {tensor.tensor_type.name}, which the gguf "
                         "package cannot dequantise; upgrade gguf or use another quantisation") from None
    shape = tuple(int(n) for n in reversed(tensor.shape))
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))


def tokenizer_files(metadata: Metadata, tokens: list[str]) -> tuple[dict[str, bytes], list[int], Optional[str]]:
    """tokenizer.json and tokenizer_config.json from the embedded vocabulary, eos, and the chat template."""
    model = metadata.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise ValueError(f"{metadata.path}: its {model!r} vocabulary is not supported, only byte-level BPE "
                         "('gpt2') and SentencePiece's ('llama'); convert the model's Hugging Face folder with "
                         "`convert hf` instead")
    special_ids = {
        f"{role}_token": metadata.get(f"tokenizer.ggml.{key}_token_id", None)
        for role, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown"))
    }
    template = metadata.get("tokenizer.chat_template", None)
    token_types = metadata.get("tokenizer.ggml.token_type")
    if model == "llama":  # SentencePiece's: Llama 2, Mistral, Mixtral, which begin with their bos
        add_bos = metadata.get("tokenizer.ggml.add_bos_token", True)
        vocabulary = gguf_vocab.sentencepiece_tokenizer_json(tokens, metadata.get("tokenizer.ggml.scores"), token_types,
                                                             metadata.get("tokenizer.ggml.add_space_prefix", True))
    else:
        add_bos = metadata.get("tokenizer.ggml.add_bos_token", False)
        vocabulary = gguf_vocab.tokenizer_json(tokens, metadata.get("tokenizer.ggml.merges"), token_types,
                                               metadata.get("tokenizer.ggml.pre", "default"))
    files = {
        "tokenizer.json": vocabulary,
        "tokenizer_config.json": gguf_vocab.tokenizer_config_json(tokens, special_ids, add_bos, template),
    }
    eos = special_ids["eos_token"]
    return files, [] if eos is None else [eos], template
