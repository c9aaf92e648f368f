"""`python -m llama_tp.reshard`: see llama_tp/tools/reshard.py."""

from .tools.cli import run
from .tools.reshard import main

if __name__ == "__main__":
    run(main)
