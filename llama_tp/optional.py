"""Optional dependencies (the `convert` extra: safetensors, gguf, tokenizers; the `llamacpp` extra
for the benchmark): imported when needed, with the command that installs them when they are missing."""

import importlib
from types import ModuleType

INSTALL_HINT = 'pip install "llama-tp[convert]" (or pip install -e ".[convert]" in a checkout)'


def require(module: str, purpose: str = "importing weights", install: str = INSTALL_HINT) -> ModuleType:
    """Import an optional dependency (by default of the converter and of tokenizer.json), or say
    how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ModuleNotFoundError(
            f"{purpose} needs the {module.split('.')[0]!r} package, which is not installed; "
            f"run: {install}"
        ) from None
