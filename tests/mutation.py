"""Mutation testing of one module against the fast tests that exercise it (CONTRIBUTING.md).

    python tests/mutation.py llama_tp/model/prefix_cache.py tests/test_prefix_cache.py [more test files]

mutmut reads one configuration (pyproject.toml's [tool.mutmut], which makes the mutants of every
scored module once); this runs the module's mutants only, against the given test files only, so
that a run takes minutes rather than the whole fast set once per mutant. `python -m mutmut
results` lists what survived.
"""

import dataclasses
import os
import sys

# One thread per test process: mutmut forks its workers from a process whose tests have already
# started torch's thread pool, and a pool used again after a fork can hang until the timeout,
# which made every surviving mutant of a module with large-tensor tests take minutes.
os.environ["OMP_NUM_THREADS"] = "1"

from mutmut import configuration
from mutmut.__main__ import cli


def main(module: str, *tests: str) -> None:
    if not module.endswith(".py") or not tests:
        raise SystemExit(__doc__)
    load = configuration._load_config

    def narrowed() -> configuration.Config:
        return dataclasses.replace(load(), pytest_add_cli_args_test_selection=[
            "-m", "not slow", "-p", "no:cacheprovider", *tests])

    configuration._load_config = narrowed
    configuration.reset_config()
    name = module.removesuffix(".py").replace("/", ".")
    cli(["run", f"{name}*"])


if __name__ == "__main__":
    main(*sys.argv[1:])
