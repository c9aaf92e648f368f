"""The server's Prometheus metrics (GET /metrics): requests in each state, tokens, latencies.

A registry of its own per server, so that tests can run several. The engine updates the request
and token figures on rank 0 as they change; the HTTP side counts what it refuses.
"""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from .requests import RequestState

disable_created_metrics()  # no *_created series: a start time per label is noise here

# Seconds: a CPU step of a small model takes tens of milliseconds, a long prompt on a big one seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests_waiting = Gauge("llama_tp_requests_waiting", "Requests waiting for a slot", registry=registry)
        self.requests_running = Gauge("llama_tp_requests_running", "Requests generating", registry=registry)
        self.requests_ended = Counter("llama_tp_requests", "Requests that ended, by how", ["state"], registry=registry)
        self.requests_refused = Counter("llama_tp_requests_refused", "Requests refused before reaching the engine, "
                                        "by HTTP status", ["status"], registry=registry)
        self.prompt_tokens = Counter("llama_tp_prompt_tokens", "Prompt tokens of admitted requests", registry=registry)
        self.cached_prompt_tokens = Counter("llama_tp_prompt_tokens_cached", "Prompt tokens whose keys and values "
                                            "were reused from an earlier request", registry=registry)
        self.generation_tokens = Counter("llama_tp_generation_tokens", "Tokens generated", registry=registry)
        self.time_to_first_token = Histogram("llama_tp_time_to_first_token_seconds", "From a request's arrival to "
                                             "its first token", buckets=LATENCY_BUCKETS, registry=registry)
        self.time_per_output_token = Histogram("llama_tp_time_per_output_token_seconds", "A request's time from "
                                               "its first token to its last, per token after the first",
                                               buckets=LATENCY_BUCKETS, registry=registry)
        for state in (RequestState.FINISHED, RequestState.CANCELLED, RequestState.FAILED):
            self.requests_ended.labels(state.value)  # every state shows, at 0 until it happens

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
