"""The engine's thread count: the CPUs the process may use (affinity and cgroup quota), and fewer while other
processes take them (measured from /proc: a real busy process here)."""

import os
import subprocess
import sys
import time

import pytest

from chatd.engine.cpu_share import (
    HOLD_UP_S,
    SAMPLE_EVERY_S,
    CpuWatch,
    ThreadGovernor,
    cgroup_cpu_limit,
)


def test_the_cgroup_quota_is_the_tightest_on_the_way_to_the_root(tmp_path):
    root = tmp_path / "cgroup"
    (root / "outer" / "inner").mkdir(parents=True)
    (root / "cpu.max").write_text("max 100000\n")
    (root / "outer" / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs for everything below
    (root / "outer" / "inner" / "cpu.max").write_text("max 100000\n")
    own = tmp_path / "cgroup-of-self"
    own.write_text("0::/outer/inner\n")
    assert cgroup_cpu_limit(root, own) == 1.5
    (root / "outer" / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(root, own) is None, "unlimited"
    v1 = tmp_path / "v1"
    (v1 / "cpu" / "job").mkdir(parents=True)
    (v1 / "cpu" / "job" / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu" / "job" / "cpu.cfs_period_us").write_text("100000\n")
    own.write_text("4:memory:/job\n3:cpu:/job\n")
    assert cgroup_cpu_limit(v1, own) == 0.5


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux's /proc")
def test_a_busy_process_on_this_process_cpus_is_seen_and_its_end_too():
    """Measured against what else runs on these cores meanwhile (other tests' servers may: a window in which they
    filled the cores is measured again, three tries at most)."""
    for _ in range(3):
        before, beside, after = busy_process_seen(os.sched_getaffinity(0))
        if beside >= before + 0.5 and after <= beside - 0.5:
            break
    assert beside >= before + 0.5, "one of this process's CPUs is taken"
    assert after <= beside - 0.5, "and given back"


def busy_process_seen(cpus: set[int]) -> tuple[float, float, float]:
    """What others use of `cpus` before, beside and after a process that keeps one of them busy for a second."""
    watch = CpuWatch(cpus)
    time.sleep(1.0)
    before = watch.others()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(busy.pid, {min(cpus)})
        time.sleep(0.2)
        watch.others()
        time.sleep(1.0)
        beside = watch.others()
    finally:
        busy.kill()
        busy.wait(10)
    watch.others()
    time.sleep(1.0)
    return before, beside, watch.others()


class Stat:
    """A /proc/stat and /proc/self/stat pair that a test advances: two CPUs, and what others used of them (at normal
    priority, or niced)."""

    def __init__(self, folder):
        self.system, self.own, self.busy, self.nice, self.idle = folder / "stat", folder / "self-stat", 0, 0, 0
        self.advance(0.0)

    def advance(self, others: float, ticks: int = 50, nice: float = 0.0) -> None:
        self.busy += round(others * ticks)
        self.nice += round(nice * ticks)
        self.idle += round((2 - others - nice) * ticks)
        lines = [f"cpu {self.busy} {self.nice} 0 {self.idle} 0 0 0 0 0 0"]
        for cpu in range(2):
            lines.append(f"cpu{cpu} {self.busy // 2 + cpu * (self.busy % 2)} {self.nice // 2 + cpu * (self.nice % 2)} "
                         f"0 {self.idle // 2 + cpu * (self.idle % 2)} 0 0 0 0 0 0")
        self.system.write_text("\n".join(lines) + "\n")
        self.own.write_text("1 (chatd serve) S " + " ".join(["0"] * 50) + "\n")  # this process: idle


class Harness:
    """A governor of two threads over a fake /proc that a test advances one look at a time."""

    def __init__(self, folder):
        self.stat, self.now, self.applied = Stat(folder), [0.0], []
        self.governor = ThreadGovernor(2, CpuWatch({0, 1}, self.stat.system, self.stat.own, niced=False),
                                       self.applied.append, lambda: self.now[0])

    def look(self, others: float, nice: float = 0.0, working: bool = True) -> int:
        self.stat.advance(others, nice=nice)
        self.now[0] += SAMPLE_EVERY_S
        self.governor.tick(working)
        return self.governor.threads


def test_the_governor_runs_fewer_threads_while_others_take_the_cpus_and_all_once_they_leave(tmp_path):
    harness = Harness(tmp_path)
    look, governor = harness.look, harness.governor
    assert look(0.9) == 2, "one look is not enough"
    assert look(0.9) == 1 and governor.changes == 1
    free_looks = round(HOLD_UP_S / SAMPLE_EVERY_S)
    assert [look(0.05) for _ in range(free_looks + 1)][-2:] == [1, 2] and harness.applied == [1, 2]
    assert [look(others) for others in (0.9, 0.0, 0.9, 0.0)] == [2, 2, 2, 2], "no flapping on single looks"
    assert governor.others == pytest.approx(0.0, abs=0.05)


def test_a_neighbour_whose_cpu_grows_with_the_engine_s_output_changes_the_threads_at_most_once_a_minute(tmp_path):
    """A neighbour that takes 0.2 CPU per engine thread (an SSE proxy, the client): one change in 10 s, not ten.
    One that takes 0.4 at two threads and almost nothing at one: the engine comes back up ever more slowly, at most
    one change a minute in a steady state."""
    harness = Harness(tmp_path)
    for _ in range(round(10 / SAMPLE_EVERY_S)):
        harness.look(0.2 * harness.governor.threads)
    assert harness.governor.changes == 1 and harness.governor.threads == 1

    (tmp_path / "harsh").mkdir()
    harness = Harness(tmp_path / "harsh")
    changes_at = []
    for _ in range(round(20 * 60 / SAMPLE_EVERY_S)):
        before = harness.governor.changes
        harness.look(0.4 if harness.governor.threads == 2 else 0.02)
        if harness.governor.changes > before:
            changes_at.append(harness.now[0])
    steady = [at for at in changes_at if at >= 10 * 60]
    assert len(steady) <= 10, f"{len(steady)} changes in the last ten minutes: {changes_at}"
    for _ in range(round(2 * 60 / SAMPLE_EVERY_S)):  # the neighbour leaves; later, a real one comes and goes
        harness.look(0.0)
    assert harness.governor.threads == 2
    harness.look(1.5)
    harness.look(1.5)
    assert harness.governor.threads == 1 and harness.governor.hold_up_s == HOLD_UP_S, "no flap: the hold is reset"


def test_niced_neighbours_and_an_idle_engine_change_nothing(tmp_path):
    harness = Harness(tmp_path)
    for _ in range(40):
        assert harness.look(0.0, nice=1.9) == 2, "a nice-19 background job competes with nothing"
    for _ in range(40):
        assert harness.look(1.9, working=False) == 2, "an idle engine does not look"
    assert harness.look(0.0) == 2 and harness.look(0.0) == 2, "the first look after work comes back covers only it"
    assert harness.governor.changes == 0
    assert [harness.look(1.5) for _ in range(2)] == [2, 1]
    for _ in range(4):
        harness.look(0.0)  # free for two seconds of work...
    for _ in range(100):
        harness.look(0.0, working=False)  # ...then idle far longer than the hold
    free_looks = [harness.look(0.0) for _ in range(round(HOLD_UP_S / SAMPLE_EVERY_S) + 2)]
    assert free_looks[:round(HOLD_UP_S / SAMPLE_EVERY_S)] == [1] * round(HOLD_UP_S / SAMPLE_EVERY_S), \
        "the hold counts only time at work"
    assert free_looks[-1] == 2
