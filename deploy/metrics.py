"""Prometheus metrics of the serving app (GET /metrics), in a registry of its own, labelled by model.

Latencies are measured where the tokens reach the server (the ingress replica): time to first
token from the request's arrival, inter-token latency between consecutive tokens of a request.
Queue length, cache slot use and the prefix cache's are read from one Pipeline replica's coordinator when /metrics
is scraped (totals since the coordinator started are gauges: they are read, not counted here); counters of the
ingress (tokens, cached prompt tokens, routing decisions) cover every replica.
"""
from __future__ import annotations

import collections

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)
from prometheus_client.core import CounterMetricFamily

disable_created_metrics()      # no *_created series

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)
LATENCY_BUCKETS = (0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60, 120, 300)


# the families, each labelled by model (several models share one registry: deploy/http_app.py)
FAMILIES = [
    (Counter, "raymoe_prompt_tokens", "Prompt tokens processed", {}),
    (Counter, "raymoe_generation_tokens", "Tokens generated", {}),
    (Histogram, "raymoe_time_to_first_token_seconds", "From a request's arrival to its first token",
     {"buckets": TTFT_BUCKETS}),
    (Histogram, "raymoe_inter_token_latency_seconds", "Between consecutive tokens of a request",
     {"buckets": ITL_BUCKETS}),
    (Histogram, "raymoe_request_latency_seconds", "From a request's arrival to its last token",
     {"buckets": LATENCY_BUCKETS}),
    (Gauge, "raymoe_requests_in_flight", "Generations being served now", {}),
    (Gauge, "raymoe_queue_length", "Sequences waiting because every cache slot of their micro-batch group is taken",
     {}),
    (Gauge, "raymoe_queue_limit", "Bounded queue size; beyond it requests get 503 (-1: unbounded)", {}),
    (Gauge, "raymoe_sequences_waiting", "Sequences submitted and not yet scheduled", {}),
    (Gauge, "raymoe_cache_slots_used", "Sequences holding cache slots (running)", {}),
    (Gauge, "raymoe_cache_slots_total", "Sequences that can hold cache slots at once", {}),
    (Gauge, "raymoe_prefix_cache_bytes", "Bytes the prefix cache holds over all stages", {}),
    (Gauge, "raymoe_prefix_cache_budget_bytes", "The prefix cache's size over all stages (0: off)", {}),
    (Gauge, "raymoe_prefix_cache_hit_rate", "Share of looked-up prompt tokens a prefix cache hit skipped, since the "
     "server started", {}),
    (Gauge, "raymoe_prefix_cache_hit_tokens", "Prompt tokens skipped by prefix cache hits, since the server started",
     {}),
    (Gauge, "raymoe_prefill_tokens", "Prompt tokens run through the model, since the server started", {}),
    (Counter, "raymoe_prompt_tokens_cached", "Prompt tokens that a replica's prefix cache held (usage.cached_tokens), "
     "over all replicas: its ratio to raymoe_prompt_tokens is the hit rate that routing gives", {}),
    (Counter, "raymoe_spec_decode_draft_tokens", "Draft tokens sent (speculative decoding)", {}),
    (Counter, "raymoe_spec_decode_accepted_tokens", "Draft tokens the model accepted: over draft tokens, the "
     "acceptance rate", {}),
    (Counter, "raymoe_spec_decode_verify_steps", "Steps that verified drafts: 1 + accepted tokens over these is the "
     "mean accepted length", {}),
]


# the prefix routers' choices in this process (deploy/prefix_router.py): (deployment name, decision) -> requests;
# decision: "prefix" (followed a cached prefix), "balance" (its holder was too busy), "new" (no prefix held anywhere)
ROUTING_DECISIONS: collections.Counter = collections.Counter()


class RoutingDecisions:
    """raymoe_routing_decisions_total{model, decision}: ROUTING_DECISIONS, for the models of `deployments` ({Pipeline
    deployment name: model})."""

    def __init__(self, deployments: dict):
        self.deployments = deployments

    def collect(self):
        family = CounterMetricFamily("raymoe_routing_decisions", "Requests the prefix router sent on a cached prefix "
                                     "(prefix), past a too busy holder (balance), or with none held (new)",
                                     labels=["model", "decision"])
        for (deployment, decision), count in sorted(ROUTING_DECISIONS.items()):
            if deployment in self.deployments:
                family.add_metric([self.deployments[deployment], decision], count)
        yield family


def metric_families(deployments: dict | None = None) -> dict:
    """The metric families in a registry of their own ("registry"), for one model or several that share them;
    with the routing decisions of `deployments` ({Pipeline deployment name: model}) when given."""
    registry = CollectorRegistry()
    if deployments:
        registry.register(RoutingDecisions(deployments))
    families = {name: kind(name, doc, ["model"], registry=registry, **kw) for kind, name, doc, kw in FAMILIES}
    families["requests"] = Counter("raymoe_requests", "API requests answered, by endpoint and status code",
                                   ["model", "endpoint", "status"], registry=registry)
    families["finished"] = Counter("raymoe_requests_finished", "Generations ended, by finish reason (abort: the "
                                   "client went away or cancelled)", ["model", "finish_reason"], registry=registry)
    return {**families, "registry": registry}


class ServerMetrics:
    """One served model's metrics, in families of its own unless given some that other models share."""
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model: str, families: dict | None = None):
        f = families or metric_families()
        self.registry, self.requests, self.finished = f["registry"], f["requests"], f["finished"]
        (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.latency, self.in_flight,
         self.queue_length, self.queue_limit, self.waiting, self.slots_used, self.slots_total, self.prefix_bytes,
         self.prefix_budget, self.prefix_hit_rate, self.prefix_hit_tokens, self.prefill_tokens, self.cached_tokens,
         self.draft_tokens, self.accepted_tokens, self.verify_steps) = (
            f[name].labels(model=model) for _, name, _, _ in FAMILIES)
        self.model = model

    def answered(self, endpoint: str, status: int):
        self.requests.labels(model=self.model, endpoint=endpoint, status=str(status)).inc()

    def done(self, finish_reason: str, result: dict | None, elapsed: float):
        self.finished.labels(model=self.model, finish_reason=finish_reason or "unknown").inc()
        if result and "usage" in result:
            self.prompt_tokens.inc(result["usage"]["prompt_tokens"])
            self.generation_tokens.inc(result["usage"]["completion_tokens"])
            self.cached_tokens.inc(result["usage"].get("cached_tokens", 0))
            drafts = result["usage"].get("speculation")
            if drafts:
                self.draft_tokens.inc(drafts["draft_tokens"])
                self.accepted_tokens.inc(drafts["accepted_tokens"])
                self.verify_steps.inc(drafts["verify_steps"])
        self.latency.observe(elapsed)

    def set_load(self, load: dict):
        self.queue_length.set(load["queued"])
        self.queue_limit.set(-1 if load["max_queued"] is None else load["max_queued"])
        self.waiting.set(load["waiting"])
        self.slots_used.set(load["running"])
        self.slots_total.set(load["slots"])
        prefix = load["prefix_cache"]
        self.prefix_bytes.set(prefix["bytes"])
        self.prefix_budget.set(prefix["budget_bytes"])
        self.prefix_hit_rate.set(prefix["hit_rate"])
        self.prefix_hit_tokens.set(prefix["hit_tokens"])
        self.prefill_tokens.set(load["prefill_tokens"])

    def render(self) -> bytes:
        return generate_latest(self.registry)


def parse_metrics(text: str) -> dict[str, float]:
    """{"name{labels}": value} of a Prometheus text page (for tests and the benchmark)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
