"""The server's Prometheus metrics, each name with its unit (vLLM's set where it has one)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
UNMATCHED = "unmatched"  # the one `route` label every path without a route shares


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("verispec_requests_total", "HTTP requests by route template and status",
                                ["route", "status"], registry=r)
        self.tokens = Counter("verispec_generated_tokens_total", "tokens generated (counted each round)", registry=r)
        self.tokens_after_cancel = Counter(
            "verispec_generated_after_cancel_tokens_total",
            "tokens of rounds that ran after their request was cancelled (at most one round each)", registry=r)
        self.cancelled = Counter("verispec_cancelled_requests_total", "requests cancelled (client gone)", registry=r)
        self.drafted = Counter("verispec_drafted_tokens_total", "draft tokens proposed", registry=r)
        self.accepted = Counter("verispec_accepted_tokens_total", "draft tokens accepted", registry=r)
        self.acceptance_length = Histogram(
            "verispec_acceptance_length_tokens", "tokens committed per verification round (accepted + 1)",
            buckets=(1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 17, 33), registry=r)
        self.time_per_token = Histogram(
            "verispec_time_per_output_token_seconds", "decoding time per output token after the first (no prefill)",
            buckets=TOKEN_TIME_BUCKETS, registry=r)
        self.time_to_first_token = Histogram(
            "verispec_time_to_first_token_seconds",
            "from submission (after tokenisation) to the first generated token: queue + prefill",
            buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("verispec_e2e_request_latency_seconds", "from submission to the last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("verispec_request_queue_time_seconds", "time waiting for the model",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.waiting = Gauge("verispec_num_requests_waiting", "requests waiting for the model", registry=r)
        self.running = Gauge("verispec_num_requests_running", "requests the model is generating for", registry=r)
        self.in_progress = Gauge("verispec_http_requests_in_progress", "generation requests being answered",
                                 registry=r)
