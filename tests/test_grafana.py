"""The Grafana dashboard and Prometheus configuration as shipped: they parse, and every metric the
dashboard queries is one that a live chatd exports."""

import asyncio
import json
import re
import urllib.request
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from chatd.api.server import ChatServer
from chatd.config import Settings

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy/grafana/dashboards/chatd.json"


def queries(dashboard: dict) -> list[str]:
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    exprs += [variable["query"]["query"] for variable in dashboard["templating"]["list"]]
    return exprs


async def test_every_metric_the_dashboard_queries_is_exported(tiny):
    dashboard = json.loads(DASHBOARD.read_text())
    wanted = {name for expr in queries(dashboard) for name in re.findall(r"chatd:[a-z0-9_]+", expr)}
    titles = {panel["title"] for panel in dashboard["panels"]}
    assert {"Time to first token", "Inter-token latency", "Tokens per second", "KV cache tier usage",
            "Evictions", "Corruptions caught", "Running and waiting turns"} <= titles
    assert len(wanted) >= 15
    async with ChatServer(Settings(port=0), load=lambda: tiny) as server:
        await server.wait_ready()
        with await asyncio.to_thread(urllib.request.urlopen, f"http://127.0.0.1:{server.port}/metrics") as response:
            text = response.read().decode()
    exported = {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}
    assert wanted <= exported, sorted(wanted - exported)
    for expr in queries(dashboard):  # brackets balance: a typo would leave a panel empty
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr


def test_prometheus_and_grafana_are_provisioned():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for service in ("prometheus", "grafana"):
        for volume in compose[service]["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), source
    scrape = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())["scrape_configs"][0]
    assert scrape["metrics_path"] == "/metrics"
    workers = {name for name, service in compose.items() if name.startswith("chatd-")}
    assert {target.split(":")[0] for target in scrape["static_configs"][0]["targets"]} == workers
    datasource = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = datasource["datasources"][0]["uid"]
    dashboard = json.loads(DASHBOARD.read_text())
    assert all(panel["datasource"]["uid"] == uid for panel in dashboard["panels"])
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/chatd.yml").read_text())
    mounted = dict(volume.split(":")[:2][::-1] for volume in compose["grafana"]["volumes"])
    assert mounted[provider["providers"][0]["options"]["path"]] == "./deploy/grafana/dashboards"
