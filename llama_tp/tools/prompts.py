"""The launch scripts' files: prompts to read (--prompts_file) and results to write at the end
(--output_json); results written as they finish are job_output.py's."""

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Literal, Optional

from ..parallel import global_rank
from ..text.chat_format import Dialog, check_dialog


def batch_rows(max_batch_size: int, n_prompts: int, stream: bool, beams: int = 1) -> int:
    """The max_batch_size to build with: no more rows than the job decodes at once (one at a time
    when streaming), a row a beam where it searches. Fewer rows hold a smaller KV cache, and few
    rows let the CPUs whose products of few rows are fastest on plain weights, but which pack them
    for more, keep them plain (matmul.packing_pays). A value that is not a positive integer is
    passed on for Llama.build to refuse."""
    if not isinstance(max_batch_size, int) or isinstance(max_batch_size, bool) or max_batch_size < 1:
        return max_batch_size
    return (1 if stream else min(max_batch_size, n_prompts)) * beams


def beam_search(num_beams: int, length_penalty: float, early_stopping: str, stream: bool) -> dict:
    """The scripts' --num_beams, --length_penalty and --early_stopping as Llama's arguments
    (early_stopping's words true, false and never as transformers' True, False and "never");
    ValueError naming the option that cannot be."""
    stopping = {"true": True, "false": False, "never": "never"}.get(str(early_stopping).lower())
    if stopping is None:
        raise ValueError(f"--early_stopping must be true, false or never, found {early_stopping!r}")
    if not isinstance(num_beams, int) or isinstance(num_beams, bool) or num_beams < 1:
        raise ValueError(f"--num_beams must be a positive integer (1: no beam search), found {num_beams!r}")
    if num_beams > 1 and stream:
        raise ValueError("--num_beams: beam search gives its answer once the search ends; run it without --stream")
    return dict(num_beams=num_beams, length_penalty=length_penalty, early_stopping=stopping)


def load_prompts(path: str, kind: Literal["text", "chat"]) -> list:
    """A JSON list of strings (text) or of dialogs (chat), or the same items one a line (JSON
    Lines: a .jsonl file, or any file that is not one JSON value), checked item by item."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"prompts file {file} does not exist; pass --prompts_file with a JSON file")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{file} is not valid UTF-8 ({error}); fix the file") from None
    prompts = _json_lines(file, text) if file.suffix == ".jsonl" else _json_or_lines(file, text)
    example = '["Once upon a time"]' if kind == "text" else '[[{"role": "user", "content": "Hi"}]]'
    if not isinstance(prompts, list) or not prompts:
        raise ValueError(f"{file} must hold a non-empty JSON list, e.g. {example}, or one item a line")
    for index, prompt in enumerate(prompts):
        if kind == "text" and not isinstance(prompt, str):
            raise ValueError(f"{file}: item {index} must be a string, found {prompt!r}; e.g. {example}")
        if kind == "chat":
            try:
                check_dialog(prompt)
            except ValueError as error:
                raise ValueError(f"{file}: dialog {index}: {error}; e.g. {example}") from None
    return prompts


def _json_or_lines(file: Path, text: str) -> Any:
    """One JSON value, or, if the file holds several, JSON Lines."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        if error.msg != "Extra data":
            raise ValueError(f"{file} is not valid JSON ({error}); fix the file") from None
        return _json_lines(file, text)


def _json_lines(file: Path, text: str) -> list:
    """One JSON value a line; blank lines skipped."""
    items = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                items.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(f"{file} line {number} is not valid JSON ({error}); fix the file") from None
    return items


def write_json(path: str, records: list[dict[str, Any]]) -> None:
    """On rank 0, write records as a JSON list, atomically: a reader never sees half a file."""
    if global_rank() != 0:
        return
    target = Path(path)
    if not target.parent.is_dir():
        raise FileNotFoundError(f"cannot write {target}: folder {target.parent} does not exist")
    handle, temporary = tempfile.mkstemp(prefix=target.name, suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump(records, out, ensure_ascii=False, indent=1)
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def prompt_record(prompt: "str | Dialog", text: str, token_ids: list[int],
                  reasoning: Optional[str] = None) -> dict[str, Any]:
    """One --output_json entry; a reasoning model's thinking apart from its answer (the generation)."""
    record = {"prompt": prompt, "generation": text}
    if reasoning is not None:
        record["reasoning_content"] = reasoning
    return record | {"token_ids": token_ids}
