"""How many threads the engine's CPU work uses: the CPUs this process may really use (its affinity, and its
cgroup's CPU quota: a container may see more cores than it may use), less what other processes take of them now.

torch's OpenMP threads spin-wait for each other at the end of every parallel region; when one of them is
descheduled because another busy process shares its core, the others spin until it runs again. Beside one busy
process on a 2-core machine, one stream fell from 28-30 to 0.7 decode tokens/s with two threads, and ran at 17.9
with one (docs/benchmarks-history.md). So the engine looks, every half second between its steps, at how much of its CPUs
other processes used (`/proc/stat`, less this process's own time) and runs with the threads the rest can hold,
until the CPUs come back.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SAMPLE_EVERY_S = 0.5
AGREEING_SAMPLES = 2  # going down needs this many samples in a row that ask for fewer threads
SLACK_DOWN = 0.3  # a thread is given up once others take more than 30% of the CPU it would run on...
SLACK_UP = 0.1  # ...and taken back only once they leave it at least 90% free (hysteresis)
HOLD_UP_S = 10.0  # taking a thread back needs the CPUs free this long (and all that time agreeing)
HOLD_UP_MAX_S = 600.0  # after each going back down within FLAP_S of coming up, twice as long, up to this (else reset)
FLAP_S = 60.0

def allowed_cpus() -> set[int]:
    """The CPUs this process may run on (all of them where affinity is not known)."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        return set(range(os.cpu_count() or 1))


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup"), own: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPUs this process's cgroup (or the tightest of its parents) may use per period (`cpu.max` of cgroup v2,
    `cpu.cfs_quota_us` / `cpu.cfs_period_us` of v1); None where unlimited or unknown."""
    try:
        lines = own.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy; the limit of each level up to the root applies
            folder = root / path.lstrip("/")
            while True:
                limits.append(_v2_limit(folder / "cpu.max"))
                if folder == root or root not in folder.parents:
                    break
                folder = folder.parent
        elif "cpu" in controllers.split(","):
            for base in (root / "cpu,cpuacct", root / "cpu"):
                limits.append(_v1_limit(base / path.lstrip("/")))
    found = [limit for limit in limits if limit is not None]
    return min(found) if found else None


def _v2_limit(path: Path) -> float | None:
    try:
        quota, period = path.read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_limit(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 else quota / period


def usable_cpus() -> int:
    """The CPUs this process may really use: its affinity, within its cgroup's quota (rounded up)."""
    limit = cgroup_cpu_limit()
    cpus = len(allowed_cpus())
    return max(1, min(cpus, math.ceil(limit))) if limit is not None else cpus


class CpuWatch:
    """How much of `cpus` other processes used since the last look: their busy time in `/proc/stat` less this
    process's own (`/proc/self/stat`), in CPUs. Time of niced processes (`nice` ticks) does not count while this
    process runs at normal priority: the scheduler gives them what this process leaves, and a nice-19 background
    job must not hold the engine at one thread."""

    def __init__(self, cpus: set[int], stat: Path = Path("/proc/stat"), own: Path = Path("/proc/self/stat"),
                 niced: bool | None = None):
        self.cpus, self._stat, self._own = cpus, stat, own
        self._count_nice = niced if niced is not None else os.getpriority(os.PRIO_PROCESS, 0) > 0
        self._last = self._read()

    @property
    def available(self) -> bool:
        return self._last is not None

    def others(self) -> float | None:
        """CPUs taken by other processes (and the hypervisor: steal) since the last call; None without `/proc`
        (or on the first call after `restart`)."""
        now = self._read()
        if now is None or self._last is None:
            return None
        (busy, total, mine), (last_busy, last_total, last_mine) = now, self._last
        self._last = now
        if total <= last_total:
            return None
        elapsed = (total - last_total) / len(self.cpus)  # ticks of one CPU
        return max(0.0, (busy - last_busy) - (mine - last_mine)) / elapsed

    def restart(self) -> None:
        """Forget the last look: the next `others` covers only the time from now."""
        self._last = self._read()

    def _read(self) -> tuple[int, int, int] | None:
        """(busy, total) ticks over `cpus`, and this process's ticks."""
        try:
            lines = self._stat.read_text().splitlines()
            fields = self._own.read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        busy = total = 0
        for line in lines:
            name, *ticks = line.split()
            if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in self.cpus:
                continue
            values = [int(tick) for tick in ticks[:8]]  # user nice system idle iowait irq softirq steal
            total += sum(values)
            busy += sum(values) - values[3] - values[4] - (0 if self._count_nice else values[1])
        mine = int(fields[11]) + int(fields[12])  # utime, stime (the 14th and 15th fields)
        return busy, total, mine


