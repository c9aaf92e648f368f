"""`python -m llama_tp.plan`: see llama_tp/tools/plan.py."""

from .tools.cli import run_tool

if __name__ == "__main__":
    run_tool("llama_tp.tools.plan", "python -m llama_tp.plan")
