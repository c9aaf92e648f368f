"""`python -m llama_tp.convert`: see llama_tp/tools/convert/."""

from .tools.cli import run
from .tools.convert.__main__ import main

if __name__ == "__main__":
    run(main)
