"""What the library says while it works (loading, compiling kernels, preparing the demo model): the
`llama_tp` logger, on stderr, so that a script's answers stay alone on stdout.

One line per job: only global rank 0 logs, unless LLAMA_TP_LOG_RANKS=all, which shows every
rank's lines, each marked with its rank. LLAMA_TP_LOG=warning (or logging's own
`logging.getLogger("llama_tp").setLevel(...)`) silences the progress lines; a program that
configures logging itself can add its own handlers to the logger.
"""

import logging
import os
import sys
from typing import Optional

logger = logging.getLogger("llama_tp")


class _RankFilter(logging.Filter):
    """Let records through on rank 0 (or every rank when asked), marking them with the rank then."""

    def __init__(self) -> None:
        super().__init__()
        self.rank: Optional[int] = None  # unknown until parallel.init: a lone process logs
        self.every_rank = os.environ.get("LLAMA_TP_LOG_RANKS", "0") == "all"

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank_prefix = f"[rank {self.rank}] " if self.every_rank and self.rank is not None else ""
        return self.every_rank or not self.rank


_rank_filter = _RankFilter()


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record comes, so redirecting it redirects the log."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _) -> None:
        pass


def set_rank(rank: int) -> None:
    """Tell the logger which global rank this process is (parallel.init does)."""
    _rank_filter.rank = rank


def _configure() -> None:
    level = os.environ.get("LLAMA_TP_LOG", "info").upper()
    if not isinstance(logging.getLevelName(level), int):
        raise ValueError(f"LLAMA_TP_LOG={level.lower()!r} is not a logging level; use debug, info, warning or error")
    logger.setLevel(level)
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(rank_prefix)s%(message)s"))
    handler.addFilter(_rank_filter)
    logger.addHandler(handler)
    logger.propagate = False  # one line per message, whatever the program does with the root logger


_configure()
