"""How the next token is chosen: the options one answer samples with, checked."""

from dataclasses import dataclass
from typing import Optional

import torch

# The ranges past which an option stops meaning what it says: the sampler takes 1 / temperature
# and the penalty in fp32, where 1 / 1e308 is 0 (greedy) and a penalty of 1e-300 is 0 (every
# repeated token infinitely likely). Past 100, a temperature flattens every distribution alike.
MAX_TEMPERATURE = 100.0
REPETITION_PENALTY_RANGE = (0.01, 100.0)


@dataclass(frozen=True)
class SamplingOptions:
    """How the next token is chosen; the defaults are Meta's reference behaviour."""

    temperature: float = 0.6  # 0 is greedy
    top_p: float = 0.9
    top_k: Optional[int] = None  # None or 0: no top-k cut
    repetition_penalty: float = 1.0  # 1: none; >1 discourages tokens already in the row (CTRL's rule)
    min_p: float = 0.0  # 0: none; else tokens less likely than min_p times the best one are cut
    min_gen_len: int = 0  # stop tokens are impossible before this many tokens are generated
    seed: Optional[int] = None  # None: the global generator seeded by Llama.build

    def check(self) -> None:
        """Raise ValueError naming the first option out of range."""
        for name in ("temperature", "top_p", "repetition_penalty", "min_p"):
            value = getattr(self, name)
            # fire hands over whatever the user typed, e.g. the str 'hot'
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"{name} must be a number, found {value!r}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0: greedy), found {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], found {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1) (0 for no cut, e.g. 0.05), found {self.min_p}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            raise ValueError(f"top_k must be a positive integer (or 0/None for no cut), found {self.top_k!r}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise ValueError(
                f"repetition_penalty must be in [{low:g}, {high:g}] (1 for none, e.g. 1.2 to discourage "
                f"repeats), found {self.repetition_penalty}"
            )
        if not isinstance(self.min_gen_len, int) or self.min_gen_len < 0:
            raise ValueError(f"min_gen_len must be a non-negative integer, found {self.min_gen_len!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, found {self.seed!r}")

    @property
    def greedy(self) -> bool:
        """Whether the best token (after any penalty) is chosen: a temperature that rounds to 0 in
        the logits' fp32, as choose_next decides."""
        return self.temperature < torch.finfo(torch.float32).tiny

    @property
    def takes_best_logit(self) -> bool:
        """Whether the next token is simply the model's best logit: greedy, with no repetition
        penalty and no minimum length."""
        return self.greedy and self.repetition_penalty == 1.0 and not self.min_gen_len

    def generator(self, device: torch.device) -> Optional[torch.Generator]:
        """A private random generator for a per-call seed, or None for the global one."""
        if self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


def check_given(**settings) -> None:
    """Refuse a bad value among the settings given; None is one left to the model's or Meta's default."""
    SamplingOptions(**{name: value for name, value in settings.items() if value is not None}).check()
