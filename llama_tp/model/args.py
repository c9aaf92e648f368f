"""The model architecture, read from a checkpoint's params.json."""

import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Optional

from .meta_llama4 import is_llama4_params, llama4_params


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int  # query heads, all ranks together
    n_kv_heads: Optional[int] = None  # None: as many as query heads (no grouped-query attention)
    vocab_size: int = -1  # Llama 2 ships -1: the tokenizer decides
    multiple_of: int = 256  # the SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    use_scaled_rope: bool = False  # Llama 3.1's long-context rescaling of rotary frequencies
    rope_scaling_factor: float = 8.0  # 8 for Llama 3.1, 32 for Llama 3.2
    rope_high_freq_factor: float = 4.0
    rope_low_freq_factor: float = 1.0  # Llama 3.1's ramp runs between these two factors ...
    rope_original_context: int = 8192  # ... of the context it was first trained for
    # The close cousins' twists; the defaults are Meta's Llama, so its params.json files load as ever.
    head_size: Optional[int] = None  # None: dim // n_heads; Qwen3 names its own (128 at dim 1024 and 16 heads)
    qkv_bias: bool = False  # Qwen2: wq, wk and wv add a bias
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's queries and keys, before rotation
    # Mistral 7B v0.1: a token sees only itself and the sliding_window - 1 positions before it.
    sliding_window: Optional[int] = None
    # Mixture of experts (Mixtral, Qwen3-MoE, Llama 4): in its layers the feed-forward is n_experts
    # SwiGLUs of expert_hidden_dim, of which a router picks experts_per_token for each token.
    n_experts: Optional[int] = None  # None: a dense model
    experts_per_token: int = 1  # top-k
    expert_hidden_dim: Optional[int] = None
    moe_layer_interval: int = 1  # every n-th layer (counting from 1) has experts, the others ffn_hidden_dim's SwiGLU
    router_scoring: str = "softmax"  # over every expert, then top-k (Mixtral, Qwen3); "sigmoid" of each top-k logit (Llama 4)
    normalize_expert_weights: bool = False  # the top-k softmax weights rescaled to sum to 1 (Mixtral; Qwen3's norm_topk_prob)
    expert_weights_on_input: bool = False  # Llama 4: a token's weight scales what enters the expert, not what leaves it
    shared_expert: bool = False  # Llama 4: one more SwiGLU of expert_hidden_dim that every token goes through
    # Llama 4's attention: every nope_layer_interval-th layer (counting from 1) has no rotary
    # embedding and no q/k norm, attends to every earlier position, and scales its queries by
    # 1 + attn_scale * log(1 + floor((position + 1) / floor_scale)) (attn_temperature_tuning); the
    # others RMS-normalise queries and keys without a weight (weightless_qk_norm) and attend within
    # their own chunk of attention_chunk_size positions.
    nope_layer_interval: Optional[int] = None
    attention_chunk_size: Optional[int] = None
    weightless_qk_norm: bool = False
    attn_temperature_tuning: bool = False
    floor_scale: float = 8192.0
    attn_scale: float = 0.1

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

    def has_experts(self, layer: int) -> bool:
        """Whether layer `layer` (from 0) has a mixture of experts as its feed-forward."""
        return self.n_experts is not None and (layer + 1) % self.moe_layer_interval == 0

    @property
    def dense_layers(self) -> int:
        """How many layers have the plain SwiGLU of ffn_hidden_dim."""
        return sum(not self.has_experts(layer) for layer in range(self.n_layers))

    def rotates(self, layer: int) -> bool:
        """Whether layer `layer` (from 0) has rotary embeddings: all but Llama 4's NoPE layers."""
        return self.nope_layer_interval is None or (layer + 1) % self.nope_layer_interval != 0

    @property
    def ffn_hidden_dim(self) -> int:
        """Meta's rule: two thirds of 4*dim, times the multiplier, rounded up to multiple_of."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    @classmethod
    def from_dict(cls, params: dict, source: str = "params.json") -> "ModelArgs":
        """Validate every key and type; a mistake names the key, the value and the file."""
        known = {f.name: f for f in fields(cls)}
        for key in params:
            if key not in known:
                raise ValueError(
                    f"{source}: unknown key {key!r}; the keys llama_tp understands are "
                    f"{', '.join(sorted(known))}"
                )
        for key in ("dim", "n_layers", "n_heads"):
            if key not in params:
                raise ValueError(f"{source}: required key {key!r} is missing")
        for key, value in params.items():
            _check_type(key, value, known[key].type, source)
        args = cls(**params)
        args._check_consistency(source)
        return args

    @classmethod
    def load(cls, path: Path) -> "ModelArgs":
        path = Path(path)
        if not path.parent.is_dir():
            raise FileNotFoundError(
                f"checkpoint directory {path.parent} does not exist; pass --ckpt_dir with the "
                "folder that holds params.json and consolidated.XX.pth"
            )
        if not any(path.parent.iterdir()):
            raise FileNotFoundError(
                f"checkpoint directory {path.parent} is empty; pass --ckpt_dir with the folder "
                "that holds params.json and consolidated.XX.pth"
            )
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} does not exist; a Meta-layout checkpoint folder holds params.json "
                "beside its consolidated.XX.pth shards"
            )
        try:
            params = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{path} is not valid JSON ({error}); fix or replace the file") from None
        if not isinstance(params, dict):
            raise ValueError(f"{path} must hold a JSON object, found {type(params).__name__}")
        if is_llama4_params(params):
            params = llama4_params(params, str(path))
        return cls.from_dict(params, source=str(path))

    def with_vocab_size(self, tokenizer_vocab_size: int, padded: bool = False) -> "ModelArgs":
        """Fill in Llama 2's vocab_size -1 from the tokenizer; refuse a disagreement.

        padded: a vocabulary larger than the tokenizer's is fine, as Hugging Face models (Qwen's)
        pad their embedding with rows no token uses."""
        if self.vocab_size == -1:
            return replace(self, vocab_size=tokenizer_vocab_size)
        if self.vocab_size != tokenizer_vocab_size and not (padded and self.vocab_size > tokenizer_vocab_size):
            raise ValueError(
                f"params.json says vocab_size {self.vocab_size} but the tokenizer has "
                f"{tokenizer_vocab_size} tokens; use the tokenizer that came with this checkpoint"
            )
        return self

    def splits_over(self, model_parallel_size: int) -> bool:
        """Whether every split dimension divides into model_parallel_size equal slices."""
        kv_fits = self.kv_heads % model_parallel_size == 0 or model_parallel_size % self.kv_heads == 0
        return (
            self.n_heads % model_parallel_size == 0
            and kv_fits
            and (self.dense_layers == 0 or self.ffn_hidden_dim % model_parallel_size == 0)
            and (self.n_experts is None or self.expert_hidden_dim % model_parallel_size == 0)
            and (self.vocab_size == -1 or self.vocab_size % model_parallel_size == 0)
        )

    def describe_splits(self) -> str:
        """The sizes that world sizes must divide, for messages."""
        experts = f", expert size {self.expert_hidden_dim}" if self.n_experts is not None else ""
        return (f"{self.n_heads} query heads, {self.kv_heads} KV heads, ffn size {self.ffn_hidden_dim}{experts}, "
                f"vocabulary {self.vocab_size}")

    def check_model_parallel_size(self, model_parallel_size: int) -> None:
        if not self.splits_over(model_parallel_size):
            working = [n for n in range(1, self.n_heads + 1) if self.splits_over(n)]
            raise ValueError(
                f"this model cannot be split over {model_parallel_size} processes "
                f"({self.describe_splits()}); world sizes that work: "
                f"{', '.join(map(str, working))}"
            )

    def _check_consistency(self, source: str) -> None:
        for key in ("dim", "n_layers", "n_heads", "multiple_of"):
            if getattr(self, key) < 1:
                raise ValueError(f"{source}: {key} must be positive, found {getattr(self, key)}")
        if self.head_size is None and self.dim % self.n_heads:
            raise ValueError(f"{source}: dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"{source}: head size {self.head_dim} must be even for rotary embeddings")
        if self.kv_heads < 1 or self.n_heads % self.kv_heads:
            raise ValueError(
                f"{source}: n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}"
            )
        if self.vocab_size == 0 or self.vocab_size < -1:
            raise ValueError(f"{source}: vocab_size must be positive or -1, found {self.vocab_size}")
        if self.norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError(f"{source}: norm_eps and rope_theta must be positive")
        for key in ("head_size", "sliding_window", "n_experts", "expert_hidden_dim", "nope_layer_interval",
                    "attention_chunk_size"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ValueError(f"{source}: {key} must be positive or null, found {getattr(self, key)}")
        # Llama 4 Scout's rescaling has equal factors: no ramp, each frequency kept or divided.
        if self.use_scaled_rope and self.rope_high_freq_factor < self.rope_low_freq_factor:
            raise ValueError(f"{source}: rope_high_freq_factor {self.rope_high_freq_factor} must not be below "
                             f"rope_low_freq_factor {self.rope_low_freq_factor}")
        self._check_experts(source)
        if self.qk_norm and self.weightless_qk_norm:
            raise ValueError(f"{source}: qk_norm (with weights, Qwen3's) and weightless_qk_norm (Llama 4's) "
                             "exclude each other; set one")
        if self.floor_scale <= 0:
            raise ValueError(f"{source}: floor_scale must be positive, found {self.floor_scale}")

    def _check_experts(self, source: str) -> None:
        if self.router_scoring not in ROUTER_SCORINGS:
            raise ValueError(f"{source}: router_scoring must be one of {', '.join(ROUTER_SCORINGS)}, "
                             f"found {self.router_scoring!r}")
        if self.moe_layer_interval < 1:
            raise ValueError(f"{source}: moe_layer_interval must be positive, found {self.moe_layer_interval}")
        if self.n_experts is None:
            return
        if self.expert_hidden_dim is None:
            raise ValueError(f"{source}: n_experts is {self.n_experts} but expert_hidden_dim is missing; "
                             "give each expert's hidden size")
        if not 1 <= self.experts_per_token <= self.n_experts:
            raise ValueError(f"{source}: experts_per_token must be 1 to n_experts ({self.n_experts}), "
                             f"found {self.experts_per_token}")


# How a router turns its logits into the chosen experts' weights (ModelArgs.router_scoring).
ROUTER_SCORINGS = ("softmax", "sigmoid")


def _check_type(key: str, value, annotation, source: str) -> None:
    expected = {
        int: (int,), float: (int, float), bool: (bool,), str: (str,),
        Optional[int]: (int, type(None)), Optional[float]: (int, float, type(None)),
    }[annotation]
    # JSON true/false are Python bools, which are also ints: never accept them as numbers.
    if isinstance(value, bool) and bool not in expected or not isinstance(value, expected):
        wanted = " or ".join("null" if t is type(None) else t.__name__ for t in expected)
        raise ValueError(f"{source}: {key} must be {wanted}, found {value!r}")

