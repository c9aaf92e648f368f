"""Running code as it runs where llama_tp was installed with its core requirements alone
(`pip install -e .`): every package that only the extras bring is made unimportable.

    python tests/without_extras.py [--keep EXTRA]... SCRIPT [ARGS...]
    python tests/without_extras.py [--keep EXTRA]... -m MODULE [ARGS...]

Which packages those are is read from the installed llama-tp's own metadata: the distributions
the extras require, with all they require in turn, less those the core requirements bring too.
"""

import importlib.abc
import importlib.machinery
import importlib.metadata
import runpy
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PROJECT = "llama-tp"


def requirements_closure(requirements: list[Requirement]) -> set[str]:
    """The distributions these requirements bring in, with everything they require, as installed here."""
    found: set[str] = set()
    pending = list(requirements)
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        if name in found or name == PROJECT:
            continue
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:  # an extra not installed here (llamacpp)
            continue
        found.add(name)
        for text in requires:
            nested = Requirement(text)
            if nested.marker is None or nested.marker.evaluate({"extra": ""}):
                pending.append(nested)
    return found


def extras_only_distributions(kept: tuple[str, ...] = ()) -> set[str]:
    """The distributions that only llama-tp's extras (other than those kept) install."""
    core, extras = [], []
    for text in importlib.metadata.requires(PROJECT) or []:
        requirement = Requirement(text)
        if requirement.marker is None:
            core.append(requirement)
        elif not any(requirement.marker.evaluate({"extra": extra}) for extra in kept):
            extras.append(requirement)
    # an extra naming llama-tp[other extras] (test does): their requirements are the extras' too
    return requirements_closure(extras) - requirements_closure(core)


def extras_only_modules(kept: tuple[str, ...] = ()) -> set[str]:
    """Top-level modules that only llama-tp's extras (other than those kept) install."""
    optional = extras_only_distributions(kept)
    return {module for module, distributions in importlib.metadata.packages_distributions().items()
            if any(canonicalize_name(d) in optional for d in distributions)}


class Hiding(importlib.abc.MetaPathFinder):
    """The import system's path finder, blind to the files of the hidden distributions: to the
    import statement and to importlib.util.find_spec alike, their modules are not installed.
    (A copy that a core package vendors, as setuptools does packaging, is still found.)"""

    def __init__(self, distributions: set[str]):
        self.modules = {module for module, names in importlib.metadata.packages_distributions().items()
                        if any(canonicalize_name(name) in distributions for name in names)}
        self.files = {str(Path(distribution.locate_file(file)).resolve())
                      for name in distributions for distribution in [importlib.metadata.distribution(name)]
                      for file in distribution.files or []}

    def find_spec(self, fullname, path=None, target=None):
        if path is not None or fullname not in self.modules:
            return importlib.machinery.PathFinder.find_spec(fullname, path, target)
        for entry in sys.path:  # a top-level hidden name: the first copy that is not the hidden one's
            spec = importlib.machinery.PathFinder.find_spec(fullname, [entry], target)
            if spec is not None and str(Path(spec.origin or "").resolve()) not in self.files:
                return spec
        return None

    def invalidate_caches(self):
        importlib.machinery.PathFinder.invalidate_caches()


def main(argv: list[str]) -> None:
    kept = []
    while argv[:1] == ["--keep"]:
        kept.append(argv[1])
        argv = argv[2:]
    hiding = Hiding(extras_only_distributions(tuple(kept)))
    sys.meta_path[:] = [hiding if finder is importlib.machinery.PathFinder else finder for finder in sys.meta_path]
    for name in [name for name in sys.modules if name.split(".")[0] in hiding.modules]:  # this helper's own (packaging)
        del sys.modules[name]
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
