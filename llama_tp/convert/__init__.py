"""Importing Llama-family weights into Meta's layout: Hugging Face folders and GGUF files.

    python -m llama_tp.convert hf SRC_DIR DST_DIR --mp N [--dtype bf16|fp16|fp32] [--quantize int8]
    python -m llama_tp.convert gguf FILE DST_DIR --mp N [--dtype ...] [--quantize int8]
"""

import importlib
from types import ModuleType

INSTALL_HINT = 'pip install "llama-tp[convert]" (or pip install -e ".[convert]" in a checkout)'


def require(module: str, purpose: str = "importing weights") -> ModuleType:
    """Import an optional dependency (of the converter and of tokenizer.json), or say how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ModuleNotFoundError(
            f"{purpose} needs the {module.split('.')[0]!r} package, which is not installed; "
            f"run: {INSTALL_HINT}"
        ) from None
