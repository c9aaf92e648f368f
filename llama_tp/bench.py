"""`python -m llama_tp.bench`: see llama_tp/tools/bench.py."""

from .tools.cli import run_tool

if __name__ == "__main__":
    run_tool("llama_tp.tools.bench", "python -m llama_tp.bench")
