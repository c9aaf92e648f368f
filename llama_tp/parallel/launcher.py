"""`llama-tp`: torchrun, with a job's failure told in one line per rank, in rank order.

    llama-tp --nproc_per_node 2 launch/chat_completion.py --ckpt_dir DIR --tokenizer_path FILE
    llama-tp --version

It takes torchrun's options and starts the ranks through torch.distributed.run's own API, as
`vllm serve` fronts its workers; the scripts run unchanged under plain torchrun too. What differs
is what a failing job prints: each rank hands its one line (watchdog.report_failure) to this
launcher instead of printing it, and the launcher prints them, rank by rank, once the ranks have
ended; a rank that died without one (a crash, a signal) gets a line saying how it ended. Nothing
of torchrun's own is printed (its ChildFailedError traceback, its warnings, a busy port's
DistNetworkError traceback, Ctrl-C's SignalException), unless LLAMA_TP_DEBUG=1.
"""

import logging
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import NoReturn, Optional

from .. import __version__
from .watchdog import FAILURE_LINES

# The shell's convention for a process ended by SIGINT (128 + 2), as the scripts exit on Ctrl-C.
INTERRUPTED_EXIT_CODE = 130


def main(argv: Optional[list[str]] = None) -> None:
    """Run torchrun's command line; exit as the job did, its failure in one line per rank."""
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["--version"], ["-V"]):
        print(f"llama-tp {__version__}")
        return
    import torch
    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    parser = get_args_parser()
    parser.prog, parser.description = "llama-tp", f"torchrun for llama_tp's scripts (llama-tp {__version__}, torch " \
                                                  f"{torch.__version__}): the same options, failures in one line per rank"
    args = parser.parse_args(argv)
    debug = os.environ.get("LLAMA_TP_DEBUG") == "1"
    if not debug:
        _quiet_torchrun()
    with tempfile.TemporaryDirectory(prefix="llama_tp_lines_") as lines:
        os.environ[FAILURE_LINES] = lines  # the ranks inherit it
        try:
            run(args)
        except ChildFailedError as error:
            if debug:
                raise
            _exit(Path(lines), {rank: failure.exitcode for rank, failure in error.failures.items()},
                  _job_exit_code(list(error.failures.values())))
        except SignalException as error:  # Ctrl-C or SIGTERM: torchrun has stopped the ranks
            if debug:
                raise
            _exit(Path(lines), {}, INTERRUPTED_EXIT_CODE if error.sigval == signal.SIGINT else 128 + error.sigval)
        except DistNetworkError as error:  # the rendezvous could not listen or connect
            if debug:
                raise
            print(f"llama_tp error: torchrun could not open or reach the rendezvous at {args.master_addr}:"
                  f"{args.master_port} ({str(error).strip().splitlines()[0]}); pass --master_port with a free port "
                  "(or leave it out on one machine: a free one is chosen)", file=sys.stderr)
            sys.exit(1)


def _exit(lines: Path, exit_codes: dict[int, int], code: int) -> NoReturn:
    """Print each rank's line in rank order, and a line for each failed rank that left none."""
    said = {int(path.name): path.read_text() for path in lines.iterdir()}
    for rank, exit_code in exit_codes.items():
        if rank not in said:
            said[rank] = f"llama_tp error on rank {rank}: {_ending(exit_code)}"
    for rank in sorted(said):
        print(said[rank], file=sys.stderr, flush=True)
    sys.exit(code)


def _job_exit_code(failures: list) -> int:
    """The code of the rank that exited first of its own accord (a usage error's 2 on every rank,
    say), not that of a rank torchrun stopped after it (a signal's negative code), whichever
    torchrun saw end first; 1 where every failed rank was killed."""
    exited = [failure for failure in failures if failure.exitcode > 0]
    return min(exited, key=lambda failure: failure.timestamp).exitcode if exited else 1


def _ending(exit_code: int) -> str:
    if exit_code < 0:
        return f"killed by {signal.Signals(-exit_code).name} (see its output above)"
    return f"exited with code {exit_code} (see its output above)"


def _quiet_torchrun() -> None:
    """Drop torchrun's own log lines (its thread-count banner, which rank it stopped, its failure
    summary): the ranks' lines say what happened."""

    def keep(record: logging.LogRecord) -> bool:
        return not record.name.startswith(("torch.distributed.elastic", "torch.distributed.run",
                                           "torch.distributed.launcher"))

    torch_loggers = [logging.getLogger(name) for name in logging.root.manager.loggerDict if name.startswith("torch")]
    for handler in {handler for logger in torch_loggers for handler in logger.handlers}:  # torch._logging's
        handler.addFilter(keep)


if __name__ == "__main__":  # python -m llama_tp.parallel.launcher, where the llama-tp command is not installed
    main()
