"""`chatd serve` as a process of its own, for benchmarks, tests and drills: started on a free port,
its URL read from the line it prints once it serves."""

from __future__ import annotations

import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


def ephemeral_floor() -> int:
    """The lowest port the kernel hands out to outgoing connections."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def free_port(*offsets: int) -> int:
    """A port nothing listens on now (nor on the port each offset above it), below the ephemeral range: there no
    client connection (of this process or any other) can take it between this check and the bind of whatever is
    handed it, as one the kernel picks (bind to port 0) can be, seen in CI as `Address already in use`."""
    while True:
        port = random.randrange(10_000, ephemeral_floor() - max(offsets, default=0))
        try:
            for candidate in (port, *(port + offset for offset in offsets)):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port


class ServerProcess:
    """`flags` as one string or a list; with `checkout`, the code of that checkout serves (to compare a
    change with the commit before it)."""

    def __init__(self, flags: str | Sequence[str] = "", checkout: Path | None = None):
        extra = shlex.split(flags) if isinstance(flags, str) else list(flags)
        command = [sys.executable, "-m", "chatd", "serve", "--port", "0", "--log-level", "warning", *extra]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if checkout is not None:
            env["PYTHONPATH"] = str(checkout.resolve())
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env,
                                        cwd=checkout.resolve() if checkout else None)
        line = self.process.stdout.readline()
        match = re.search(r"ws://\S+:(\d+)/ws", line)
        if not match:
            self.process.kill()
            raise RuntimeError(f"`chatd serve {shlex.join(extra)}` did not start: {line!r}")
        self.url, self.port = match.group(0), int(match.group(1))

    def stop(self) -> None:
        """SIGTERM, as a supervisor stops it (a graceful drain), and wait for it to exit."""
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(30)

    def kill(self) -> None:
        """SIGKILL: a crash, nothing flushed."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)
