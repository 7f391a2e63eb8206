"""The Kubernetes deployment (`deploy/k8s/`): every overlay renders with `kubectl kustomize`, every object is valid
against the Kubernetes schemas (kubernetes-validate, offline and strict: an unknown field is an error) and a broken
manifest is refused; and the values that matter hold: the probes answer on a real server, the drain covers the
longest stream, the memory covers the KV budgets, the ingress hashes on the session id the gateway routes by."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import httpx
import kubernetes_validate
import pytest
import yaml

from chatd.api.server import ChatServer
from chatd.config import Settings

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ["base", "overlays/gpu", "overlays/external-redis", "overlays/autoscaling", "overlays/monitoring"]
KUBERNETES = "1.30.0"  # the oldest release still supported upstream when this was written
SLOWEST_TOKENS_PER_S = 12  # SmolLM2 on two CPU cores, one customer, on this machine's slow days (docs/benchmarks.md)
OPERATOR_KINDS = {"ServiceMonitor"}  # custom resources: no Kubernetes schema; their fields are checked below

needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None,
                                   reason="kubectl (with its kustomize) is not installed: the manifests cannot render")


def render(folder: Path) -> list[dict]:
    done = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [document for document in yaml.safe_load_all(done.stdout) if document]


def by_kind(objects: list[dict]) -> dict[str, list[dict]]:
    kinds: dict[str, list[dict]] = {}
    for document in objects:
        kinds.setdefault(document["kind"], []).append(document)
    return kinds


def worker_of(objects: list[dict]) -> dict:
    """The worker Deployment's container."""
    deployment = next(d for d in objects if d["kind"] == "Deployment" and d["metadata"]["name"] == "chatd")
    return deployment["spec"]["template"]["spec"]["containers"][0]


def config_of(objects: list[dict]) -> dict[str, str]:
    return next(d for d in objects if d["kind"] == "ConfigMap")["data"]


