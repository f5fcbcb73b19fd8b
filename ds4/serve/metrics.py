"""Prometheus metrics of one server (its own registry, so two servers in a process never mix)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for app.py)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("ds4_requests", "HTTP API requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.queue_depth = Gauge("ds4_queue_depth", "Generations waiting for the engine", registry=r)
        self.running = Gauge("ds4_generations_running", "Generations on the engine now (0 or 1)",
                             registry=r)
        self.prompt_tokens = Counter("ds4_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=r)
        self.cached_tokens = Counter("ds4_cached_prompt_tokens",
                                     "Prompt tokens reused from the live session (not prefilled)",
                                     registry=r)
        self.generated_tokens = Counter("ds4_generated_tokens", "Tokens generated", registry=r)
        self.prefill_rate = Gauge("ds4_prefill_tokens_per_second",
                                  "Prefill speed of the last request that prefilled", registry=r)
        self.decode_rate = Gauge("ds4_decode_tokens_per_second",
                                 "Decode speed of the last request that generated", registry=r)
        self.cancelled = Counter("ds4_cancelled_generations",
                                 "Generations stopped because the client went away", registry=r)
        self.rejected = Counter("ds4_rejected_requests", "Requests refused with 429 (queue full)",
                                registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
