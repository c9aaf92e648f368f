"""`python -m llama_tp.plan`: see llama_tp/tools/plan.py."""

from .tools.cli import run
from .tools.plan import main

if __name__ == "__main__":
    run(main)
