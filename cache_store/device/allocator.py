"""Free space of the KV arena as runs of units: a region is exactly as long as it asks for.

The free runs are kept by start (with their ends, so that a released run merges with both neighbours at
once). Allocation takes the best fitting run (the shortest that is long enough, the lowest of equals),
which `bench/arena_compaction.py` measured to need fewer compactions than the first fit; a region grows in place
when the run right after it is free, and shrinks by releasing its tail. Nothing here knows what a region
holds: moving data (compaction) is the arena's job, which then tells the allocator where regions are.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

Fit = Literal["best", "first"]


class RunAllocator:
    """Regions of any number of units out of `units`, as free runs that merge with their neighbours."""

    def __init__(self, units: int, fit: Fit = "best"):
        self.units = units
        self.fit = fit
        self._runs: dict[int, int] = {}  # start -> length of each free run
        self._ends: dict[int, int] = {}  # end -> start of each free run
        self._free_units = 0
        if units:
            self._add(0, units)

    def allocate(self, units: int) -> int | None:
        """The start of a free region of `units`, or None when no free run is that long."""
        chosen = None
        for start, length in self._runs.items():
            if length >= units and (chosen is None or self._better(start, length, chosen)):
                chosen = (start, length)
        if chosen is None:
            return None
        start, length = chosen
        self._remove(start)
        if length > units:
            self._add(start + units, length - units)
        return start

    def release(self, start: int, units: int) -> None:
        """Free a region (or the tail of one), merging it with the free runs on either side."""
        if units <= 0:
            return
        if (after := self._runs.get(start + units)) is not None:
            self._remove(start + units)
            units += after
        if (before := self._ends.get(start)) is not None:
            units += start - before
            self._remove(before)
            start = before
        self._add(start, units)

    def grow(self, start: int, units: int, more: int) -> bool:
        """Extend the region [start, start + units) by `more` units in place, if the run after it allows."""
        end = start + units
        length = self._runs.get(end, 0)
        if length < more:
            return False
        self._remove(end)
        if length > more:
            self._add(end + more, length - more)
        return True

    def shrink(self, start: int, units: int, keep: int) -> None:
        """Keep the first `keep` units of the region [start, start + units) and free the rest."""
        self.release(start + keep, units - keep)

    def rebuild(self, regions: Iterable[tuple[int, int]]) -> None:
        """Every region (start, units) in use, after the arena moved some: the rest is free."""
        self._runs, self._ends, self._free_units = {}, {}, 0
        position = 0
        for start, units in sorted(regions):
            if start > position:
                self._add(position, start - position)
            position = max(position, start + units)
        if position < self.units:
            self._add(position, self.units - position)

    def free_units(self) -> int:
        return self._free_units

    def largest_free(self) -> int:
        """Units of the longest free run."""
        return max(self._runs.values(), default=0)

    def free_runs(self) -> list[tuple[int, int]]:
        """(start, units) of every free run, in order."""
        return sorted(self._runs.items())

    def _better(self, start: int, length: int, chosen: tuple[int, int]) -> bool:
        if self.fit == "first":
            return start < chosen[0]
        return (length, start) < (chosen[1], chosen[0])

    def _add(self, start: int, units: int) -> None:
        self._runs[start] = units
        self._ends[start + units] = start
        self._free_units += units

    def _remove(self, start: int) -> None:
        units = self._runs.pop(start)
        del self._ends[start + units]
        self._free_units -= units
