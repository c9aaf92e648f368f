"""The server's Prometheus metrics (GET /metrics): requests in each state, tokens, latencies, the
KV cache's use; and the same again under vLLM's names, for the dashboards that read vLLM's.

A registry of its own per server, so that tests can run several. The engine tells rank 0's
EngineMetrics of its requests and tokens as they change; the HTTP side counts what it refuses.
"""

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from ..engine.observer import CacheUse, Observer
from ..engine.requests import RequestState
from ..engine.scheduler import Sequence

disable_created_metrics()  # no *_created series: a start time per label is noise here

# Seconds: a CPU step of a small model takes tens of milliseconds, a long prompt on a big one seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96)

# vLLM's name of each metric we have with its meaning, vLLM's help text, and ours (docs/serving.md,
# "Metrics", has them side by side). Counters without their _total, as prometheus_client names them.
VLLM_NAMES = {
    "vllm:num_requests_running": ("Number of requests in model execution batches.", "requests_running"),
    "vllm:num_requests_waiting": ("Number of requests waiting to be processed.", "requests_waiting"),
    "vllm:kv_cache_usage_perc": ("KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage"),
    "vllm:num_preemptions": ("Cumulative number of preemption from the engine.", "preemptions"),
    "vllm:prefix_cache_queries": ("Prefix cache queries, in terms of number of queried tokens.", "prompt_tokens"),
    "vllm:prefix_cache_hits": ("Prefix cache hits, in terms of number of cached tokens.", "cached_prompt_tokens"),
    "vllm:prompt_tokens": ("Number of prefill tokens processed.", "prompt_tokens"),
    "vllm:generation_tokens": ("Number of generation tokens processed.", "generation_tokens"),
    "vllm:time_to_first_token_seconds": ("Histogram of time to first token in seconds.", "time_to_first_token"),
    "vllm:inter_token_latency_seconds": ("Histogram of inter-token latency in seconds.", "inter_token_latency"),
    # vLLM's older name of the inter-token latency, which its dashboards still read
    "vllm:time_per_output_token_seconds": ("Histogram of time per output token in seconds.", "inter_token_latency"),
    "vllm:request_time_per_output_token_seconds": ("Histogram of time_per_output_token_seconds per request.",
                                                   "time_per_output_token"),
    "vllm:e2e_request_latency_seconds": ("Histogram of e2e request latency in seconds.", "request_latency"),
}


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        """model_name: the served name, the model_name label of the vLLM-named series."""
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests_waiting = Gauge("llama_tp_requests_waiting", "Requests waiting for a slot", registry=registry)
        self.requests_running = Gauge("llama_tp_requests_running", "Requests generating", registry=registry)
        self.requests_running_max = Gauge("llama_tp_requests_running_max", "The most requests generating at once "
                                          "since the server started", registry=registry)
        self.requests_ended = Counter("llama_tp_requests", "Requests that ended, by how", ["state"], registry=registry)
        self.requests_refused = Counter("llama_tp_requests_refused", "Requests refused before reaching the engine, "
                                        "by HTTP status", ["status"], registry=registry)
        self.kv_cache_usage = Gauge("llama_tp_kv_cache_usage", "The fraction of the KV cache's blocks that the "
                                    "running requests hold (their prompts and answers so far)", registry=registry)
        self.kv_cache_blocks_used = Gauge("llama_tp_kv_cache_blocks_used", "Blocks of the KV cache that running "
                                          "requests hold (a shared prefix's once)", registry=registry)
        self.kv_cache_blocks_used_max = Gauge("llama_tp_kv_cache_blocks_used_max", "The most blocks of the KV cache "
                                              "that running requests held at once since the server started",
                                              registry=registry)
        self.kv_cache_blocks_cached = Gauge("llama_tp_kv_cache_blocks_cached", "Blocks of the KV cache that no "
                                            "request holds, keeping a prefix for later prompts", registry=registry)
        self.preemptions = Counter("llama_tp_preemptions", "Running requests that gave their blocks back for an "
                                   "older one to grow, to resume later", registry=registry)
        self.prompt_tokens = Counter("llama_tp_prompt_tokens", "Prompt tokens of admitted requests", registry=registry)
        self.cached_prompt_tokens = Counter("llama_tp_prompt_tokens_cached", "Prompt tokens whose keys and values "
                                            "were reused from an earlier request", registry=registry)
        self.generation_tokens = Counter("llama_tp_generation_tokens", "Tokens generated", registry=registry)
        self.time_to_first_token = Histogram("llama_tp_time_to_first_token_seconds", "From a request's arrival to "
                                             "its first token", buckets=LATENCY_BUCKETS, registry=registry)
        self.inter_token_latency = Histogram("llama_tp_inter_token_latency_seconds", "Before each token after a "
                                             "request's first, since its previous one (a speculation round's time "
                                             "shared by the tokens it adds)", buckets=LATENCY_BUCKETS, registry=registry)
        self.time_per_output_token = Histogram("llama_tp_time_per_output_token_seconds", "A request's time from "
                                               "its first token to its last, per token after the first",
                                               buckets=LATENCY_BUCKETS, registry=registry)
        self.request_latency = Histogram("llama_tp_request_seconds", "From a request's arrival to its last token, "
                                         "for requests that finished (not cancelled)", buckets=LATENCY_BUCKETS,
                                         registry=registry)
        for state in (RequestState.FINISHED, RequestState.CANCELLED, RequestState.FAILED):
            self.requests_ended.labels(state.value)  # every state shows, at 0 until it happens
        registry.register(VllmNames(self, model_name))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class VllmNames(Collector):
    """Our metrics again under vLLM's names, labelled with the model's name as vLLM labels them: a
    view read at each scrape, so that the two names never disagree."""

    def __init__(self, metrics: ServerMetrics, model_name: str):
        self.metrics, self.model_name = metrics, model_name

    def collect(self):
        for name, (help_text, ours) in VLLM_NAMES.items():
            for family in getattr(self.metrics, ours).collect():
                renamed = Metric(name, help_text, family.type)
                for sample in family.samples:  # _total, _bucket, _sum and _count keep their suffixes
                    renamed.add_sample(name + sample.name[len(family.name):],
                                       {"model_name": self.model_name, **sample.labels}, sample.value)
                yield renamed


