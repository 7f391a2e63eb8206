"""`make compose-check`: docker-compose.yml brought up for real, as root, on this machine's own Docker engine.

Every container uses the host's network and listens on 127.0.0.1 only: the check starts its own dockerd with no
bridge and no iptables, refuses to start anything if `docker network ls` shows more than `host` and `none` or if a
service of the checked configuration would get a network of its own, and stops that dockerd by its pid (unmounting
what it mounted) when done. No registry is needed: the base image is Debian bookworm from `debootstrap`, the chatd
image is the project's Dockerfile on it (torch from the wheel pip finds on this host), and Redis, nginx and
Prometheus are Debian's packages on the same base (`docker-compose.check.yml`).

Shown through nginx: an OpenAI conversation continuing across both workers with its cache (from Redis), a websocket
conversation whose worker is `docker restart`ed between two turns with nothing lost, Prometheus scraping both
workers, and `docker-compose down` draining a stream that is still running. Then everything it made is removed.

    sudo .venv/bin/python deploy/compose-check/check.py      (make compose-check)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import websockets.sync.client
import yaml
from websockets.asyncio.client import connect

from chatd.cli.server_process import free_port

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PROJECT = "chatdcheck"
BASE_IMAGE = "chatd-check/base:bookworm"
PACKAGES = {"docker.io": "dockerd", "docker-compose": "docker-compose", "debootstrap": "debootstrap"}
MODEL = "smollm2-135m"
STARTED = time.monotonic()


@contextlib.contextmanager
def step(title: str) -> Iterator[None]:
    """One step of the check, its time and outcome printed (the CI log shows where the time goes)."""
    print(f"== {title}", flush=True)
    started = time.monotonic()
    yield
    print(f"   ok in {time.monotonic() - started:.1f} s (total {time.monotonic() - STARTED:.0f} s)", flush=True)


def run(*command: str, env: dict | None = None, timeout: float = 900, quiet: bool = False) -> str:
    """A command's output; its failure stops the check with what it printed."""
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"`{' '.join(command)}` failed ({done.returncode}):\n{done.stdout[-4000:]}"
                         f"{done.stderr[-4000:]}")
    if not quiet and done.stdout.strip():
        print("   " + done.stdout.strip().replace("\n", "\n   ")[-1500:], flush=True)
    return done.stdout


