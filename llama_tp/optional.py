"""Optional dependencies (the `convert` extra: safetensors, gguf, tokenizers): imported when
needed, with the command that installs them when they are missing."""

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
