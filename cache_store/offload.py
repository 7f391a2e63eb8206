"""Copies between the compute device and host memory.

On CUDA, offload copies into pinned host memory on a separate stream with non-blocking copies and
records an event; restore makes its copy stream wait for that event and the compute stream wait for
the restore, so neither direction blocks the calling thread on the copy. On a CPU-only machine both
directions are plain copies in ordinary memory, so the same path runs (and is tested) everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from cache_store.entry import CacheEntry, KVTensors, entry_from_tensors


@dataclass
class HostEntry:
    """A cache in host memory: its tensors, its token ids and, on CUDA, the event that marks the
    end of the copy into these tensors."""

    tensors: KVTensors
    token_ids: list[int]
    nbytes: int
    ready: torch.cuda.Event | None = None


class Offloader:
    def __init__(self, device: torch.device):
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def offload(self, entry: CacheEntry) -> HostEntry:
        if self._stream is None:
            tensors = [(k.clone(), v.clone()) for k, v in entry.tensors()]
            return HostEntry(tensors, list(entry.token_ids), _nbytes(tensors))
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        tensors = []
        with torch.cuda.stream(self._stream):
            for keys, values in entry.tensors():
                tensors.append((self._to_pinned(keys), self._to_pinned(values)))
        ready = torch.cuda.Event()
        ready.record(self._stream)
        return HostEntry(tensors, list(entry.token_ids), _nbytes(tensors), ready)

    def restore(self, host: HostEntry, new_cache: Callable[[], DynamicCache]) -> CacheEntry:
        if self._stream is None:
            return entry_from_tensors(new_cache, [(k.clone(), v.clone()) for k, v in host.tensors], host.token_ids)
        if host.ready is not None:
            self._stream.wait_event(host.ready)
        with torch.cuda.stream(self._stream):
            tensors = [(k.to(self.device, non_blocking=True), v.to(self.device, non_blocking=True))
                       for k, v in host.tensors]
        restored = torch.cuda.Event()
        restored.record(self._stream)
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(restored)
        for keys, values in tensors:  # allocated on the copy stream, used on the compute stream
            keys.record_stream(compute)
            values.record_stream(compute)
        return entry_from_tensors(new_cache, tensors, host.token_ids)

    def _to_pinned(self, tensor: torch.Tensor) -> torch.Tensor:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        tensor.record_stream(self._stream)  # keep the device memory until the copy has run
        return host


def _nbytes(tensors: KVTensors) -> int:
    return sum(k.nbytes + v.nbytes for k, v in tensors)
