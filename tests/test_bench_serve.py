"""The serving benchmark's statistics and table, and a short run against the app with a fake engine."""

import asyncio
import json
import subprocess
import sys

import httpx
import pytest

from fake_engine import ANSWER, MODEL, served
from llama_tp.tools.bench.clients import percentile, print_table, summarize
from llama_tp.tools.bench.serve import main
from llama_tp.tools.bench.workload import PROMPTS
from llama_tp.tools.bench.stream_client import Outcome, event_lines, send


def test_percentile_interpolates_between_ranks():
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile(list(range(101)), 99) == 99


def test_summarize():
    outcomes = [
        Outcome(start=0.0, first=0.1, last=1.1, tokens=11, tokens_from_usage=True),  # 0.1 s per token
        Outcome(start=1.0, first=1.3, last=1.7, tokens=5, tokens_from_usage=True),  # 0.1 s per token
        Outcome(start=2.0, first=2.2, last=2.2, tokens=1),  # one token: no time per token
        Outcome(start=3.0, error="HTTP 503: loading"),
    ]
    result = summarize(2, outcomes, seconds=4.0)
    assert (result["requests"], result["errors"], result["first_errors"]) == (4, 1, ["HTTP 503: loading"])
    assert result["requests_per_s"] == 0.75  # the three answered, in 4 s
    assert (result["output_tokens"], result["output_tokens_per_s"]) == (17, 4.25)
    assert result["tokens_from_usage"] == 2
    assert result["ttft_p50_s"] == pytest.approx(0.2) and result["ttft_p99_s"] == pytest.approx(0.298)
    assert result["tpot_p50_s"] == pytest.approx(0.1) and result["tpot_p99_s"] == pytest.approx(0.1)


def test_table(capsys):
    print_table([summarize(1, [Outcome(0.0, 0.05, 0.25, 3, True)], 0.5), summarize(8, [Outcome(0.0, error="x")], 1)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["concurrency", "requests", "errors", "req/s", "out"]
    assert lines[1].split() == ["1", "1", "0", "2.00", "6.0", "50.0", "50.0", "100.0", "100.0"]
    assert lines[2].split() == ["8", "1", "1", "0.00", "0.0", "-", "-", "-", "-"]
    assert lines[3] == "concurrency 8: error: x"


def expected_tokens(tokenizer, requests: int, max_tokens: int) -> int:
    """What the fake engine's answers hold: each prompt's share of max_tokens, at most its script."""
    script = len(tokenizer.encode(ANSWER, bos=False, eos=False))
    return sum(min(script, max(1, round(max_tokens * PROMPTS[i % len(PROMPTS)][1]))) for i in range(requests))


def test_run_against_the_server(llama2_tokenizer, tmp_path, capsys):
    with served(llama2_tokenizer, max_seq_len=512, slots=2) as s:
        main(url=s.url + "/", concurrency=(1, 3), requests=6, max_tokens=8, json_path=str(tmp_path / "b.json"),
             label="fake")
        report = json.loads((tmp_path / "b.json").read_text())
        assert (report["label"], report["model"], report["url"]) == ("fake", MODEL, s.url)
        assert [r["concurrency"] for r in report["results"]] == [1, 3]
        for result in report["results"]:
            assert (result["requests"], result["errors"], result["tokens_from_usage"]) == (6, 0, 6)
            assert result["output_tokens"] == expected_tokens(llama2_tokenizer, 6, 8)
            assert result["ttft_p50_s"] > 0 and result["tpot_p99_s"] > 0
        request = s.engine.requests[-1]
        assert (request.options.temperature, request.options.repetition_penalty) == (0, 1)
        assert request.max_tokens == round(8 * PROMPTS[5][1])
        assert "concurrency" in capsys.readouterr().out


def test_without_usage_counts_chunks_and_errors_are_counted(llama2_tokenizer, tmp_path):
    with served(llama2_tokenizer, max_seq_len=512) as s:
        main(url=s.url, concurrency=2, requests=4, max_tokens=8, json_path=str(tmp_path / "b.json"),
             extra_body='{"stream_options": {"include_usage": false}}')
        result = json.loads((tmp_path / "b.json").read_text())["results"][0]
        assert (result["errors"], result["tokens_from_usage"]) == (0, 0)
        assert result["output_tokens"] == expected_tokens(llama2_tokenizer, 4, 8)  # each token brought its own text
        main(url=s.url, concurrency=2, requests=2, model="other", warmup=0, json_path=str(tmp_path / "b.json"))
        result = json.loads((tmp_path / "b.json").read_text())["results"][0]
        assert result["errors"] == 2 and result["first_errors"][0].startswith("HTTP 404")


def llama_cpp_stream(finish: bool) -> bytes:
    """A stream as llama.cpp's Python server sends it: lines ended by one newline, pings, a role
    chunk without content, one chunk per token, no usage, and with --interrupt_requests (its
    default) [DONE] without a finish reason when another request comes."""
    def chunk(delta: dict, reason=None) -> str:
        return "data: " + json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": reason}]}) + "\r\n\r\n"

    events = [chunk({"role": "assistant"}), ": ping - 2026-01-01\r\n\r\n", chunk({"content": "Par"}),
              chunk({"content": "is"}), chunk({"content": "."})]
    return "".join(events + [chunk({}, "stop")] * finish + ["data: [DONE]\r\n\r\n"]).encode()


@pytest.mark.parametrize("finish", [True, False])
def test_send_reads_llama_cpp_streams(finish):
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=llama_cpp_stream(finish)))

    async def one() -> Outcome:
        async with httpx.AsyncClient(transport=transport) as client:
            return await send(client, "http://server", {"model": "m"})

    outcome = asyncio.run(one())
    assert (outcome.tokens, outcome.tokens_from_usage) == (3, False)
    assert outcome.start < outcome.first < outcome.last
    assert (outcome.error is None) == finish
    if not finish:
        assert "without a finish reason" in outcome.error


