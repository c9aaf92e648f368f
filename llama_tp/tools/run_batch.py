"""`python -m llama_tp.run_batch -i requests.jsonl -o results.jsonl` (or under torchrun): a file
of requests in OpenAI's batch format, answered as our server answers them, through continuous
batching without HTTP.

Each input line is {"custom_id", "method": "POST", "url": "/v1/chat/completions" or
"/v1/completions", "body": {...}}; each body is checked by the server's own code (protocol.py,
prepare.py) and answered in the server's shapes (responses.py). Each output line is
{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}, as OpenAI's
batch API writes it: a body the server would refuse gets the server's error as its response (400
and OpenAI's error JSON); a line that is not a request at all (not JSON, no custom_id, another
url) gets "response": null and the reason in "error". No line stops the job. Output lines come as
requests finish, each written whole (match them by custom_id, as with OpenAI's, which must
therefore differ). An output file that holds results is never replaced unasked: --resume answers
only the requests it does not hold yet (a killed job's), --overwrite starts afresh.
"""

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..engine import Delta, GenerationRequest, prompt_seeds, run_job
from ..engine.engine import DEAD_END
from ..engine.scheduler import Sequence
from ..generation import Llama
from ..logs import logger
from ..model.memory import KV_CACHE_FRACTION
from ..parallel import global_rank
from ..serve.prepare import chat_request, choices, completion_request
from ..serve.protocol import ChatCompletionRequest, CompletionRequest, RequestError, error_body, parse_body
from ..serve.responses import Answered, ChatReply, CompletionReply, Reply
from ..text.streaming import cut_at_stop
from . import demo
from .job_output import JobProgress, check_output, whole_lines

# url: the body's model, how it becomes the engine's request, and the shape of its answer (as app.py's routes).
ENDPOINTS = {
    "/v1/chat/completions": (ChatCompletionRequest, chat_request, ChatReply),
    "/v1/completions": (CompletionRequest, completion_request, CompletionReply),
}


class LineError(Exception):
    """A line that is not a batch request: answered with "error", not with a response."""

    def __init__(self, code: str, message: str, custom_id: Optional[str] = None):
        super().__init__(message)
        self.code, self.message, self.custom_id = code, message, custom_id


@dataclass
class Pending:
    """A checked request, waiting for its answer."""

    custom_id: str
    reply: Reply
    request: GenerationRequest


def main(
    input_file: str,
    output_file: str,
    resume: bool = False,
    overwrite: bool = False,
    ckpt_dir: Optional[str] = None,
    tokenizer_path: Optional[str] = None,
    model_name: Optional[str] = None,
    max_batch_size: int = 8,
    max_seq_len: int = 2048,
    kv_cache_memory: Optional[float] = None,
    kv_cache_fraction: float = KV_CACHE_FRACTION,
    no_prefix_cache: bool = False,
    dtype: Optional[str] = None,
    quantize: Optional[str] = None,
    compile: bool = False,
    speculate: Optional[str] = None,
    speculate_k: Optional[int] = None,
    draft_ckpt_dir: Optional[str] = None,
    draft_quantize: Optional[str] = None,
    reasoning_parser: Optional[str] = None,
):
    """Answer every request of an OpenAI batch file, as the server would.

    Args:
        input_file: (-i) the requests, one JSON object a line: {"custom_id", "method": "POST",
            "url": "/v1/chat/completions" or "/v1/completions", "body"}. Every rank reads it.
        output_file: (-o) rank 0 writes one line per request here, as each finishes:
            {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}.
        resume: answer only the requests whose custom_id output_file does not hold yet, appending.
        overwrite: start output_file afresh, discarding the results it holds (without --resume or
            --overwrite, a file that holds results is refused).
        ckpt_dir: folder with params.json and consolidated.XX.pth shards; leave out both paths to
            run the built-in demo model (SmolLM2-135M-Instruct).
        tokenizer_path: the tokenizer file that came with the checkpoint.
        model_name: the name the bodies' "model" must give, as for the server (default: the
            checkpoint folder's name, or smollm2-135m-instruct for the demo model).
        max_batch_size: requests generating at once (the rows of a step): each holds the blocks of
            the KV cache its tokens fill, growing as it does.
        max_seq_len: the longest prompt plus answer of one request, in tokens.
        kv_cache_memory: GiB of KV cache a process holds, handed out by the block as requests
            grow (default: max_batch_size x max_seq_len positions; on a GPU, --kv_cache_fraction of
            the memory free after loading; docs/serving.md).
        kv_cache_fraction: on a GPU without --kv_cache_memory, the share of the memory free after
            loading the weights that the KV cache takes.
        no_prefix_cache: prefill every prompt in full, never sharing blocks an earlier one filled.
        dtype: fp32, bf16 or fp16 (default: fp32 on CPU, bf16 or fp16 on GPU).
        quantize: int8 or int4 (weight-only; int4 on CPU) or int8_dynamic (CPU) linear layers.
        compile: compile the decoding step (worth it for long jobs).
        speculate: draft or lookup: guess tokens, then verify several in one pass (docs/speculative.md).
        speculate_k: guesses a round, 1 to 15 (default: tuned for each mode).
        draft_ckpt_dir: the draft model's checkpoint, sharing the tokenizer (default: this model).
        draft_quantize: the draft's quantization: int4 or int8 alone makes such a copy of this model.
        reasoning_parser: qwen3 or deepseek_r1: a thinking model's <think>...</think> goes apart
            from its chat answers (reasoning_content); none: left in them (default: the one the
            chat template calls for, where it is clear).
    """
    lines = read_lines(input_file)
    check_output(output_file, resume, overwrite, option="-o")
    name = model_name or (Path(ckpt_dir).name if ckpt_dir else demo.MODEL_NAME)
    ckpt_dir, tokenizer_path = demo.model_paths(ckpt_dir, tokenizer_path)
    generator = Llama.build(ckpt_dir, tokenizer_path, max_seq_len, max_batch_size, dtype=dtype, quantize=quantize,
                            compile=compile, speculate=speculate, speculate_k=speculate_k,
                            draft_ckpt_dir=draft_ckpt_dir, draft_quantize=draft_quantize,
                            kv_cache_memory=kv_cache_memory, kv_cache_fraction=kv_cache_fraction,
                            reasoning_parser=reasoning_parser)
    generator.model.prefix_cache.enabled = not no_prefix_cache
    with Output(Path(output_file), resume) as output:
        answer_all(generator, name, lines, output)


