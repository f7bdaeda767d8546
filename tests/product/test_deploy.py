"""``deploy/``: the Prometheus alert rules and the Grafana dashboard name only metrics (and labels)
that consumer-kit exports (``consumer_kit/telemetry/metrics.py``, as the Prometheus exporter names
them: ``tests/telemetry/test_metrics_endpoint.py`` checks that mapping against a real scrape)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from consumer_kit.telemetry.metrics import CATALOGUE, prometheus_series

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
NAME = re.compile(r"\b(?:consumer_kit|outbox_relay)_[a-z0-9_]+\b")
LABELS = {key.replace(".", "_") for spec in CATALOGUE for key in spec.attributes}


def names_in(expr: str) -> set[str]:
    return set(NAME.findall(expr))


def unknown(expressions: list[str]) -> set[str]:
    """Names in ``expressions`` that are neither an exported series nor an exported label."""
    return {n for e in expressions for n in names_in(e)} - prometheus_series() - LABELS


def test_alert_rules_load_and_name_only_exported_metrics() -> None:
    rules = yaml.safe_load((DEPLOY / "prometheus-alerts.yml").read_text())
    alerts = {rule["alert"]: rule for group in rules["groups"] for rule in group["rules"]}
    for wanted in ("ConsumerKitStuckProcessing", "ConsumerKitReconciliationWaiting", "ConsumerKitOutboxLag",
                   "ConsumerKitDuplicateRateRising", "ConsumerKitWorkerPaused"):
        assert wanted in alerts
    expressions = [rule["expr"] for rule in alerts.values()]
    assert unknown(expressions) == set()
    assert all(names_in(e) & prometheus_series() for e in expressions)  # each alert reads a metric
    assert all(rule["annotations"]["summary"] and rule["labels"]["severity"] for rule in alerts.values())


def test_dashboard_parses_and_names_only_exported_metrics() -> None:
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    expressions = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(expressions) >= 10
    assert unknown(expressions) == set()
    used = {n for e in expressions for n in names_in(e)} & prometheus_series()
    bases = {re.sub(r"_(bucket|sum|count|total)$", "", n) for n in used}
    for spec in CATALOGUE:  # every metric has a panel
        assert re.sub(r"_(bucket|sum|count|total)$", "", spec.prometheus_names[0]) in bases, spec.name


def test_a_misspelt_metric_is_caught() -> None:
    assert unknown(["rate(consumer_kit_duplicate_total[5m])"]) == {"consumer_kit_duplicate_total"}
