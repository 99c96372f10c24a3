"""`OperatorMetrics`: what the operator did, for Prometheus."""

from __future__ import annotations

from bij.control.decisions import Decision


class OperatorMetrics:
    """What the operator did, for Prometheus (served with --metrics-port or env BIJ_METRICS_PORT)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry()
        self.decisions = Counter("bij_operator_decisions", "Reconcile decisions applied, by kind",
                                 ["decision"], registry=self.registry)
        self.tracked = Gauge("bij_operator_tracked_jobs", "BatchInferenceJobs this process follows",
                             registry=self.registry)

    def decided(self, d: Decision) -> None:
        self.decisions.labels(type(d).__name__).inc()

    def serve(self, port: int) -> None:
        from prometheus_client import start_http_server

        start_http_server(port, registry=self.registry)
