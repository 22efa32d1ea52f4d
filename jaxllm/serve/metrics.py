"""The HTTP server's Prometheus metrics, in a registry of its own (one per server)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self, slots: int):
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
        self.engine_up = Gauge(
            "jaxllm_engine_up", "1 once the engine is ready, 0 while compiling or stopped.", registry=r
        )
