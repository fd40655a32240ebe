"""The shipped Grafana dashboard and Prometheus rules parse, and every wsinfer series
they query is one the frontend or an engine actually exports (a renamed metric
must not leave a dashboard silently blank)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from wsinfer.engine.fake import FakeSpec, fake_engine
from wsinfer.engine.metrics import EngineMetrics
from wsinfer.metrics import Metrics

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
SERIES = re.compile(r"\b(wsinfer_[a-z0-9_]+|process_[a-z0-9_]+|up)\b")


def exported_names() -> set[str]:
    engine = EngineMetrics(engine_id="x")
    core, _ = fake_engine("fake:1", type("C", (), {"max_batch_size": 1, "kv_cache_bytes": 1})())
    assert isinstance(core.spec, FakeSpec)
    engine.attach(core, "m", "cpu")
    names = {"up"}
    for registry in (Metrics().registry, engine.registry):
        for family in registry.collect():
            base = family.name
            names |= {base, f"{base}_total", f"{base}_bucket", f"{base}_sum", f"{base}_count"}
    # Only exported on a CUDA engine.
    names |= {f"wsinfer_engine_gpu_memory_{k}_bytes" for k in ("allocated", "reserved", "total")}
    return names


def dashboard() -> dict[str, Any]:
    return dict(json.loads((DEPLOY / "grafana" / "wsinfer.json").read_text()))


def alert_rules() -> list[dict[str, Any]]:
    data = yaml.safe_load((DEPLOY / "prometheus" / "wsinfer-alerts.yml").read_text())
    return [rule for group in data["groups"] for rule in group["rules"]]


def test_the_dashboard_queries_only_exported_series() -> None:
    exprs = [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    used = {name for expr in exprs for name in SERIES.findall(expr)}
    assert used - exported_names() == set()
    # The asks are all on it.
    for wanted in (
        "wsinfer_engine_requests_running", "wsinfer_engine_batch_size_bucket",
        "wsinfer_engine_step_duration_seconds_bucket", "wsinfer_engine_prompt_tokens_total",
        "wsinfer_engine_kv_cache_used_bytes", "wsinfer_engine_kv_cache_lookups_total",
        "wsinfer_engine_takeovers_total", "wsinfer_e2e_turn_latency_seconds_bucket",
        "wsinfer_refusals_total", "wsinfer_send_queue_max_bytes",
        "wsinfer_redis_rtt_seconds_bucket",
    ):  # fmt: skip
        assert wanted in used, wanted


def test_dashboard_panels_are_well_formed() -> None:
    board = dashboard()
    assert board["uid"] and board["title"] == "wsinfer"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        refs = [t["refId"] for t in panel.get("targets", [])]
        assert len(refs) == len(set(refs))


def test_alert_rules_are_complete_and_query_exported_series() -> None:
    rules = alert_rules()
    assert len(rules) >= 8
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for rule in rules:
        assert rule["labels"]["severity"] in ("info", "warning", "critical")
        assert rule["annotations"]["summary"]
        assert set(SERIES.findall(rule["expr"])) - exported_names() == set(), rule["alert"]
        assert rule["expr"].count("(") == rule["expr"].count(")")
    assert any("saturat" in r["annotations"]["summary"] or "Full" in r["alert"] for r in rules)


def test_the_scrape_config_names_the_jobs_the_rules_use() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    assert jobs == {"wsinfer-frontend", "wsinfer-engine"}
    used = {job for rule in alert_rules() for job in re.findall(r'job="([^"]+)"', rule["expr"])}
    assert used <= jobs


def test_the_docs_name_only_exported_series() -> None:
    """deploy/README.md and README.md tell operators what to graph and alert on."""
    root = DEPLOY.parent
    for doc in (DEPLOY / "README.md", root / "README.md"):
        named = {n for n in SERIES.findall(doc.read_text()) if not n.endswith("_")}
        assert named - exported_names() == set(), doc.name


def test_every_engine_manifest_serves_metrics_where_it_is_scraped() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    command = compose["services"]["engine"]["command"]
    port = command[command.index("--metrics-port") + 1]
    assert command[command.index("--metrics-host") + 1] == "0.0.0.0"
    assert port in compose["services"]["engine"]["expose"]
    statefulset = yaml.safe_load_all((DEPLOY / "k8s" / "engine.yaml").read_text())
    pod = next(d for d in statefulset if d["kind"] == "StatefulSet")["spec"]["template"]
    args = pod["spec"]["containers"][0]["args"]
    assert (
        args[args.index("--metrics-port") + 1]
        == pod["metadata"]["annotations"]["prometheus.io/port"]
    )
    assert args[args.index("--metrics-host") + 1] == "0.0.0.0"
