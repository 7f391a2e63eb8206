"""A real Prometheus (Debian's) scrapes a live chatd with the shipped configuration, and every query of
the shipped Grafana dashboard returns data once traffic has touched every panel."""

import asyncio
import json
import math
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from websockets.asyncio.client import connect

from chatd.api.server import ChatServer
from chatd.cli.client import ChatClient
from chatd.cli.server_process import free_port
from chatd.config import Settings

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy/grafana/dashboards/chatd.json"
PROMETHEUS = shutil.which("prometheus")
MODEL = "tiny-test"


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def post(url: str) -> int:
    with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=30) as response:
        return response.status


@pytest.fixture
def prometheus(tmp_path):
    """Start Debian's Prometheus on the shipped configuration, scraping `target` every second."""
    started = []

    def start(target: str) -> str:
        config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
        config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = "1s"
        config["scrape_configs"][0]["static_configs"] = [{"targets": [target]}]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        started.append(subprocess.Popen(
            [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return f"http://127.0.0.1:{port}"

    yield start
    for process in started:
        process.terminate()
        process.wait(10)


async def scraped(base: str, timeout_s: float = 30.0) -> None:
    """Wait until Prometheus has scraped the target successfully."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            targets = (await asyncio.to_thread(get_json, f"{base}/api/v1/targets"))["data"]["activeTargets"]
            if targets and targets[0]["health"] == "up":
                return
        except OSError:
            pass
        await asyncio.sleep(0.25)
    raise AssertionError("Prometheus never scraped chatd")


def panel_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel["targets"]]


@pytest.mark.skipif(PROMETHEUS is None, reason="Debian's prometheus package is not installed")
async def test_every_dashboard_query_returns_data_from_a_real_prometheus(tiny, prometheus, redis_with_replica):
    primary, _ = redis_with_replica  # (sessions in Redis, each turn acknowledged once the replica holds it)
    settings = Settings(port=0, model=MODEL, enable_fault_injection=True, verify_sample_rate=0.0,
                        redis_url=primary.url)
    async with ChatServer(settings, load=lambda: tiny) as server:
        await server.wait_ready()
        base = prometheus(f"127.0.0.1:{server.port}")
        await scraped(base)
        await asyncio.sleep(1.5)  # a scrape before any traffic: every rate below starts from it
        async with ChatClient(await connect(server.url)) as client:
            # Two customers saying the same: the second's replies are drafted from the first's, and accepted.
            a, b = [(await client.open_session(system="Be brief.")).session_id for _ in range(2)]
            for text in ("My order is late.", "It was order 1234.", "Any news?"):
                for session_id in (a, b):
                    server.engine.offload_idle()  # evictions and offloads; the next turn restores
                    await (await client.chat(session_id, text, max_new_tokens=6)).result()
            corrupt = f"http://127.0.0.1:{server.port}/admin/sessions/{a}/corrupt?kind=bitflip&tier=host"
            assert await asyncio.to_thread(post, corrupt) == 200  # b's last turn offloaded a's cache
            await (await client.chat(a, "Still there?", max_new_tokens=6)).result()  # a corruption caught
            async with connect(server.url) as raw:
                await raw.send("{not json")  # an error sent
                await raw.recv()
            await asyncio.sleep(3)  # scraped after the traffic
            empty = []
            for title, expr in panel_queries():
                query = expr.replace('=~"$model"', f'="{MODEL}"').replace("$__rate_interval", "1m")
                answer = await asyncio.to_thread(
                    get_json, f"{base}/api/v1/query?query={urllib.parse.quote(query)}")
                assert answer["status"] == "success", (title, query, answer)
                values = [float(sample["value"][1]) for sample in answer["data"]["result"]]
                if not values or all(math.isnan(value) for value in values):
                    empty.append((title, query))
            assert not empty, empty
