"""Llama.build's speculation options: checked before any work, then the draft model loaded."""

from pathlib import Path
from typing import Optional

import torch

from ..args import ModelArgs
from ..checkpoint import load_model, open_checkpoint
from ..kernels import matmul
from ..logs import logger
from ..memory import GIB, plan
from ..kv_cache import MAX_KERNEL_STEP_TOKENS
from .. import parallel
from ..parallel import Placement
from ..quantize import QUANTIZATIONS
from .draft import Draft
from .rounds import Speculator

SPECULATE_MODES = ("draft", "lookup")

# Guesses a round by default, as tuned on the demo model (docs/speculative.md): an int8 copy of
# the target agrees with it almost always, lookup's guesses less often.
DEFAULT_K = {"draft": 6, "lookup": 6}

# A verifying pass of k + 1 tokens a row goes through our attention kernel up to this many.
MAX_K = MAX_KERNEL_STEP_TOKENS - 1


def check_speculation(speculate: Optional[str], speculate_k: Optional[int], draft_ckpt_dir: Optional[str],
                      draft_quantize: Optional[str], compile: bool) -> None:
    """Refuse a bad or inconsistent choice of speculation options, naming it and the fix."""
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
    if compile and speculate == "lookup":
        raise ValueError("compile=True compiles a draft model's steps, and speculate='lookup' has no draft: the "
                         "target's passes run eagerly with speculation; leave compile off")


def build_speculator(speculate: Optional[str], speculate_k: Optional[int], draft_ckpt_dir: Optional[str],
                     draft_quantize: Optional[str], compile: bool, ckpt_dir: Path, args: ModelArgs,
                     placement: Placement, dtype: torch.dtype, max_batch_size: int,
                     max_seq_len: int) -> Optional[Speculator]:
    """The speculator the checked options ask for, its draft (if any) loaded on this rank: the
    checkpoint in draft_ckpt_dir (by default the target's own, ckpt_dir) quantized as
    draft_quantize says, its one-token steps compiled with compile. args: the target's, with
    the tokenizer's vocabulary."""
    if speculate is None:
        return None
    k = DEFAULT_K[speculate] if speculate_k is None else speculate_k
    if speculate == "lookup":
        logger.info(f"Speculation: prompt lookup, {k} guesses a round")
        return Speculator("lookup", k)
    draft_dir = Path(draft_ckpt_dir) if draft_ckpt_dir is not None else Path(ckpt_dir)
    if not draft_dir.is_dir():
        raise FileNotFoundError(f"draft_ckpt_dir {draft_dir} does not exist; pass the folder that holds the "
                                "draft model's params.json and consolidated.XX.pth")
    description = (f"{draft_quantize} copy of the target" if draft_ckpt_dir is None
                   else f"{draft_dir}" + (f" as {draft_quantize}" if draft_quantize else ""))
    try:
        draft_args = ModelArgs.load(draft_dir / "params.json")
        if draft_args.vocab_size not in (-1, args.vocab_size):
            raise ValueError(f"its params.json says vocab_size {draft_args.vocab_size}")
        checkpoint = open_checkpoint(draft_dir, draft_args.with_vocab_size(args.vocab_size))
    except ValueError as error:
        raise ValueError(f"the draft model in {draft_dir} does not fit the target, whose tokenizer has "
                         f"{args.vocab_size} tokens: {error}. A draft must share the target's tokenizer") from None
    draft_args = checkpoint.args
    draft_args.check_model_parallel_size(placement.world_size)
    memory = plan(draft_args, placement.world_size, max_batch_size, max_seq_len, dtype,
                  draft_quantize or checkpoint.quantization)
    logger.info(f"Speculation: the draft ({description}, {k} guesses a round) adds "
                f"{memory.weight_bytes / GIB:.2f} GiB of weights and {memory.kv_cache_bytes / GIB:.2f} GiB of "
                "KV cache a process")
    model = load_model(draft_dir, draft_args, placement, dtype, draft_quantize,
                       pack=matmul.packing_pays(max_batch_size, False, dtype), opened=checkpoint)
    if compile:  # as generation.compile_decoding does for a target without speculation
        compilation = parallel.decode_compilation(placement.device)
        model.compile_decoding(compilation.graphs, **compilation.options)
    model.setup_caches(max_batch_size, max_seq_len, placement.device, dtype)
    return Speculator("draft", k, Draft(model, description))
