"""Host memory for offloaded caches: flat byte buffers in size classes, reused after their cache
leaves the host tier, so that the host budget counts the bytes the process really holds.

Buffers are pinned where a CUDA device copies into them (pinned memory is what lets the copy run
asynchronously); a pinned allocation that fails falls back to ordinary memory, with one warning.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch

log = logging.getLogger(__name__)

MIN_GRANULE = 64  # bytes: keeps every view of a buffer aligned


def size_class(nbytes: int) -> int:
    """`nbytes` rounded up to its size class: at most 12.5% larger, so that buffers of caches of
    similar length are interchangeable."""
    granule = max(MIN_GRANULE, 1 << max(0, nbytes.bit_length() - 4))
    return -(-nbytes // granule) * granule


class HostBufferPool:
    """Not thread-safe: the engine thread is its only user."""

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self.held_bytes = 0  # every buffer allocated and not released: in use or free
        self._free: defaultdict[int, list[torch.Tensor]] = defaultdict(list)
        self._copying: list[tuple[torch.cuda.Event, torch.Tensor]] = []
        self._warned = False

    @property
    def free_bytes(self) -> int:
        return sum(size * len(buffers) for size, buffers in self._free.items())

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least `nbytes`: a free one of the same class, or a new one. The caller
        has made room under its budget for `size_class(nbytes)` more held bytes if none is free."""
        size = size_class(nbytes)
        self._collect()
        if self._free[size]:
            return self._free[size].pop()
        buffer = self._allocate(size)
        self.held_bytes += size
        return buffer

    def reusable(self, nbytes: int) -> bool:
        """Whether `take(nbytes)` would reuse a free buffer rather than hold more memory."""
        self._collect()
        return bool(self._free.get(size_class(nbytes)))

    def give(self, buffer: torch.Tensor, copied: torch.cuda.Event | None = None) -> None:
        """Return a buffer whose contents are no longer needed, once the copy out of it that `copied`
        marks (an asynchronous restore to the device) has completed."""
        if copied is None:
            self._free[buffer.numel()].append(buffer)
        else:
            self._copying.append((copied, buffer))

    def _collect(self) -> None:
        """Buffers whose copy to the device has completed become free."""
        still = []
        for copied, buffer in self._copying:
            if copied.query():
                self._free[buffer.numel()].append(buffer)
            else:
                still.append((copied, buffer))
        self._copying = still

    def release_free(self, keep_bytes: int = 0) -> int:
        """Release free buffers, largest first, until at most `keep_bytes` of them are left; returns
        the bytes released."""
        self._collect()
        released, pinned = 0, False
        for size in sorted(self._free, reverse=True):
            while self._free[size] and self.free_bytes > keep_bytes:
                pinned |= self._free[size].pop().is_pinned()
                released += size
        self.held_bytes -= released
        if pinned:
            torch.accelerator.empty_host_cache()  # torch caches freed pinned blocks; hand them back
        return released

    def _allocate(self, size: int) -> torch.Tensor:
        if self.pinned:
            try:
                return torch.empty(size, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as error:
                if not self._warned:
                    self._warned = True
                    log.warning("pinned host memory could not be allocated (%s); using ordinary memory for the "
                                "caches that do not get pinned memory (their copies are synchronous)", error)
        return torch.empty(size, dtype=torch.uint8)
