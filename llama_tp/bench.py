"""`python -m llama_tp.bench`: see llama_tp/tools/bench.py."""

from .tools.cli import run
from .tools.bench import main

if __name__ == "__main__":
    run(main)
