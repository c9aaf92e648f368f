"""`python -m llama_tp.bench_serve`: see llama_tp/tools/bench_serve.py."""

from .tools.cli import run
from .tools.bench_serve import main

if __name__ == "__main__":
    run(main)
