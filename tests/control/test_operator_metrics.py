"""The operator's Prometheus endpoint serves what it decided."""

from __future__ import annotations

import urllib.request

from ports import free_port

from bij.control.operator import parse_args
from bij.control.operator_metrics import OperatorMetrics


def test_metrics_endpoint_counts_decisions_by_kind() -> None:
    metrics = OperatorMetrics()
    metrics.decisions.labels("CreateJob").inc()
    metrics.decisions.labels("Publish").inc(2)
    port = free_port()
    metrics.serve(port)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'bij_operator_decisions_total{decision="CreateJob"} 1.0' in text
    assert 'bij_operator_decisions_total{decision="Publish"} 2.0' in text
    assert "bij_operator_tracked_jobs" in text


def test_metrics_port_comes_from_the_flag_or_the_chart_env(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("BIJ_METRICS_PORT", raising=False)
    assert parse_args([]).metrics_port is None
    assert parse_args(["--metrics-port", "9401"]).metrics_port == 9401
    monkeypatch.setenv("BIJ_METRICS_PORT", "9402")
    assert parse_args([]).metrics_port == 9402
