"""deploy/monitoring/ (alert rules and the Grafana dashboard) names only metrics trserve exports: the
worker's families (WorkerMetrics, with the store and history collectors) and the matrix service's.
(No promtool here: the rules' shape is checked as Prometheus reads it, and every expression's metric
names against the registries.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from matrix_store import MatrixStore, StoreConfig
from services.matrix.metrics import StoreCollector
from services.worker.metrics import WorkerMetrics

yaml = pytest.importorskip("yaml")
MONITORING = Path(__file__).resolve().parents[3] / "deploy" / "monitoring"
NAME = re.compile(r"\b((?:trserve|process|python)_[a-z0-9_]+)")
SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created", "_info")


def exported() -> set[str]:
    metrics = WorkerMetrics()
    metrics.registry.register(StoreCollector(MatrixStore(StoreConfig())))
    names = set()
    for family in metrics.registry.collect():
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
        names.update(family.name + s for s in SUFFIXES)
    return names


def test_every_alert_is_well_formed_and_names_exported_metrics() -> None:
    rules = yaml.safe_load((MONITORING / "alerts.yaml").read_text())
    known, seen = exported(), 0
    for group in rules["groups"]:
        assert group["name"] and group["rules"]
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"} and rule["alert"] and rule["expr"]
            assert rule["labels"]["severity"] in ("info", "warning", "critical")
            assert re.fullmatch(r"\d+[smh]", rule.get("for", "0s"))
            assert rule["expr"].count("(") == rule["expr"].count(")"), rule["alert"]
            names = NAME.findall(rule["expr"])
            assert names and set(names) <= known, (rule["alert"], set(names) - known)
            seen += 1
    assert seen >= 6


def test_every_dashboard_panel_queries_exported_metrics() -> None:
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    known = exported()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            names = NAME.findall(target["expr"])
            assert names and set(names) <= known, (panel["title"], set(names) - known)
    titles = " ".join(p["title"] for p in dashboard["panels"])
    for what in ("first token", "per output token", "End-to-end", "Queue", "KV cache", "acceptance"):
        assert what in titles, what
