"""Optional dependencies, imported where their feature is used: `import llama_tp` and Meta's API need
only the core requirements. A missing one is a MissingExtra naming the extra that installs it
(EXTRAS; pyproject.toml's optional-dependencies, by the names they import as).
"""

import importlib
from pathlib import Path
from types import ModuleType
from typing import Optional

EXTRAS = {
    # importing Hugging Face and GGUF weights, the demo model, tokenizer.json tokenizers
    "convert": ("safetensors", "gguf", "tokenizers"),
    # the server, run_batch, structured outputs, the serving benchmarks (pydantic and starlette come with fastapi)
    "serve": ("fastapi", "uvicorn", "prometheus_client", "httpx", "xgrammar", "pydantic", "starlette"),
    # the benchmark's llama.cpp side
    "llamacpp": ("llama_cpp",),
}
# What else installing an extra takes, said after its command.
INSTALL_NOTES = {"llamacpp": "; pip builds llama.cpp from its sources, which takes a few minutes and needs cmake "
                             "and a C++ compiler"}
# The folder holding pyproject.toml, where llama_tp runs from a checkout (as the README installs it).
PROJECT = Path(__file__).resolve().parents[1]


class MissingExtra(ModuleNotFoundError):
    """A feature's optional package is not installed; the message says which extra installs it."""


def install_command(extra: str) -> str:
    """The command that installs extra into this environment."""
    if (PROJECT / "pyproject.toml").is_file():
        # fairscale ships only as source, whose isolated build would fetch a torch of its own
        return f'pip install --no-build-isolation -e "{PROJECT}[{extra}]"'
    return f'pip install "llama-tp[{extra}]"'


def missing(package: str, feature: str, extra: str) -> MissingExtra:
    return MissingExtra(f"{feature} needs the {package!r} package (the {extra!r} extra), which is not "
                        f"installed; run: {install_command(extra)}{INSTALL_NOTES.get(extra, '')}", name=package)


def require(module: str, feature: str) -> ModuleType:
    """Import module (of a package in EXTRAS), which feature needs, or raise MissingExtra naming its extra."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        friendly = explained(error, feature)
        if friendly is None:  # not an extra's package: one of its own dependencies, say
            raise
        raise friendly from None


def require_all(packages: tuple[str, ...], feature: str) -> None:
    """Import every one of packages (of EXTRAS) or raise MissingExtra, before feature starts any work."""
    for package in packages:
        require(package, feature)


def explained(error: ModuleNotFoundError, feature: str) -> Optional[MissingExtra]:
    """A MissingExtra for feature if the module error could not find belongs to an extra, else None."""
    package = (error.name or "").split(".")[0]
    extra = extra_of(package)
    return missing(package, feature, extra) if extra else None


def extra_of(package: str) -> Optional[str]:
    return next((extra for extra, packages in EXTRAS.items() if package in packages), None)
