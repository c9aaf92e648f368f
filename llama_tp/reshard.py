"""`python -m llama_tp.reshard`: see llama_tp/tools/reshard.py."""

from .tools.cli import run_tool

if __name__ == "__main__":
    run_tool("llama_tp.tools.reshard", "python -m llama_tp.reshard")
