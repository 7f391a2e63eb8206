"""Copies between the compute device and host memory.

On CUDA, offload copies into pinned host memory on a separate stream with non-blocking copies, then
waits for that stream to checksum the bytes that arrived; restore copies back on the same side stream
and records an event that the compute stream waits on, so a restore never blocks the engine thread.
On a CPU-only machine both directions are plain copies in ordinary memory, so the same path runs
(and is tested) everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from cache_store.entry import CacheEntry, KVTensors, entry_from_tensors
from cache_store.integrity import Fingerprint, checksum


@dataclass
class HostEntry:
    """A cache in host memory: its tensors, its token ids, its fingerprint and the checksum of its
    bytes taken when it left the device."""

    tensors: KVTensors
    token_ids: list[int]
    fingerprint: Fingerprint | None
    checksum: str
    session_version: int = 0

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.tensors)


class Offloader:
    def __init__(self, device: torch.device):
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def offload(self, entry: CacheEntry) -> HostEntry:
        if self._stream is None:
            tensors = [(k.clone(), v.clone()) for k, v in entry.tensors()]
            return HostEntry(tensors, list(entry.token_ids), entry.fingerprint, checksum(tensors),
                             entry.session_version)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        tensors = []
        with torch.cuda.stream(self._stream):
            for keys, values in entry.tensors():
                tensors.append((self._to_pinned(keys), self._to_pinned(values)))
        self._stream.synchronize()  # the checksum needs the bytes on the host
        return HostEntry(tensors, list(entry.token_ids), entry.fingerprint, checksum(tensors), entry.session_version)

    def restore(self, host: HostEntry, new_cache: Callable[[], DynamicCache]) -> CacheEntry:
        if self._stream is None:
            tensors = [(k.clone(), v.clone()) for k, v in host.tensors]
        else:
            tensors = self._to_device(host.tensors)
        entry = entry_from_tensors(new_cache, tensors, host.token_ids, host.fingerprint)
        entry.session_version = host.session_version
        return entry

    def _to_device(self, host_tensors: KVTensors) -> KVTensors:
        with torch.cuda.stream(self._stream):
            tensors = [(k.to(self.device, non_blocking=True), v.to(self.device, non_blocking=True))
                       for k, v in host_tensors]
        restored = torch.cuda.Event()
        restored.record(self._stream)
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(restored)
        for keys, values in tensors:  # allocated on the copy stream, used on the compute stream
            keys.record_stream(compute)
            values.record_stream(compute)
        return tensors

    def _to_pinned(self, tensor: torch.Tensor) -> torch.Tensor:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        tensor.record_stream(self._stream)  # keep the device memory until the copy has run
        return host
