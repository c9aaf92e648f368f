"""`python -m llama_tp.run_batch -i requests.jsonl -o results.jsonl`: see llama_tp/tools/run_batch.py."""

from .tools.cli import run_tool

if __name__ == "__main__":
    run_tool("llama_tp.tools.run_batch", "python -m llama_tp.run_batch")
