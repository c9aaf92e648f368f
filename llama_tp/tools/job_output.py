"""A batch job's results as they finish: --output_jsonl (one whole line per prompt, flushed, so a
killed job keeps everything it finished), --resume (skip what the file already holds), --overwrite
(the only way to start afresh over results: a job never destroys them unasked), and the progress
shown on stderr.
"""

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from tqdm import tqdm

from ..continuous import prompt_seed
from ..logs import logger
from ..parallel import global_rank
from .prompts import prompt_record

# Without a terminal on stderr (a log file, a batch system), a line of progress this often, in seconds.
LOG_EVERY_SECONDS = 30.0


def check_output(path: Optional[str], resume: bool, overwrite: bool, option: str = "--output_jsonl") -> None:
    """Refuse, before anything loads, a results file that the job cannot write or would destroy."""
    if resume and overwrite:
        raise ValueError(f"--resume goes on from the results in {option} and --overwrite discards them; pass one")
    if (resume or overwrite) and not path:
        raise ValueError(f"--{'resume' if resume else 'overwrite'} is about the results in {option}; "
                         f"pass {option} FILE too")
    if not path:
        return
    file = Path(path)
    if not file.parent.is_dir():
        raise FileNotFoundError(f"cannot write {file}: folder {file.parent} does not exist")
    if not (resume or overwrite) and file.exists() and file.stat().st_size > 0:
        raise ValueError(f"{option} {file} already holds results; pass --resume to go on from them, or "
                         "--overwrite to replace them")


def whole_lines(path: Path) -> list[str]:
    """The file's whole lines (none if it is not there); a last line that a crash cut (it could only
    come from a writer other than ours) is cut off, by rank 0."""
    if not path.exists():
        return []
    data = path.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    if len(whole) < len(data) and global_rank() == 0:
        with open(path, "r+b") as file:
            file.truncate(len(whole))
    return whole.decode("utf-8").splitlines()


class ResultLog:
    """--output_jsonl: rank 0 appends {"index", ...record} for each prompt as it finishes.

    Each line goes out in one write() on a file opened for appending: it is in the file whole or
    not at all, whenever the job is killed. Every rank reads the file on resume (they must agree
    on what is left to do); only rank 0 writes.
    """

    def __init__(self, path: str, prompts: list, resume: bool, overwrite: bool = False):
        check_output(path, resume, overwrite)
        self.path = Path(path)
        self.done: dict[int, dict[str, Any]] = self._read(prompts) if resume else {}
        self._file = None
        if global_rank() == 0:
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if resume else os.O_TRUNC)
            self._file = os.open(self.path, flags, 0o644)

    def _read(self, prompts: list) -> dict[int, dict[str, Any]]:
        """The whole lines already written, checked against this job's prompts."""
        done = {}
        for number, line in enumerate(whole_lines(self.path), start=1):
            try:
                record = json.loads(line)
                index = record["index"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{self.path} line {number} is not a result of this job ({line[:80]!r}); "
                                 f"resume with the file the job wrote, or pass --overwrite instead to start afresh") from None
            if not isinstance(index, int) or not 0 <= index < len(prompts) or record.get("prompt") != prompts[index]:
                raise ValueError(f"{self.path} line {number} holds prompt {index!r}, which is not that prompt of "
                                 f"--prompts_file; resume with the same prompts file, or pass --overwrite instead")
            done[index] = record
        return done

    def write(self, index: int, record: dict[str, Any]) -> None:
        self.done[index] = record
        if self._file is not None:
            line = json.dumps({"index": index, **record}, ensure_ascii=False) + "\n"
            os.write(self._file, line.encode("utf-8"))

    def close(self) -> None:
        if self._file is not None:
            os.close(self._file)
            self._file = None


class JobProgress:
    """Prompts done, tokens a second and the time left, on rank 0's stderr: a tqdm bar on a
    terminal, else a log line every LOG_EVERY_SECONDS."""

    def __init__(self, total: int, done: int = 0, unit: str = "prompts"):
        self.shown, self.unit = global_rank() == 0, unit
        self.total, self.initial, self.done, self.tokens = total, done, done, 0
        self.start = self.last_line = time.monotonic()
        self.bar: Optional[tqdm] = None
        if self.shown and sys.stderr.isatty():
            self.bar = tqdm(total=total, initial=done, unit=unit.rstrip("s"), file=sys.stderr, dynamic_ncols=True)

    def update(self, tokens: int) -> None:
        """One more prompt done, which generated tokens."""
        self.done += 1
        self.tokens += tokens
        if not self.shown:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(f"{self.rate():.1f} tokens/s", refresh=False)
            self.bar.update(1)
        elif time.monotonic() - self.last_line >= LOG_EVERY_SECONDS or self.done == self.total:
            self.last_line = time.monotonic()
            logger.info(self.describe())

    def rate(self) -> float:
        return self.tokens / max(time.monotonic() - self.start, 1e-9)

    def describe(self) -> str:
        """e.g. '40/256 prompts, 212.5 tokens/s, 3m10s left'."""
        elapsed = time.monotonic() - self.start
        ran, left = self.done - self.initial, self.total - self.done
        seconds = int(elapsed / ran * left) if ran > 0 else None
        eta = f"{seconds // 60}m{seconds % 60:02d}s left" if seconds is not None else "time left unknown"
        return f"{self.done}/{self.total} {self.unit}, {self.rate():.1f} tokens/s, {eta}"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_job(prompts: list, answer: Callable, text_of: Callable[[dict], str], output_jsonl: Optional[str],
            resume: bool, seed: Optional[int],
            reasoning_of: Callable[[dict], Optional[str]] = lambda result: None,
            overwrite: bool = False) -> list[dict[str, Any]]:
    """Answer every prompt that --output_jsonl does not hold yet, writing each as it finishes;
    return every prompt's record, in order.

    answer(prompts, seed, on_result): text_completion or chat_completion with the script's options.
    text_of(result): the record's generation; reasoning_of(result): a reasoning model's thinking, kept apart.
    A resumed job gives the prompts left the seeds of their places in the whole job, so its
    answers are those of an unbroken run.
    """
    check_output(output_jsonl, resume, overwrite)
    log = ResultLog(output_jsonl, prompts, resume, overwrite) if output_jsonl else None
    records = {index: {k: v for k, v in record.items() if k != "index"}
               for index, record in (log.done if log else {}).items()}
    left = [index for index in range(len(prompts)) if index not in records]
    if records:
        logger.info(f"resuming: {len(records)} of {len(prompts)} prompts done in {output_jsonl}")
    seeds = [prompt_seed(seed, index) for index in left] if records and seed is not None else seed
    progress = JobProgress(len(prompts), len(records))

    def on_result(position: int, result: dict) -> None:
        index = left[position]
        records[index] = prompt_record(prompts[index], text_of(result), result["token_ids"], reasoning_of(result))
        if log is not None:
            log.write(index, records[index])
        progress.update(len(result["token_ids"]))

    try:
        if left:
            answer([prompts[index] for index in left], seeds, on_result)
    finally:
        progress.close()
        if log is not None:
            log.close()
    return [records[index] for index in range(len(prompts))]
