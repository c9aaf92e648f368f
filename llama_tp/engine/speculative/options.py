"""Speculation's options (the mode, guesses a round, the draft's): checked before any work; the
speculator they make once the draft, if any, is loaded (checkpoint/draft.py loads it)."""

from typing import Optional

from ...model.kv_cache import MAX_KERNEL_STEP_TOKENS
from ...logs import logger
from ...model.transformer import Transformer
from ...model.quantize import QUANTIZATIONS
from .draft import Draft
from .rounds import Speculator

SPECULATE_MODES = ("draft", "lookup")

# Guesses a round by default, as tuned on the demo model (docs/speculative.md): an int8 copy of
# the target agrees with it almost always, lookup's guesses less often.
DEFAULT_K = {"draft": 6, "lookup": 6}

# A verifying pass of k + 1 tokens a row goes through our attention kernel up to this many.
MAX_K = MAX_KERNEL_STEP_TOKENS - 1


def check_speculation(speculate: Optional[str], speculate_k: Optional[int], draft_ckpt_dir: Optional[str],
                      draft_quantize: Optional[str], compile: bool, compiles_target: bool = False) -> None:
    """Refuse a bad or inconsistent choice of speculation options, naming it and the fix.
    compiles_target: compile=True compiles the target's steps too (whole, as CUDA graphs)."""
    if speculate is None:
        for name, value in (("draft_ckpt_dir", draft_ckpt_dir), ("draft_quantize", draft_quantize),
                            ("speculate_k", speculate_k)):
            if value is not None:
                raise ValueError(f"{name}={value!r} is given without speculation; add speculate='draft' "
                                 f"(or speculate='lookup' for speculate_k alone), or leave {name} out")
        return
    if speculate not in SPECULATE_MODES:
        raise ValueError(f"speculate={speculate!r} is not supported; use 'draft' (a draft model guesses) or "
                         "'lookup' (guesses copied from the prompt and the output so far), or leave it unset")
    if speculate == "lookup" and (draft_ckpt_dir is not None or draft_quantize is not None):
        raise ValueError("draft_ckpt_dir and draft_quantize describe a draft model, which speculate='lookup' "
                         "does not use; use speculate='draft' or leave them out")
    if speculate == "draft" and draft_ckpt_dir is None and draft_quantize is None:
        raise ValueError("speculate='draft' needs a draft: draft_quantize='int8' (the target itself, quantized) "
                         "or draft_ckpt_dir=DIR (a smaller checkpoint with the same tokenizer), or both")
    if draft_quantize is not None and draft_quantize not in QUANTIZATIONS:
        raise ValueError(f"draft_quantize={draft_quantize!r} is not supported; use one of "
                         f"{', '.join(QUANTIZATIONS)}, or leave it unset for a full-precision draft_ckpt_dir")
    if speculate_k is not None and (not isinstance(speculate_k, int) or isinstance(speculate_k, bool)
                                    or not 1 <= speculate_k <= MAX_K):
        raise ValueError(f"speculate_k must be a whole number of guesses from 1 to {MAX_K}, found {speculate_k!r}")
    if compile and speculate == "lookup" and not compiles_target:
        raise ValueError("compile=True compiles a draft model's steps, and speculate='lookup' has no draft: here "
                         "(no CUDA graphs) the target's passes run eagerly with speculation; leave compile off")


def guesses_a_round(speculate: str, speculate_k: Optional[int]) -> int:
    """speculate_k, or the mode's default."""
    return DEFAULT_K[speculate] if speculate_k is None else speculate_k


def make_speculator(speculate: Optional[str], k: int, draft: Optional[Transformer] = None,
                    description: str = "") -> Optional[Speculator]:
    """The speculator for checked options: prompt lookup, or the loaded draft model (description:
    what it is, for people); None without speculation."""
    if speculate is None:
        return None
    if speculate == "lookup":
        logger.info(f"Speculation: prompt lookup, {k} guesses a round")
        return Speculator("lookup", k)
    return Speculator("draft", k, Draft(draft, description))
