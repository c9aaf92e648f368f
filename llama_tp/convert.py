"""`python -m llama_tp.convert`: see llama_tp/tools/convert/."""

from .tools.cli import run_tool

if __name__ == "__main__":
    run_tool("llama_tp.tools.convert.__main__", "python -m llama_tp.convert")
