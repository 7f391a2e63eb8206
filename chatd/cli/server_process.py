"""`chatd serve` as a process of its own, for benchmarks, tests and drills: started on a free port,
its URL read from the line it prints once it serves."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


def free_port() -> int:
    """A port nothing listens on now (the operating system's choice)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


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