class Dockerd:
    """A Docker engine of the check's own: host networking only, its state in the check's folder."""

    def __init__(self, folder: Path):
        self.folder, self.socket = folder, folder / "docker.sock"
        self.process: subprocess.Popen | None = None
        self.env = {**os.environ, "DOCKER_HOST": f"unix://{self.socket}", "COMPOSE_PROJECT_NAME": PROJECT}

    def start(self) -> None:
        log = (self.folder / "dockerd.log").open("w")
        self.process = subprocess.Popen(
            ["dockerd", "--bridge=none", "--iptables=false", "--ip6tables=false", "--ip-forward=false",
             "--ip-masq=false", "--data-root", str(self.folder / "data"), "--exec-root", str(self.folder / "exec"),
             "--pidfile", str(self.folder / "dockerd.pid"), "--host", f"unix://{self.socket}"],
            stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while subprocess.run([docker(), "version"], env=self.env, capture_output=True).returncode != 0:
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise SystemExit(f"dockerd did not start:\n{(self.folder / 'dockerd.log').read_text()[-3000:]}")
            time.sleep(0.5)

    def stop(self) -> None:
        """Stop the engine by its pid, then unmount whatever is still mounted under its folders."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
                  if line.split()[1].startswith(str(self.folder))]
        for mount in sorted(mounts, key=len, reverse=True):
            subprocess.run(["umount", "-l", mount], capture_output=True)


def docker() -> str:
    """Debian's docker client, of the engine's own version, where it is installed."""
    return "/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker"


def compose(engine: Dockerd, *arguments: str, timeout: float = 900, quiet: bool = False) -> str:
    """docker-compose on the checked configuration (written by `every_service_on_the_host_network`)."""
    return run("docker-compose", "--project-directory", str(ROOT), "-f", str(engine.folder / "compose.yml"),
               *arguments, env=engine.env, timeout=timeout, quiet=quiet)


def install() -> None:
    missing = [package for package, binary in PACKAGES.items() if shutil.which(binary) is None]
    if missing:
        run("apt-get", "update", "-qq")
        run("apt-get", "install", "-y", "-qq", *missing, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    print(f"   {run('dockerd', '--version', quiet=True).strip()}; "
          f"{run('docker-compose', '--version', quiet=True).strip()}")


def only_host_networks(engine: Dockerd) -> None:
    networks = set(run(docker(), "network", "ls", "--format", "{{.Name}}", env=engine.env, quiet=True).split())
    if networks - {"host", "none"}:
        raise SystemExit(f"the engine has networks besides host and none: {sorted(networks)}")


def every_service_on_the_host_network(engine: Dockerd) -> None:
    """docker-compose.yml with the check's override, as Compose merges them; refused if a service would get a
    network of its own. Written without `ports` (on the host's network nothing is published; docker-compose 1.29
    refuses the two together, and an override cannot remove a list), for the check's every later call."""
    merged = run("docker-compose", "-f", str(ROOT / "docker-compose.yml"), "-f", str(HERE / "docker-compose.check.yml"),
                 "config", env=engine.env, quiet=True)
    config = yaml.safe_load(merged)
    own = [name for name, service in config["services"].items() if service.get("network_mode") != "host"]
    if own or config.get("networks"):
        raise SystemExit(f"services that would get a network of their own: {own}, networks: {config.get('networks')}")
    for service in config["services"].values():
        service.pop("ports", None)
    (engine.folder / "compose.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    print(f"   {len(config['services'])} services, every one with network_mode: host (published ports dropped)")


def base_image(engine: Dockerd, folder: Path) -> None:
    """Debian bookworm (minbase, with python3 and its venv module, as the slim Python image has) as an image."""
    root = folder / "bookworm"
    run("debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates", "bookworm", str(root),
        "http://deb.debian.org/debian", quiet=True)
    tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
    imported = subprocess.run([docker(), "import", "-", BASE_IMAGE], stdin=tar.stdout, env=engine.env,
                              capture_output=True, text=True)
    tar.wait()
    if imported.returncode != 0:
        raise SystemExit(f"docker import failed: {imported.stderr}")
    shutil.rmtree(root)
    size = run(docker(), "image", "ls", BASE_IMAGE, "--format", "{{.Size}}", env=engine.env, quiet=True).strip()
    print(f"   {BASE_IMAGE}: {size}")


def build_extras() -> list[Path]:
    """What the image's pip needs from this host: the CPU torch wheel pip finds here, and the certificates this
    host trusts (a proxy that re-signs HTTPS is trusted here, not in a fresh image)."""
    extra = ROOT / "deploy" / "docker" / "extra"
    run(sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--dest", str(extra),
        "torch==2.13.0", quiet=True)
    made = list(extra.glob("torch-*.whl"))
    bundle = os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt"
    if Path(bundle).exists():
        shutil.copy(bundle, extra / "ca-bundle.crt")
        made.append(extra / "ca-bundle.crt")
    print(f"   {', '.join(path.name for path in made)}")
    return made


def configurations(folder: Path, ports: dict[str, int]) -> None:
    """The shipped nginx and Prometheus configurations, pointed at 127.0.0.1 and the check's ports."""
    nginx = (ROOT / "deploy/nginx/chatd.conf").read_text()
    for worker in ("chatd-1", "chatd-2"):
        nginx = nginx.replace(f"server {worker}:8765", f"server 127.0.0.1:{ports[worker]}")
    nginx = nginx.replace("listen 80;", f"listen 127.0.0.1:{ports['nginx']};")
    assert "chatd-1" not in nginx.split("upstream", 1)[1] and f"127.0.0.1:{ports['nginx']}" in nginx
    (folder / "nginx.conf").write_text(nginx)
    prometheus = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    prometheus["scrape_configs"][0]["static_configs"][0]["targets"] = [
        f"127.0.0.1:{ports['chatd-1']}", f"127.0.0.1:{ports['chatd-2']}"]
    (folder / "prometheus.yml").write_text(yaml.safe_dump(prometheus))


def wait_ready(url: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{url} was not ready within {timeout_s:.0f} s")
        time.sleep(1)


def requests_served(port: int, api: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return sum(float(value) for value in re.findall(
        rf'^chatd:api_requests_total{{api="{api}"[^}}]*}} (\S+)$', text, re.MULTILINE))


def pages_through_nginx(ports: dict[str, int]) -> None:
    """What the README promises a browser: the chat UI at `/`, the dashboard at `/dashboard`, and the script the page
    loads from its own path, each through nginx from the image's pages."""
    base = f"http://127.0.0.1:{ports['nginx']}"
    page = httpx.get(base + "/", timeout=10)
    scripts = re.findall(r'<script src="([^"]+)"', page.text)
    if page.status_code != 200 or not scripts:
        raise SystemExit(f"/ answered {page.status_code} without the chat UI's script")
    for path in ["/dashboard", *scripts]:
        answer = httpx.get(base + path, timeout=10)
        print(f"   {path}: {answer.status_code}, {len(answer.content)} bytes")
        if answer.status_code != 200 or not answer.content:
            raise SystemExit(f"{path} answered {answer.status_code} through nginx")


def openai_across_both_workers(ports: dict[str, int]) -> None:
    """A stateless conversation through nginx (balanced by load): each later turn reads its history from a cache,
    and both workers served some of its turns (the other's cache reached through Redis)."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports['nginx']}/v1", api_key="unused", max_retries=0)
    before = {worker: requests_served(ports[worker], "openai") for worker in ("chatd-1", "chatd-2")}
    messages = [{"role": "system", "content": "You are the support desk of a broadband company. Be brief."}]
    for index, question in enumerate(["My router blinks orange.", "It still blinks after a restart.",
                                      "Should I call a technician?", "Thank you, bye."]):
        messages.append({"role": "user", "content": question})
        completion = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
        cached = completion.usage.prompt_tokens_details.cached_tokens
        print(f"   turn {index + 1}: {completion.usage.prompt_tokens} prompt tokens, {cached} from a cache")
        if index and cached <= completion.usage.prompt_tokens // 2:
            raise SystemExit(f"turn {index + 1} read only {cached} tokens from a cache")
        messages.append({"role": "assistant", "content": completion.choices[0].message.content})
    served = {worker: requests_served(ports[worker], "openai") - before[worker] for worker in before}
    print(f"   turns served per worker: {served}")
    if min(served.values()) < 1:
        raise SystemExit("one worker served every turn: the conversation did not cross workers")


async def websocket_across_a_restart(engine: Dockerd, ports: dict[str, int]) -> None:
    """A websocket conversation through nginx; the worker that serves it is restarted between turns; the next turn
    has the whole history (the session's turns, from Redis) and continues from a cache."""
    from chatd.cli.client import ChatClient

    url = f"ws://127.0.0.1:{ports['nginx']}/ws"
    async with ChatClient(await connect(url)) as client:
        session_id = (await client.open_session(system="You are a travel agent. Be brief.")).session_id
    before = {worker: requests_served(ports[worker], "websocket") for worker in ("chatd-1", "chatd-2")}
    for content in ("I want a week somewhere warm in March.", "Somewhere in Europe, please."):
        async with ChatClient(await connect(f"{url}?session_id={session_id}")) as client:
            await client.open_session(session_id=session_id)
            await (await client.chat(session_id, content, max_new_tokens=12)).result()
    holder = max(before, key=lambda worker: requests_served(ports[worker], "websocket") - before[worker])
    print(f"   session {session_id} on {holder}; docker restart {holder}")
    run(docker(), "restart", "-t", "75", f"{PROJECT}_{holder}_1", env=engine.env, quiet=True)
    async with ChatClient(await connect(f"{url}?session_id={session_id}")) as client:
        ready = await client.open_session(session_id=session_id)
        done = await (await client.chat(session_id, "And in April?", max_new_tokens=12)).result()
    print(f"   after the restart: {ready.turns} turns kept, cache {done.cache.source}, "
          f"{done.usage.cached_tokens} of {done.usage.prompt_tokens} prompt tokens from it")
    if ready.turns != 2 or done.cache.source == "miss":
        raise SystemExit(f"the conversation lost something across the restart: {ready.turns} turns, "
                         f"cache {done.cache.source}")
    wait_ready(f"http://127.0.0.1:{ports[holder]}/readyz")


def prometheus_scrapes_both(ports: dict[str, int]) -> None:
    deadline = time.monotonic() + 60
    while True:
        targets = httpx.get(f"http://127.0.0.1:{ports['prometheus']}/api/v1/targets", timeout=5).json()
        health = {target["scrapeUrl"]: target["health"] for target in targets["data"]["activeTargets"]}
        if len(health) == 2 and set(health.values()) == {"up"}:
            print(f"   targets: {health}")
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"Prometheus does not scrape both workers: {health}")
        time.sleep(2)
    answer = httpx.get(f"http://127.0.0.1:{ports['prometheus']}/api/v1/query",
                       params={"query": "sum by (instance) (chatd:api_requests_total)"}, timeout=5).json()
    print("   chatd:api_requests_total by instance (a restarted worker counts from 0): "
          + json.dumps({row["metric"]["instance"]: row["value"][1] for row in answer["data"]["result"]}))


def down_drains_a_stream(engine: Dockerd, ports: dict[str, int]) -> None:
    """A long streamed reply through nginx, and an idle chat tab's websocket; `docker-compose down` while they are
    open: the stream still ends with its finish reason and `[DONE]` (nginx quits gracefully, the worker finishes its
    turn), the websocket is closed by its worker, and everything is down well within nginx's 75 s grace period."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
            "max_tokens": 160, "temperature": 0, "stream": True}
    first, outcome = threading.Event(), {}

    def stream() -> None:
        chunks, finish = 0, None
        with httpx.stream("POST", f"http://127.0.0.1:{ports['nginx']}/v1/chat/completions", json=body,
                          timeout=300) as response:
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    outcome["done"] = True
                elif line.startswith("data: "):
                    chunks += 1
                    first.set()
                    choices = json.loads(line.removeprefix("data: "))["choices"]
                    finish = choices[0]["finish_reason"] if choices else finish
        outcome.update(chunks=chunks, finish=finish)

    reader = threading.Thread(target=stream)
    reader.start()
    tab = websockets.sync.client.connect(f"ws://127.0.0.1:{ports['nginx']}/ws")  # a chat tab left open, idle
    if not first.wait(120):
        raise SystemExit("the stream did not start")
    started = time.monotonic()
    compose(engine, "down", timeout=300, quiet=True)
    took = time.monotonic() - started
    reader.join(60)
    tab.close()
    print(f"   down took {took:.1f} s; the stream: {outcome}")
    if not outcome.get("done") or outcome.get("finish") not in ("length", "stop"):
        raise SystemExit(f"docker-compose down cut the stream: {outcome}")
    if took > 60:
        raise SystemExit(f"docker-compose down took {took:.0f} s: an idle websocket held nginx")


def main() -> None:
    if os.geteuid() != 0:
        raise SystemExit("make compose-check starts its own dockerd: run it as root")
    folder = Path(tempfile.mkdtemp(prefix="chatd-compose-check-"))
    engine = Dockerd(folder)
    ports = {name: free_port() for name in ("redis", "chatd-1", "chatd-2", "nginx", "prometheus")}
    os.environ.update(CHECK_BASE_IMAGE=BASE_IMAGE, CHECK_DIR=str(folder), CHECK_REDIS_PORT=str(ports["redis"]),
                      CHECK_WORKER_1_PORT=str(ports["chatd-1"]), CHECK_WORKER_2_PORT=str(ports["chatd-2"]),
                      CHECK_NGINX_PORT=str(ports["nginx"]), CHECK_PROMETHEUS_PORT=str(ports["prometheus"]))
    engine.env.update(os.environ)
    extras: list[Path] = []
    try:
        with step("install docker.io, docker-compose and debootstrap where absent"):
            install()
        with step("the checked configuration: every service on the host's network"):
            configurations(folder, ports)
            every_service_on_the_host_network(engine)
        with step("start a dockerd of the check's own (no bridge, no iptables): networks host and none only"):
            engine.start()
            only_host_networks(engine)
        with step("base image: debootstrap bookworm (minbase, python3) | docker import"):
            base_image(engine, folder)
        with step("build the chatd image (the Dockerfile) and Redis, nginx, Prometheus (Debian's packages)"):
            extras = build_extras()
            compose(engine, "build", quiet=True, timeout=1200)
        with step("up: redis, chatd-1, chatd-2, nginx, prometheus; both workers ready"):
            compose(engine, "up", "-d", "redis", "chatd-1", "chatd-2", "nginx", "prometheus", quiet=True)
            for worker in ("chatd-1", "chatd-2"):
                wait_ready(f"http://127.0.0.1:{ports[worker]}/readyz")
            wait_ready(f"http://127.0.0.1:{ports['nginx']}/readyz")
            only_host_networks(engine)
        with step("the chat UI, its script and the dashboard through nginx"):
            pages_through_nginx(ports)
        with step("OpenAI through nginx: one conversation across both workers, from its cache"):
            openai_across_both_workers(ports)
        with step("websocket through nginx: its worker docker-restarted between turns, nothing lost"):
            asyncio.run(websocket_across_a_restart(engine, ports))
        with step("Prometheus scrapes both workers"):
            prometheus_scrapes_both(ports)
        with step("docker-compose down while a stream runs: the stream finishes"):
            down_drains_a_stream(engine, ports)
    finally:
        with step("remove everything the check made"):
            if engine.process is not None:  # (the engine's data, images included, goes with its folder)
                with contextlib.suppress(SystemExit):
                    compose(engine, "down", "--volumes", "--remove-orphans", timeout=300, quiet=True)
            engine.stop()
            shutil.rmtree(folder, ignore_errors=True)
            for path in extras:
                path.unlink(missing_ok=True)
    print(f"compose-check passed in {time.monotonic() - STARTED:.0f} s")


if __name__ == "__main__":
    main()