def read_lines(path: str) -> list[str]:
    """The batch file's requests, refusing two that share a custom_id (their answers could not be told apart)."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"batch file {file} does not exist; pass -i with a JSON Lines file of requests")
    lines = [line for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
    first_line: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
        custom_id = _custom_id(line)
        if custom_id in first_line:
            raise ValueError(f"{file}: custom_id {custom_id!r} is on request lines {first_line[custom_id]} and "
                             f"{number}; give every request its own custom_id, to match its answer")
        if custom_id is not None:
            first_line[custom_id] = number
    return lines


def _custom_id(line: str) -> Optional[str]:
    """A line's custom_id, if it is a JSON object with one (check_line says what else is wrong)."""
    try:
        item = json.loads(line)
    except ValueError:
        return None
    custom_id = item.get("custom_id") if isinstance(item, dict) else None
    return custom_id if isinstance(custom_id, str) and custom_id else None


class Output:
    """Rank 0's output file: one whole line per request, in one write() each (a killed job's file
    ends at its last whole line). Resumed, it appends; `answered` holds the custom_ids it has
    (every rank reads them: they must agree on what is left), `nameless` its lines for requests
    without one."""

    def __init__(self, path: Path, resume: bool = False):
        self.path, self.resume, self.file = path, resume, None
        self.answered: set[str] = set()
        self.nameless = 0

    def __enter__(self) -> "Output":
        if self.resume:
            for number, line in enumerate(whole_lines(self.path), start=1):
                try:
                    custom_id = json.loads(line)["custom_id"]
                except (ValueError, KeyError, TypeError):
                    raise ValueError(f"{self.path} line {number} is not a batch result ({line[:80]!r}); resume "
                                     "with the file run_batch wrote, or pass --overwrite instead") from None
                if custom_id is None:
                    self.nameless += 1
                else:
                    self.answered.add(custom_id)
        if global_rank() == 0:
            truncate = 0 if self.resume else os.O_TRUNC
            self.file = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | truncate, 0o644)
        return self

    def holds(self, custom_id: Optional[str]) -> bool:
        """Whether a resumed file has this request's line already (counting off those without a custom_id)."""
        if custom_id is None and self.nameless:
            self.nameless -= 1
            return True
        return custom_id in self.answered

    def write(self, custom_id: Optional[str], response: Optional[dict], error: Optional[dict]) -> None:
        if self.file is not None:
            record = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response,
                      "error": error}
            os.write(self.file, (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))

    def __exit__(self, *exc) -> None:
        if self.file is not None:
            os.close(self.file)