class EngineMetrics(Observer):
    """The engine's events (rank 0's) as the server's metrics."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.preemptions = 0  # the engine's count so far
        self.most_running = self.most_blocks_used = 0  # the gauges' highest values so far

    def admitted(self, sequence: Sequence) -> None:
        self.metrics.prompt_tokens.inc(sequence.prompt_length)
        self.metrics.cached_prompt_tokens.inc(sequence.reused)

    def token(self, sequence: Sequence, at: float) -> None:
        progress = sequence.sampling
        if progress.first_token_at is None:
            self.metrics.time_to_first_token.observe(at - sequence.request.arrival)
        else:
            self.metrics.inter_token_latency.observe(at - progress.last_token_at)
        self.metrics.generation_tokens.inc()

    def finished(self, sequence: Sequence, reason: str) -> None:
        progress = sequence.sampling
        if progress.first_token_at is not None and sequence.generated > 1:
            per_token = (progress.last_token_at - progress.first_token_at) / (sequence.generated - 1)
            self.metrics.time_per_output_token.observe(per_token)
        if reason != "cancelled":
            self.metrics.request_latency.observe(time.monotonic() - sequence.request.arrival)
        self.ended({"cancelled": RequestState.CANCELLED, "error": RequestState.FAILED}.get(reason, RequestState.FINISHED))

    def ended(self, state: RequestState) -> None:
        self.metrics.requests_ended.labels(state.value).inc()

    def load(self, running: int, cache: CacheUse) -> None:
        self.metrics.requests_running.set(running)
        self.metrics.kv_cache_usage.set(cache.usage)
        self.metrics.kv_cache_blocks_used.set(cache.used)
        self.most_running = max(self.most_running, running)
        self.most_blocks_used = max(self.most_blocks_used, cache.used)
        self.metrics.requests_running_max.set(self.most_running)
        self.metrics.kv_cache_blocks_used_max.set(self.most_blocks_used)
        self.metrics.kv_cache_blocks_cached.set(cache.cached)
        self.metrics.preemptions.inc(cache.preemptions - self.preemptions)
        self.preemptions = cache.preemptions

