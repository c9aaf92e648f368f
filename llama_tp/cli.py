"""Running a launch script: fire for the options, and user mistakes as one clear line per rank."""

import os
import sys
from typing import Callable

import fire

from . import parallel

# What a user can get wrong surfaces as one of these; anything else is our bug and keeps its traceback.
USER_ERRORS = (ValueError, FileNotFoundError)


def run(main: Callable) -> None:
    """fire.Fire(main), turning a user mistake into a message and exit code 1 on every rank."""
    try:
        fire.Fire(main)
    except USER_ERRORS as error:
        if os.environ.get("LLAMA_TP_DEBUG") == "1":
            raise
        print(f"llama_tp error on rank {parallel.global_rank()}: {error}", file=sys.stderr, flush=True)
        sys.exit(1)
