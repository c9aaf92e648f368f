"""`python -m llama_tp.run_batch -i requests.jsonl -o results.jsonl`: see llama_tp/tools/run_batch.py."""

from .tools.cli import run
from .tools.run_batch import main

if __name__ == "__main__":
    run(main)
