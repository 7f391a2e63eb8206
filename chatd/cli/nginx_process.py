"""nginx with the shipped configuration (deploy/nginx/chatd.conf), its upstreams pointed at running chatd
workers, on a free port: for benchmarks and tests of several workers behind the proxy as deployed."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from chatd.cli.server_process import ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[2]


def nginx_binary() -> str | None:
    """Debian installs nginx in /usr/sbin, which is not on every user's PATH."""
    return shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)


class NginxProcess:
    """Started on construction (RuntimeError if nginx is missing or does not start); `stop()` ends it."""

    def __init__(self, workers: Sequence[ServerProcess], folder: Path):
        binary = nginx_binary()
        if binary is None:
            raise RuntimeError("nginx is not installed")
        self.port = free_port()
        shipped = (ROOT / "deploy/nginx/chatd.conf").read_text()
        servers = "".join(f"    server 127.0.0.1:{worker.port} max_fails=1 fail_timeout=5s;\n" for worker in workers)
        shipped = shipped.replace("    server chatd-2:8765 max_fails=1 fail_timeout=5s;\n", "")
        shipped = shipped.replace("    server chatd-1:8765 max_fails=1 fail_timeout=5s;\n", servers)
        (folder / "chatd.conf").write_text(shipped.replace("listen 80;", f"listen 127.0.0.1:{self.port};"))
        temp_paths = " ".join(f"{kind}_temp_path {folder}/{kind};"
                              for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        (folder / "nginx.conf").write_text(
            f"daemon off; worker_processes 1; pid {folder}/nginx.pid; error_log {folder}/error.log;\n"
            f"events {{ worker_connections 256; }}\n"
            f"http {{ access_log off; {temp_paths} include {folder}/chatd.conf; }}\n")
        self.process = subprocess.Popen([binary, "-p", str(folder), "-c", str(folder / "nginx.conf")],
                                        stderr=subprocess.PIPE)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        self.process.terminate()
        log = folder / "error.log"
        raise RuntimeError(f"nginx did not start: {log.read_text() if log.exists() else 'no error log'}")

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)
