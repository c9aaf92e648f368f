"""`python -m llama_tp.bench_serve`: see llama_tp/tools/bench_serve.py."""

from .tools.cli import run_tool

if __name__ == "__main__":
    run_tool("llama_tp.tools.bench_serve", "python -m llama_tp.bench_serve")