def validate(objects: list[dict]) -> None:
    for document in objects:
        if document["kind"] not in OPERATOR_KINDS:
            kubernetes_validate.validate(document, KUBERNETES, strict=True)


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_and_every_object_is_valid(overlay):
    objects = render(K8S / overlay)
    validate(objects)
    kinds = by_kind(objects)
    assert {"Deployment", "Service", "PodDisruptionBudget", "Ingress", "ConfigMap"} <= set(kinds)
    assert all(document["metadata"]["labels"]["app.kubernetes.io/part-of"] == "chatd" for document in objects)
    selector = next(d for d in kinds["PodDisruptionBudget"])["spec"]["selector"]["matchLabels"]
    pod_labels = next(d for d in kinds["Deployment"])["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items(), "the disruption budget covers the workers"


@needs_kubectl
def test_a_broken_manifest_is_refused(tmp_path):
    """A copy of the base with a misspelt probe and a port as a word: the schemas refuse both."""
    broken = tmp_path / "base"
    shutil.copytree(K8S / "base", broken)
    worker = broken / "worker.yaml"
    worker.write_text(worker.read_text().replace("readinessProbe:", "readinesProbe:", 1))
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        validate(render(broken))
    worker.write_text(worker.read_text().replace("readinesProbe:", "readinessProbe:", 1)
                      .replace("containerPort: 8765", "containerPort: eighty", 1))
    with pytest.raises(kubernetes_validate.ValidationError, match="eighty"):
        validate(render(broken))


@needs_kubectl
async def test_the_probes_answer_on_a_real_server(tiny):
    """Each probe's path and port, asked of a real server: the startup and liveness probes and readiness answer 200
    once the model is loaded; readiness answers 503 while the session store (Redis) cannot be reached."""
    container = worker_of(render(K8S / "base"))
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    assert config_of(render(K8S / "base"))["CHATD_PORT"] == str(port)
    probes = {name: container[name]["httpGet"] for name in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert all(probe["port"] == "http" for probe in probes.values())
    assert probes["readinessProbe"]["path"] == "/readyz" and probes["startupProbe"]["path"] == "/healthz"
    async with ChatServer(Settings(port=0, model="tiny-test"), load=lambda: tiny) as server:
        await server.wait_ready()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as http:
            for name, probe in probes.items():
                answer = await http.get(probe["path"])
                assert answer.status_code == 200, (name, answer.text)
    unreachable = Settings(port=0, model="tiny-test", redis_url="redis://127.0.0.1:1/0")
    async with ChatServer(unreachable, load=lambda: tiny) as server:
        await server.wait_ready()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as http:
            assert (await http.get("/healthz")).status_code == 200
            ready = await http.get(probes["readinessProbe"]["path"])
            assert ready.status_code == 200, "a Redis outage does not take every pod out of the Service"
            assert (await http.get(probes["livenessProbe"]["path"])).status_code == 200, "alive: not restarted"


@needs_kubectl
def test_the_drain_covers_the_longest_stream():
    """Grace period ≥ preStop + the server's drain + the store's flush; the drain ≥ the longest reply the
    configuration allows, streamed at the slowest rate measured."""
    objects = render(K8S / "base")
    pod = next(d for d in objects if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    container, config = worker_of(objects), config_of(objects)
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    drain_s = float(config["CHATD_SHUTDOWN_TIMEOUT_S"])
    assert pod["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + drain_s + 10
    longest = int(config.get("CHATD_MAX_NEW_TOKENS", Settings().max_new_tokens))
    assert drain_s >= longest / SLOWEST_TOKENS_PER_S


@needs_kubectl
def test_the_workers_memory_covers_their_kv_budgets_and_they_run_as_the_images_user():
    for overlay, device_on_host in (("base", True), ("overlays/gpu", False)):
        objects = render(K8S / overlay)
        container, config = worker_of(objects), config_of(objects)
        budgets_mb = float(config["CHATD_HOST_CACHE_MB"]) + (float(config["CHATD_DEVICE_CACHE_MB"])
                                                              if device_on_host else 0)
        assert _gib(container["resources"]["requests"]["memory"]) * 1024 >= budgets_mb + 1024, overlay
        assert _gib(container["resources"]["limits"]["memory"]) >= _gib(container["resources"]["requests"]["memory"])
        pod = next(d for d in objects if d["kind"] == "Deployment")["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] and pod["topologySpreadConstraints"]
        uid = re.search(r"useradd .*--uid (\d+)", (ROOT / "Dockerfile").read_text()).group(1)
        assert pod["securityContext"]["runAsUser"] == int(uid)
    gpu = worker_of(render(K8S / "overlays/gpu"))
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1 and config_of(
        render(K8S / "overlays/gpu"))["CHATD_DEVICE"] == "cuda"


def _gib(quantity: str) -> float:
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)(Gi|Mi)", quantity).groups()
    return float(number) / (1024 if unit == "Mi" else 1)


@needs_kubectl
def test_requests_naming_no_session_spread_by_load_and_sessions_stay_on_their_pod():
    """No Ingress hashes on a key that can be empty (every stateless client on one pod): requests that name no session
    are balanced by load; a request with X-Session-Id (the header the OpenAI API reads) reaches a canary hashed on it
    alone; websockets hash on ?session_id= and the client's address (new sockets spread by client). Each hashes on a
    Service of its own over the same pods; streams and websockets are neither buffered nor cut."""
    objects = render(K8S / "base")
    ingresses = {ingress["metadata"]["name"]: ingress for ingress in by_kind(objects)["Ingress"]}
    services = {service["metadata"]["name"]: service for service in by_kind(objects)["Service"]}
    annotations = {name: ingress["metadata"]["annotations"] for name, ingress in ingresses.items()}
    prefix = "nginx.ingress.kubernetes.io/"
    assert f"{prefix}upstream-hash-by" not in annotations["chatd"]
    assert annotations["chatd"][f"{prefix}load-balance"] == "ewma"
    pinned = annotations["chatd-sessions"]
    assert pinned[f"{prefix}canary"] == "true" and pinned[f"{prefix}canary-by-header"] == "X-Session-Id"
    assert pinned[f"{prefix}canary-by-header-pattern"] == ".+", "only requests that carry a session id"
    assert pinned[f"{prefix}upstream-hash-by"] == "$http_x_session_id"
    assert annotations["chatd-websocket"][f"{prefix}upstream-hash-by"] == "$arg_session_id$remote_addr"
    websocket_path = ingresses["chatd-websocket"]["spec"]["rules"][0]["http"]["paths"][0]
    assert websocket_path["path"] == "/ws" and websocket_path["pathType"] == "Exact"
    backends = set()
    for name, ingress in ingresses.items():
        for timeout in ("proxy-read-timeout", "proxy-send-timeout"):  # a Responses WebSocket's hour, then its drain
            assert int(annotations[name][f"{prefix}{timeout}"]) > Settings().responses_ws_max_age_s
        assert annotations[name][f"{prefix}proxy-buffering"] == "off"
        backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
        service = services[backend["name"]]
        assert service["spec"]["selector"] == services["chatd-workers"]["spec"]["selector"]
        assert backend["port"]["name"] in {port["name"] for port in service["spec"]["ports"]}
        backends.add(backend["name"])
    assert len(backends) == 3, "ingress-nginx balances per Service: one each"
    shipped = (ROOT / "deploy/nginx/chatd.conf").read_text()  # (compose's nginx: the same rule, with a map)
    assert re.search(r"map \$chatd_session_key \$chatd_upstream \{\s*''\s*chatd_balanced;", shipped)


@needs_kubectl
def test_external_redis_reads_its_url_from_a_secret_and_runs_no_redis():
    objects = render(K8S / "overlays/external-redis")
    assert "StatefulSet" not in by_kind(objects) and "CHATD_REDIS_URL" not in config_of(objects)
    env = {item["name"]: item for item in worker_of(objects)["env"]}
    assert env["CHATD_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "chatd-redis", "key": "url"}
    base = render(K8S / "base")
    redis_url = config_of(base)["CHATD_REDIS_URL"]
    statefulset = by_kind(base)["StatefulSet"][0]
    assert redis_url.startswith(f"redis://{statefulset['metadata']['name']}-0.{statefulset['spec']['serviceName']}:")


@needs_kubectl
def test_the_autoscaler_and_the_service_monitor_target_the_workers():
    objects = render(K8S / "overlays/autoscaling")
    autoscaler = by_kind(objects)["HorizontalPodAutoscaler"][0]["spec"]
    assert autoscaler["scaleTargetRef"]["name"] == "chatd" and autoscaler["minReplicas"] >= 2
    rules = yaml.safe_load((K8S / "overlays/autoscaling/prometheus-adapter-rules.yaml").read_text())
    rule = rules["rules"]["custom"][0]
    assert autoscaler["metrics"][0]["pods"]["metric"]["name"] == rule["name"]["as"]
    exported = rule["seriesQuery"].split("{")[0]
    assert f'"{exported}"' in (ROOT / "chatd/observability/metrics.py").read_text(), "a metric chatd exports"
    objects = render(K8S / "overlays/monitoring")
    monitor = by_kind(objects)["ServiceMonitor"][0]["spec"]
    headless = next(d for d in objects if d["kind"] == "Service" and d["spec"].get("clusterIP") == "None"
                    and d["metadata"]["name"] == "chatd-workers")
    assert monitor["selector"]["matchLabels"].items() <= headless["metadata"]["labels"].items()
    assert monitor["endpoints"][0]["port"] in {port["name"] for port in headless["spec"]["ports"]}
    assert monitor["endpoints"][0]["path"] == "/metrics"


@needs_kubectl
def test_redis_evicts_caches_before_its_memory_limit_in_the_manifests_and_compose():
    """The Redis that holds every worker's KV caches is bounded below its container's memory limit and evicts what
    expires soonest (caches, an hour, before sessions, a week): never OOM-killed into an append-only-file replay
    loop. (`test_remote_kv` fills a Redis so configured past its limit.)"""
    redis = next(d for d in render(K8S / "base") if d["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    container = redis["containers"][0]
    args = container["args"]
    maxmemory = args[args.index("--maxmemory") + 1]
    assert args[args.index("--maxmemory-policy") + 1] == "volatile-ttl"
    limit = container["resources"]["limits"]["memory"]
    assert maxmemory == "3gb" and limit == "4Gi" and 3 * 10**9 < 0.8 * 4 * 2**30, (maxmemory, limit)
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["redis"]["command"]
    assert "--maxmemory" in compose and compose[compose.index("--maxmemory-policy") + 1] == "volatile-ttl"