class ThreadGovernor:
    """Runs the engine (started with `max_threads`) with fewer while other processes take its CPUs (unless not
    `adaptive`: --no-adaptive-threads); called between steps.

    Without hysteresis a neighbour whose CPU grows with the engine's output (an SSE proxy, the client, a Redis on
    the box) would flip it every second: more threads, more output, more neighbour, fewer threads. So a thread is
    given up quickly (contention stalls every step) but taken back only once the CPUs are clearly free (`SLACK_UP`)
    for `HOLD_UP_S`, a hold that doubles each time the engine has to go back down soon after coming up: in a steady
    state it changes at most about once a minute. Only CPU that competes is counted (not niced processes), and only
    while the engine has work: an idle engine's samples say nothing about what its steps would meet."""

    def __init__(self, max_threads: int, watch: CpuWatch | None = None,
                 set_threads: Callable[[int], None] = torch.set_num_threads,
                 clock: Callable[[], float] = time.monotonic, adaptive: bool = True):
        self.max_threads = self.threads = max_threads
        self.adaptive = adaptive
        self.watch = watch if watch is not None else CpuWatch(allowed_cpus())
        self.changes = 0  # times the thread count changed
        self.others = 0.0  # CPUs other processes took at the last look
        self.hold_up_s = HOLD_UP_S  # how long the CPUs must be free before a thread is taken back
        self._set_threads, self._clock = set_threads, clock
        self._looked_at = clock()
        self._working = True
        self._fewer = 0  # looks in a row that asked for fewer threads
        self._free_since: float | None = None  # since when every look found room for more threads
        self._came_up_at = float("-inf")
        self._said = False  # the first change is logged as a warning, later ones only at debug level

    def tick(self, working: bool = True) -> None:
        """At most every `SAMPLE_EVERY_S` while `working` (the engine has turns): look at the CPUs, and change the
        thread count when the looks say so (see the class). An idle engine does not look; the first look after it
        covers only the time since work came back."""
        if not self.adaptive or self.max_threads <= 1:
            return
        now = self._clock()
        if not working or not self._working:
            if working:
                self.watch.restart()
                self._looked_at = now
            self._working = working
            self._fewer, self._free_since = 0, None  # (what the looks agreed on holds only while working)
            return
        if now - self._looked_at < SAMPLE_EVERY_S:
            return
        self._looked_at = now
        others = self.watch.others()
        if others is None:
            return
        self.others = others
        free = len(self.watch.cpus) - others
        down = max(1, min(self.max_threads, math.floor(free + SLACK_DOWN)))
        up = max(1, min(self.max_threads, math.floor(free + SLACK_UP)))
        self._fewer = self._fewer + 1 if down < self.threads else 0
        if up <= self.threads:
            self._free_since = None
        elif self._free_since is None:
            self._free_since = now
        if self._fewer >= AGREEING_SAMPLES:
            # It came up too soon: wait twice as long next time (else as long as at first).
            self.hold_up_s = min(HOLD_UP_MAX_S, 2 * self.hold_up_s) if now - self._came_up_at < FLAP_S else HOLD_UP_S
            self._change(down, others)
        elif self._free_since is not None and now - self._free_since >= self.hold_up_s:
            self._came_up_at = now
            self._change(up, others)

    def _change(self, threads: int, others: float) -> None:
        log.log(logging.WARNING if not self._said else logging.DEBUG,
                "other processes take %.1f of this process's %d CPUs: the engine runs with %d thread%s (of %d)%s",
                others, len(self.watch.cpus), threads, "s" if threads > 1 else "", self.max_threads,
                "" if self._said else "; later changes are counted on /metrics (engine_thread_changes)")
        self._said = True
        self._set_threads(threads)
        self.threads = threads
        self.changes += 1
        self._fewer, self._free_since = 0, None

    def stats(self) -> dict[str, int | float]:
        """The threads now and at most, how often the count changed, and the CPUs others took at the last look."""
        return {"engine_threads": self.threads, "engine_threads_max": self.max_threads,
                "engine_thread_changes": self.changes, "cpu_taken_by_others": round(self.others, 2)}
