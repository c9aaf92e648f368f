"""Logits processors from Python (Llama.generate's logits_processors; transformers' logits_processor,
vLLM's logits_processors): callables that change a row's logits before its next token is chosen.

A processor takes the tokens generated so far and the row's logits [vocab] (fp32, the whole
vocabulary), or the prompt's tokens first, then those two, as vLLM's do, and returns the logits
to choose from (the same tensor changed in place, or a new one). The engine calls them on
model-parallel rank 0 only, each row's in turn, and the other ranks take rank 0's choice: a
processor may keep state or draw random numbers without the ranks parting ways.
"""

import inspect
from typing import Callable, Sequence

import torch

Processor = Callable[..., torch.Tensor]


def check_processors(processors) -> tuple[Processor, ...]:
    """processors as a tuple, each a callable of two or three positional arguments; else ValueError."""
    if processors is None:
        return ()
    if callable(processors) or not isinstance(processors, (list, tuple)):
        raise ValueError(f"logits_processors must be a list of callables, found {processors!r}")
    for index, processor in enumerate(processors):
        if not callable(processor):
            raise ValueError(f"logits_processors[{index}] must be a callable (token ids, logits) -> logits, found "
                             f"{processor!r}")
        if _arguments(processor) not in (2, 3):
            raise ValueError(f"logits_processors[{index}] must take (generated token ids, logits) or (prompt token "
                             f"ids, generated token ids, logits), found {processor!r} of another signature")
    return tuple(processors)


def _arguments(processor: Processor) -> int:
    """How many positional arguments processor takes (2 where its signature cannot be read)."""
    try:
        parameters = inspect.signature(processor).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return 2
    if any(parameter.kind is parameter.VAR_POSITIONAL for parameter in parameters):
        return 2
    return sum(parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)
               and parameter.default is parameter.empty for parameter in parameters)


def apply_processors(logits: torch.Tensor, rows: Sequence[tuple[Sequence[Processor], Sequence[int], Sequence[int]]]
                     ) -> torch.Tensor:
    """logits [rows, vocab] with each row's processors applied in turn: rows[i] is row i's
    (processors, prompt tokens, tokens generated so far), handed to them as copies (a processor
    may keep them). Rows without processors, and a batch without any, are left as they are."""
    if not any(processors for processors, _, _ in rows):
        return logits
    logits = logits.clone()
    for row, (processors, prompt, tokens) in enumerate(rows):
        values = logits[row]
        for processor in processors:
            arguments = (list(prompt), list(tokens), values) if _arguments(processor) == 3 else (list(tokens), values)
            values = processor(*arguments)
            if not isinstance(values, torch.Tensor) or values.shape != logits[row].shape:
                shape = tuple(getattr(values, "shape", ()))
                raise ValueError(f"a logits processor returned {type(values).__name__} {shape}, not the logits' "
                                 f"shape {tuple(logits[row].shape)}")
        logits[row] = values
    return logits