def answer_all(generator: Llama, model_name: str, lines: list[str], output: Output) -> None:
    """Check every line, write the refusals at once, then answer the rest as they finish (those a
    resumed output does not hold yet)."""
    pending: dict[str, Pending] = {}
    for number, line in enumerate(lines, start=1):
        try:
            checked = check_line(line, generator, model_name)
        except LineError as error:
            if not output.holds(error.custom_id):
                logger.info(f"line {number}: {error.message}")
                output.write(error.custom_id, None, {"code": error.code, "message": error.message})
            continue
        if isinstance(checked, tuple):  # the server's refusal
            custom_id, refusal = checked
            if not output.holds(custom_id):
                output.write(custom_id, response(refusal.status, refusal.body()), None)
        else:
            pending[checked.request.id] = checked
    seeds = [p.request.options.seed for p in pending.values()]
    drawn = iter(prompt_seeds(None, seeds.count(None)))  # alike on every rank, as Llama.build seeded them
    # drawn for every request, answered or not, so that a resumed job's are those of an unbroken run
    jobs = [(p, next(drawn) if seed is None else seed) for p, seed in zip(pending.values(), seeds)]
    jobs = [(p, seed) for p, seed in jobs if not output.holds(p.custom_id)]
    if output.answered:
        logger.info(f"resuming: {len(pending) - len(jobs)} of {len(pending)} requests answered in {output.path}")
    progress = JobProgress(len(jobs), unit="requests")

    try:
        for updates in run_job(generator.engine(), [(p.request, seed) for p, seed in jobs]):
            for update in updates:
                if update.delta.finished:
                    sequence, done = update.sequence, pending[update.sequence.request.id]
                    reason = update.delta.finish_reason
                    if reason == "error":  # its grammar allowed no next token: the server's 400 for it
                        body = response(400, error_body(400, DEAD_END, None, "grammar_dead_end"))
                    else:
                        body = response(200, answer(done, sequence, reason, generator))
                    output.write(done.custom_id, body, None)
                    progress.update(sequence.generated)
    finally:
        progress.close()


def check_line(line: str, generator: Llama, model_name: str) -> "Pending | tuple[str, RequestError]":
    """A line as a checked request, or its custom_id and the server's refusal of its body; a line
    that is not a batch request raises LineError."""
    try:
        item = json.loads(line)
    except ValueError as error:
        raise LineError("invalid_json", f"the line is not valid JSON: {error}") from None
    if not isinstance(item, dict):
        raise LineError("invalid_request", "the line must be a JSON object with custom_id, method, url and body")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError("missing_custom_id", "the line needs a `custom_id` string, to match its answer")
    if item.get("method") != "POST":
        raise LineError("invalid_method", f"`method` must be POST, found {item.get('method')!r}", custom_id)
    if item.get("url") not in ENDPOINTS:
        raise LineError("invalid_url", f"`url` must be one of {', '.join(ENDPOINTS)}, found {item.get('url')!r}",
                        custom_id)
    body_model, prepare, reply_kind = ENDPOINTS[item["url"]]
    try:
        body = parse_body(json.dumps(item.get("body")).encode(), body_model)
        if body.model != model_name:
            raise RequestError(404, f"the model `{body.model}` does not exist; this server serves `{model_name}`",
                               "model", "model_not_found")
        if body.stream:
            raise RequestError(400, "`stream` is not supported in a batch: each answer is written whole",
                               "stream", "invalid_value")
        reply = reply_kind(model_name, generator.tokenizer, body.include_usage)
        request = prepare(body, generator, reply.id)
        if request.thinking is not None:  # a reasoning model's: its thinking goes apart, as the server answers
            reply.thinking = request.thinking
        if len(choices(body, request, generator)) > 1 or (body.n or 1) > 1:  # after choices' own checks of n and best_of
            raise RequestError(400, f"`n` ({body.n}) is not supported in a batch: a line gives one answer; write "
                               f"{body.n} lines", "n", "unsupported_parameter")
        return Pending(custom_id, reply, request)
    except RequestError as refusal:
        return custom_id, refusal


def answer(pending: Pending, sequence: Sequence, reason: str, generator: Llama) -> dict[str, Any]:
    """The server's whole response for a finished sequence."""
    progress, request = sequence.sampling, pending.request
    text = cut_at_stop(generator.tokenizer.decode(progress.answer), request.stop)
    final = Delta(finish_reason=reason, prompt_tokens=sequence.prompt_length, completion_tokens=sequence.generated,
                  cached_tokens=sequence.reused)
    return pending.reply.response([Answered(text, progress.logprobs if request.logprobs else None, final)])


def response(status: int, body: dict) -> dict[str, Any]:
    return {"status_code": status, "request_id": f"req_{uuid.uuid4().hex}", "body": body}
