"""deploy/monitoring/ (alert rules and the Grafana dashboard) names only metrics trserve exports: the
worker's families (WorkerMetrics, with the store and history collectors) and the matrix service's.
The rules' shape and every expression's metric names are checked against the registries, and
Prometheus' own `promtool check rules` parses them (`make test` fetches promtool)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from trserve.matrix_store import MatrixStore, StoreConfig
from trserve.services.matrix.metrics import StoreCollector
from trserve.services.worker.metrics import WorkerMetrics

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


def test_the_alert_rules_pass_promtool_and_a_broken_rule_does_not(promtool: str, tmp_path: Path) -> None:
    rules = MONITORING / "alerts.yaml"
    count = sum(len(g["rules"]) for g in yaml.safe_load(rules.read_text())["groups"])
    ok = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and f"SUCCESS: {count} rules found" in ok.stdout, ok.stdout + ok.stderr
    # the check can fail: the same file with one expression cut short
    broken = tmp_path / "alerts.yaml"
    text = rules.read_text()
    first = yaml.safe_load(text)["groups"][0]["rules"][0]["expr"].strip().splitlines()[0]
    broken.write_text(text.replace(first, first + " > (", 1))
    bad = subprocess.run([promtool, "check", "rules", str(broken)], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0, bad.stdout
