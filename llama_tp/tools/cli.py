"""Running a launch script: fire for the options, and user mistakes as one clear line per rank."""

import importlib
import os
import sys
from typing import Callable, NoReturn, Optional

import fire

from .. import parallel
from ..optional import MissingExtra, explained
from .help import help_text
from .options import OptionError, checked_command_line, wants_help

# What a user can get wrong surfaces as one of these; anything else is our bug and keeps its traceback.
USER_ERRORS = (ValueError, FileNotFoundError)


class JobEnded(Exception):
    """The job cannot go on for a cause outside its command line, which the message names (a
    server's HTTP process lost): it ends as a user's mistake does, with the message alone."""

# The shell's convention for a process ended by SIGINT (128 + 2).
INTERRUPTED_EXIT_CODE = 130
# The shell's convention for a command line that was used wrongly, as argparse and fire exit.
USAGE_EXIT_CODE = 2


def run(main: Callable, passes_on: Optional[Callable] = None, program: Optional[str] = None) -> None:
    """fire.Fire(main), turning a user mistake, Ctrl-C or a lost peer into a short message and a
    non-zero exit on every rank; LLAMA_TP_DEBUG=1 keeps the traceback. The command line is checked
    first, before anything loads; passes_on is the function main hands its **options to; program,
    what --help calls the command (default: the script's path)."""
    debug = os.environ.get("LLAMA_TP_DEBUG") == "1"
    if wants_help(sys.argv[1:]):
        if parallel.global_rank() == 0:
            print(help_text(main, program or sys.argv[0], passes_on))
        sys.exit(0)
    try:
        command = checked_command_line(main, sys.argv[1:], passes_on)
    except OptionError as error:
        _exit(str(error), USAGE_EXIT_CODE, wait_for_others=True)
    try:
        fire.Fire(main, command=command)
        parallel.leave()
    except (*USER_ERRORS, JobEnded) as error:
        if debug:
            raise
        _exit(str(error), 1, wait_for_others=True)
    except MissingExtra as error:  # it names the feature and the extra to install (optional.py)
        if debug:
            raise
        _exit(str(error), 1, wait_for_others=True)
    except ModuleNotFoundError as error:
        _exit_if_extra_missing(error, os.path.basename(sys.argv[0]))
    except KeyboardInterrupt:
        if debug:
            raise
        _exit("interrupted (Ctrl-C)", INTERRUPTED_EXIT_CODE, kind="stopped")
    except RuntimeError as error:
        if debug or not parallel.is_peer_failure(error):
            raise
        _exit(parallel.describe_peer_failure(error), 1, wait_for_others=True)


def run_tool(module: str, command: str) -> None:
    """run(main) of a `python -m llama_tp.X` tool, imported here: one that needs an extra that is
    not installed stops with the one line that names it, not with a traceback."""
    try:
        main = importlib.import_module(module).main
    except ModuleNotFoundError as error:
        _exit_if_extra_missing(error, command)
    run(main, program=command)


def _exit_if_extra_missing(error: ModuleNotFoundError, command: str) -> None:
    """Exit naming the extra to install if error is an optional package's absence (optional.py);
    else (or with LLAMA_TP_DEBUG=1) raise it again, with its traceback."""
    missing = explained(error, command)
    if missing is None or os.environ.get("LLAMA_TP_DEBUG") == "1":
        raise error
    _exit(str(missing), 1, wait_for_others=True)


def _exit(message: str, code: int, kind: str = "error", wait_for_others: bool = False) -> NoReturn:
    parallel.report_failure(f"llama_tp {kind} on rank {parallel.global_rank()}: {message}")
    # Waiting for the others, so that torchrun cuts no rank off before it has printed its message.
    if wait_for_others and not parallel.leave():
        # A rank is gone, and the process group stays: the interpreter's teardown of its gloo
        # threads could abort this process (SIGABRT, "terminate called without an active
        # exception") after the message. It has nothing else to do: end here.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)

