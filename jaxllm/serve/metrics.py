"""The HTTP server's Prometheus metrics, in a registry of its own (one per server): ours
(`jaxllm_*`), and beside them some of vLLM's under vLLM's names, labels and buckets (`vllm:*`),
so that dashboards and autoscalers written for vLLM read this server too. Where both have a
figure, one observation feeds both names."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

if TYPE_CHECKING:
    from jaxllm.serve.engine import Stats

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# vLLM's buckets for the same figures (vllm/v1/metrics/loggers.py).
VLLM_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
             80.0, 160.0, 640.0, 2560.0)  # fmt: skip
VLLM_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
VLLM_REQUEST = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                960.0, 1920.0, 7680.0)  # fmt: skip
VLLM_LABELS = ("model_name", "engine")  # vLLM's; one engine here, "0"


class _Totals:
    """Counters whose totals another object keeps (the engine's, since it started), set at each
    scrape: a counter never goes down, whatever order scrapes set it in."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str], documentation: dict[str, str]):
        self.labels, self.documentation = labels, documentation
        self.values = dict.fromkeys(documentation, 0.0)
        self._lock = threading.Lock()  # scrapes run in worker threads
        registry.register(self)

    def set(self, name: str, total: float) -> None:
        with self._lock:
            self.values[name] = max(self.values[name], total)

    def collect(self):
        for name, documentation in self.documentation.items():
            family = CounterMetricFamily(name, documentation, labels=list(self.labels))
            family.add_metric(list(self.labels.values()), self.values[name])
            yield family

    def describe(self):
        return [CounterMetricFamily(name, documentation) for name, documentation in self.documentation.items()]


class Metrics:
    def __init__(self, slots: int, model_name: str):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "jaxllm_requests", "HTTP requests by route and status.", ["route", "status"], registry=r
        )
        self.rejections = Counter("jaxllm_rejections", "Requests refused, by reason.", ["reason"], registry=r)
        self.failures = Counter(
            "jaxllm_request_failures", "Requests the server failed (500: internal_error, 504: timeout), by reason.",
            ["reason"], registry=r,
        )  # fmt: skip
        self.engine_restarts = Gauge(
            "jaxllm_engine_restarts", "Decode states rebuilt after a failed device step.", registry=r
        )
        self.queue_depth = Gauge("jaxllm_queue_depth", "Requests waiting for a slot.", registry=r)
        self.active_slots = Gauge("jaxllm_active_slots", "Slots decoding a request.", registry=r)
        self.kv_cache_usage = Gauge(
            "jaxllm_kv_cache_usage", "Fraction of the KV cache's pages that sequences hold.", registry=r
        )
        self.kv_pages_cached = Gauge("jaxllm_kv_pages_cached", "Pages in the prefix cache, held or idle.", registry=r)
        self.prefix_cache_hits = Gauge(
            "jaxllm_prefix_cache_hit_pages", "Full prompt pages found in the prefix cache since start.", registry=r
        )
        self.prefix_cache_misses = Gauge(
            "jaxllm_prefix_cache_miss_pages", "Full prompt pages not found in the prefix cache since start.", registry=r
        )
        self.preemptions = Gauge(
            "jaxllm_preemptions", "Sequences preempted (to prefill again later) when pages ran out.", registry=r
        )
        self.step_slots = Histogram(
            "jaxllm_decode_step_slots", "Busy slots in each decode step.", buckets=range(1, slots + 1), registry=r
        )
        self.time_to_first_token = Histogram(
            "jaxllm_time_to_first_token_seconds", "From a request's arrival to its first token.", buckets=LATENCY,
            registry=r,
        )  # fmt: skip
        self.time_per_output_token = Histogram(
            "jaxllm_time_per_output_token_seconds", "Between a choice's tokens after its first.", buckets=LATENCY,
            registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter("jaxllm_prompt_tokens", "Prompt tokens admitted.", registry=r)
        self.generated_tokens = Counter("jaxllm_generated_tokens", "Tokens generated.", registry=r)
        self.prompt_perplexity = Histogram(
            "jaxllm_prompt_perplexity", "Prompt perplexity, worst of whole and 32-token windows.",
            buckets=(2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536), registry=r,
        )  # fmt: skip
        self.perplexity_alarms = Counter(
            "jaxllm_perplexity_alarms", "Prompts whose perplexity passed serve.ppl_alarm.", registry=r
        )
        self.decode_bandwidth = Gauge(
            "jaxllm_decode_bandwidth_fraction", "Decode steps' achieved memory bandwidth, a fraction of one device's: "
            "the weight and KV bytes a device reads per step over the step's time (recent steps, smoothed).",
            registry=r,
        )  # fmt: skip
        self.engine_up = Gauge(
            "jaxllm_engine_up", "1 once the engine is ready, 0 while compiling or stopped.", registry=r
        )
        self.startup = Gauge(
            "jaxllm_startup_seconds", "From the server's start to its engine's readiness (loading the params and "
            "compiling every step, or reading them from the compilation cache).", registry=r,
        )  # fmt: skip
        labels = {"model_name": model_name, "engine": "0"}

        def vllm(kind, name: str, documentation: str, **kwargs):
            return kind(name, documentation, VLLM_LABELS, registry=r, **kwargs).labels(**labels)

        self.vllm_time_to_first_token = vllm(
            Histogram, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            buckets=VLLM_TTFT,
        )  # fmt: skip
        self.vllm_inter_token_latency = vllm(
            Histogram, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            buckets=VLLM_ITL,
        )  # fmt: skip
        self.vllm_queue_time = vllm(
            Histogram, "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
            buckets=VLLM_REQUEST,
        )  # fmt: skip
        self.vllm_kv_cache_usage = vllm(Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.spec_acceptance = Gauge(
            "jaxllm_spec_acceptance_rate", "Of the tokens speculative decoding proposed since start, the fraction "
            "the model accepted.", registry=r,
        )  # fmt: skip
        self.spec_held_back = Gauge(
            "jaxllm_spec_held_back_steps", "Decode steps since start in which the engine took a plain step where "
            "sequences had drafts (serve.speculative_auto): a verify step would have yielded fewer tokens a "
            "second, or a plain step was still to be timed.",
            registry=r,
        )  # fmt: skip
        self.vllm_spec_decode = _Totals(r, labels, {
            "vllm:spec_decode_num_drafts": "Number of spec decoding drafts.",
            "vllm:spec_decode_num_draft_tokens": "Number of draft tokens.",
            "vllm:spec_decode_num_accepted_tokens": "Number of accepted tokens.",
        })  # fmt: skip
        self.vllm_prefix_cache = _Totals(r, labels, {
            "vllm:prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
            "vllm:prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
        })  # fmt: skip

    def first_token(self, seconds: float) -> None:
        """From a request's arrival to its first token."""
        self.time_to_first_token.observe(seconds)
        self.vllm_time_to_first_token.observe(seconds)

    def decoded(self, tokens: int, seconds: float) -> None:
        """A choice's `tokens` (more than one), the last `seconds` after the first: their mean gap is
        ours once, and vLLM's inter-token latency once per gap (so its count and sum are vLLM's; the
        engine keeps no time per token, so every gap of a choice falls in its mean's bucket)."""
        gap = seconds / (tokens - 1)
        self.time_per_output_token.observe(gap)
        for _ in range(tokens - 1):
            self.vllm_inter_token_latency.observe(gap)

    def queued(self, seconds: float) -> None:
        """From a request's arrival to its first admission to a slot."""
        self.vllm_queue_time.observe(seconds)

    def engine(self, stats: Stats) -> None:
        """The engine's state now. The prefix cache's totals since start: ours in full prompt
        pages, vLLM's in tokens (a page's worth for each)."""
        self.queue_depth.set(stats.queued)
        self.active_slots.set(stats.active_slots)
        self.kv_pages_cached.set(stats.cached_pages)
        self.preemptions.set(stats.preemptions)
        self.engine_restarts.set(stats.restarts)
        self.decode_bandwidth.set(stats.bandwidth_use)
        self.kv_cache_usage.set(stats.cache_usage)
        self.vllm_kv_cache_usage.set(stats.cache_usage)
        hits, misses = stats.prefix_hits, stats.prefix_misses
        self.prefix_cache_hits.set(hits)
        self.prefix_cache_misses.set(misses)
        self.vllm_prefix_cache.set("vllm:prefix_cache_queries", (hits + misses) * stats.page_size)
        self.vllm_prefix_cache.set("vllm:prefix_cache_hits", hits * stats.page_size)
        self.spec_acceptance.set(stats.accepted_tokens / max(stats.draft_tokens, 1))
        self.spec_held_back.set(stats.held_back)
        for name, total in (("drafts", stats.drafts), ("draft_tokens", stats.draft_tokens),
                            ("accepted_tokens", stats.accepted_tokens)):  # fmt: skip
            self.vllm_spec_decode.set(f"vllm:spec_decode_num_{name}", total)
