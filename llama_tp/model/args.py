"""The model architecture, read from a checkpoint's params.json."""

import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Optional


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

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

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
            and self.ffn_hidden_dim % model_parallel_size == 0
            and (self.vocab_size == -1 or self.vocab_size % model_parallel_size == 0)
        )

    def check_model_parallel_size(self, model_parallel_size: int) -> None:
        if not self.splits_over(model_parallel_size):
            working = [n for n in range(1, self.n_heads + 1) if self.splits_over(n)]
            raise ValueError(
                f"this model cannot be split over {model_parallel_size} processes "
                f"({self.n_heads} query heads, {self.kv_heads} KV heads, ffn size "
                f"{self.ffn_hidden_dim}, vocabulary {self.vocab_size}); world sizes that work: "
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
        for key in ("head_size", "sliding_window"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ValueError(f"{source}: {key} must be positive or null, found {getattr(self, key)}")
        if self.use_scaled_rope and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ValueError(f"{source}: rope_high_freq_factor {self.rope_high_freq_factor} must exceed "
                             f"rope_low_freq_factor {self.rope_low_freq_factor}")


def _check_type(key: str, value, annotation, source: str) -> None:
    expected = {
        int: (int,), float: (int, float), bool: (bool,),
        Optional[int]: (int, type(None)), Optional[float]: (int, float, type(None)),
    }[annotation]
    # JSON true/false are Python bools, which are also ints: never accept them as numbers.
    if isinstance(value, bool) and bool not in expected or not isinstance(value, expected):
        wanted = " or ".join("null" if t is type(None) else t.__name__ for t in expected)
        raise ValueError(f"{source}: {key} must be {wanted}, found {value!r}")