@pytest.mark.slow  # starts a process
def test_the_command_line(llama2_tokenizer, tmp_path):
    """Through fire, as typed: a list of concurrencies, and JSON's false in --extra_body."""
    with served(llama2_tokenizer, max_seq_len=512) as s:
        subprocess.run([sys.executable, "-m", "llama_tp.bench_serve", "--url", s.url, "--concurrency", "1,2",
                        "--requests", "2", "--max_tokens", "4", "--json_path", str(tmp_path / "b.json"),
                        "--extra_body", '{"stream_options": {"include_usage": false}}'], check=True, timeout=120)
    report = json.loads((tmp_path / "b.json").read_text())
    assert [r["concurrency"] for r in report["results"]] == [1, 2]
    assert report["command"]["extra_body"] == {"stream_options": {"include_usage": False}}
    assert [r["tokens_from_usage"] for r in report["results"]] == [0, 0]


@pytest.mark.parametrize("options, words", [
    ({"concurrency": (1, 0)}, "--concurrency"),
    ({"concurrency": 8, "requests": 4}, "--requests 8"),
    ({"max_tokens": 0}, "--max_tokens"),
    ({"extra_body": "[1]"}, "--extra_body"),
])
def test_refuses_bad_options(options, words):
    with pytest.raises(ValueError, match=words):
        main(url="http://127.0.0.1:1", **options)


def test_the_sampled_load_sends_temperature_and_leaves_the_rest_to_the_server(llama2_tokenizer, tmp_path):
    with served(llama2_tokenizer, max_seq_len=512, slots=2) as s:
        main(url=s.url, concurrency=2, requests=2, max_tokens=8, sampling="sampled", json_path=str(tmp_path / "b.json"))
        options = s.engine.requests[-1].options
        defaults = s.engine.requests[-1].options.__class__()
        assert options.temperature == 0.7 and options.repetition_penalty == defaults.repetition_penalty
    assert json.loads((tmp_path / "b.json").read_text())["command"]["sampling"] == {"temperature": 0.7}


@pytest.mark.parametrize("options, words", [
    ({"sampling": "hot"}, "--sampling 'hot'"),
    ({"ours": "int3"}, "--ours 'int3'"),
    ({"peer": "vllm"}, "--peer 'vllm'"),
    ({"peer": "llama-server", "gguf": "x.gguf"}, "--llama_server PATH"),
])
def test_refuses_unknown_loads_and_servers(options, words):
    with pytest.raises(ValueError, match=words):
        main(url="http://127.0.0.1:1", **options)


def test_event_lines_split_only_where_server_sent_events_do():
    """A JSON string may hold U+2028 or U+0085 as they are (httpx's aiter_lines split there, and a
    random model's answer broke the pool benchmark's parsing); CRLF split across reads is one end."""

    class Stream:
        async def aiter_text(self):
            for part in ('data: {"a": "x\u2028y\x85z"}\r', '\ndata: [DONE]\n', "tail"):
                yield part

    async def lines():
        return [line async for line in event_lines(Stream())]

    assert [line for line in asyncio.run(lines()) if line] == ['data: {"a": "x\u2028y\x85z"}', "data: [DONE]", "tail"]
