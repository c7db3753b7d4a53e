"""Prometheus metrics of one server, in a registry of its own (no process-global state)."""

from __future__ import annotations

from typing import Any

from specpilot.engine import AcceptanceStats


class ServerMetrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.submitted = Counter(
            "specpilot_submitted_requests",
            "Generations handed to the engine (each ends completed, cancelled or failed)",
            registry=r,
        )
        self.abandoned = Counter(
            "specpilot_abandoned_requests",
            "Requests whose client went away before their body was read (never generated)",
            registry=r,
        )
        self.requests = Counter("specpilot_requests", "Completed generations", registry=r)
        self.cancelled = Counter(
            "specpilot_cancelled_requests", "Generations cancelled by the client", registry=r
        )
        self.cancel_delay_steps = Histogram(
            "specpilot_cancel_delay_steps",
            "Engine steps that ran between a client going away and its request being dropped "
            "(at most 1: the step running when it went)",
            buckets=(0, 1, 2, 4, 8, 16, 64),
            registry=r,
        )
        self.failed = Counter(
            "specpilot_failed_requests",
            "Generations ended by an error (a failed step, or shutdown before they ran)",
            registry=r,
        )
        self.tokens = Counter("specpilot_generated_tokens", "Committed tokens served", registry=r)
        self.seconds = Counter(
            "specpilot_generation_seconds", "Engine time spent generating", registry=r
        )
        self.cycles = Counter("specpilot_verify_cycles", "Target verify forwards", registry=r)
        self.committed = Counter(
            "specpilot_committed_tokens", "Tokens committed by verify forwards", registry=r
        )
        self.step_seconds = Counter(
            "specpilot_engine_step_seconds", "Engine thread time inside scheduler steps", registry=r
        )
        self.host_seconds = Counter(
            "specpilot_engine_host_seconds",
            "Engine thread time between steps while it has work (admission, streaming, audits)",
            registry=r,
        )

        def rows(name: str, doc: str) -> Histogram:  # requests per scheduler step
            return Histogram(name, doc, buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)

        self.step_rows = rows("specpilot_step_rows", "Requests decoding in a scheduler step")
        self.prefill_rows = rows(
            "specpilot_prefill_rows",
            "Requests that fed a prompt segment in a scheduler step (a wave's arrivals admitted "
            "together)",
        )
        self.prefill_forwards = Counter(
            "specpilot_prefill_forwards",
            "Target forwards that fed prompt segments (new prompts are packed, up to a token "
            "budget, into one)",
            registry=r,
        )

        # seconds from a job's hand-over to the engine thread (``EngineWorker.submit``)
        def latency(name: str, doc: str) -> Histogram:
            fine = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.05, 0.075, 0.1)
            buckets = (*fine, 0.15, 0.25, 0.5, 1, 2.5, 10)
            return Histogram(name, doc, buckets=buckets, registry=r)

        self.time_to_first_token = latency(
            "specpilot_time_to_first_token_seconds",
            "From a job's hand-over to the engine thread to its first committed token",
        )
        self.time_to_first_text = latency(
            "specpilot_time_to_first_text_seconds",
            "From a job's hand-over to its first final text, sent then when streamed (tokens "
            "that decode to no text, a partial character or a stop string's start come later)",
        )
        self.prefill_step_seconds = latency(
            "specpilot_prefill_step_seconds",
            "Scheduler steps that fed prompt tokens: the prefill forward and one decode step",
        )
        self.queue_depth = Gauge(
            "specpilot_queue_depth", "Requests waiting for the engine", registry=r
        )
        self.mean_accepted_len = Gauge(
            "specpilot_mean_accepted_length",
            "Committed tokens per verify forward since start, bonus token included",
            registry=r,
        )
        self.tokens_per_second = Gauge(
            "specpilot_tokens_per_second", "Served tokens over engine time", registry=r
        )
        self.acceptance = Gauge(
            "specpilot_acceptance_rate",
            "Acceptance rate by draft position (1-based)",
            ["position"],
            registry=r,
        )
        self.audited = Counter(
            "specpilot_audit_sequences", "Responses token-forced in the background", registry=r
        )
        self.audit_matches = Counter(
            "specpilot_audit_match_tokens", "Audited tokens equal to the argmax", registry=r
        )
        self.audit_near_ties = Counter(
            "specpilot_audit_near_tie_tokens", "Audited near-tie tokens", registry=r
        )
        self.audit_mismatches = Counter(
            "specpilot_audit_mismatch_tokens", "Audited mismatching tokens", registry=r
        )
        self._stats = AcceptanceStats()

    def observe(self, stats: AcceptanceStats) -> None:
        self._stats.merge(stats)
        self.cycles.inc(stats.cycles)
        self.committed.inc(stats.committed)
        self.mean_accepted_len.set(self._stats.mean_accepted_len)
        for i, rate in enumerate(self._stats.acceptance_rates()):
            self.acceptance.labels(position=str(i + 1)).set(rate)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        secs = self.seconds._value.get()
        if secs > 0:
            self.tokens_per_second.set(self.tokens._value.get() / secs)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def value(self, name: str, **labels: str) -> Any:
        """A sample's current value by its exposed name and labels (tests and /health)."""
        return self.registry.get_sample_value(name, labels)
