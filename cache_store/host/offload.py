"""Copies between the compute device and host memory.

On CUDA, offload copies into pinned pool buffers on a separate stream with non-blocking copies, then
waits for that stream (the checksum needs the bytes on the host): offload is synchronous for the engine
thread. Restore copies back on the same side stream and records an event that the compute stream waits
on, so a restore does not block the engine thread; the host buffer goes back to the pool once that
event has passed. On a CPU-only machine both directions are plain copies in ordinary memory, so the
same path runs (and is tested) everywhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

import cache_store.device.chain as chain
from cache_store.checks.integrity import checksum
from cache_store.device.arena import ArenaCache
from cache_store.device.entry import CacheEntry, KVTensors, NewCache, entry_from_parts
from cache_store.host.quantize import dequantize, quantize, quantized_nbytes
from cache_store.identity import Fingerprint
from cache_store.units import KVDtype


@dataclass
class HostEntry:
    """A cache in host memory: its tensors, its token ids, its fingerprint and the checksum of its
    bytes. `buffer` is the pool buffer the tensors are views of (None when they own their memory).
    A quantised entry holds int8 `tensors` and their `scales`; its checksum covers both. An entry may
    continue an earlier copy (`base`): its tensors then hold only the positions after the base's, so an offload
    copies only the turns added since, and int8 positions are quantised once. A copy that ends on a chunk's edge
    is named for the chunks it ends (`cache_store/remote/chunks.py`, with its owner scope): any session of that owner
    whose history starts with the same ids continues it, so it is held once however many stacks include it."""

    tensors: KVTensors
    token_ids: list[int]
    fingerprint: Fingerprint | None
    checksum: str
    session_version: int = 0
    buffer: torch.Tensor | None = None
    scales: KVTensors | None = None
    prefix_key: str | None = None  # the shared segment it starts with (its tensors hold what comes after it)
    prefix_tokens: int = 0  # that segment's positions
    base: HostEntry | None = None  # the earlier copy it continues (its tensors hold what comes after the base's)
    restoring: torch.cuda.Event | None = None  # a restore still reading its buffer (CUDA), until this event
    name: str | None = None  # ending on a chunk's edge: the chunk name of its ids, under which others continue it
    scope: str | None = None  # with a name: whose chunks it holds (its fingerprint's owner)
    refs: int = 0  # the host tier's stacks (sessions' entries) that include it

    @property
    def own_tokens(self) -> int:
        """The positions its tensors hold."""
        return len(self.token_ids) - (len(self.base.token_ids) if self.base is not None else self.prefix_tokens)

    def pieces(self) -> list[HostEntry]:
        """Its stack of copies, the oldest first: together they hold every position after the segment."""
        return [*(self.base.pieces() if self.base is not None else []), self]

    @property
    def stored(self) -> KVTensors:
        """Every tensor it stores, scales included: what its checksum covers."""
        return [*self.tensors, *(self.scales or [])]

    @property
    def nbytes(self) -> int:
        """The bytes it stores (a quantised entry takes more back on the device, in the model's dtype)."""
        return sum(k.nbytes + v.nbytes for k, v in self.stored)

    @property
    def device_nbytes(self) -> int:
        """The bytes of its keys and values, its base's included, once restored in `dtype`."""
        element = self.fingerprint.layout.dtype.itemsize if self.fingerprint else 4
        return sum((piece.nbytes if piece.scales is None else
                    sum(k.numel() + v.numel() for k, v in piece.tensors) * element) for piece in self.pieces())

    @property
    def held_bytes(self) -> int:
        """The host memory it holds: its whole pool buffer."""
        return self.buffer.numel() if self.buffer is not None else self.nbytes


def kv_nbytes(entry: CacheEntry) -> int:
    """The bytes of an entry's keys and values up to its length (not its allocated storage)."""
    return sum(k.nbytes + v.nbytes for k, v in entry.tensors())


def host_nbytes(entry: CacheEntry, kv_dtype: KVDtype, start: int = 0, end: int | None = None) -> int:
    """The bytes an offload of `entry`'s own positions from `start` (up to `end`) stores in `kv_dtype`."""
    tensors = _from([(k[..., :end, :], v[..., :end, :]) for k, v in entry.tensors()], start)
    return sum(k.nbytes + v.nbytes for k, v in tensors) if kv_dtype == "same" else quantized_nbytes(tensors)


class Offloader:
    """Copies caches between the device and host memory (pinned, on a side stream, on CUDA)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def pins_memory(self) -> bool:
        return self._stream is not None

    def offload(self, entry: CacheEntry, buffer: torch.Tensor | None = None, kv_dtype: KVDtype = "same",
                whole: bool = False, base: HostEntry | None = None, end: int | None = None) -> HostEntry:
        """Copy the entry to host memory, in `kv_dtype` (int8: quantised on the device, so that only the
        int8 bytes cross to the host): into views of `buffer` (from the pool), or new tensors. Its own keys and
        values, naming the shared segment it starts with; `whole`: every position, a copy that stands alone;
        `base`: an earlier host copy of its first positions, which the new copy continues (only the positions
        after it are copied); `end`: only the positions before it (the rest goes in a copy that continues this
        one)."""
        scales = None
        chained = isinstance(entry.cache, ArenaCache) and entry.cache.prefix is not None
        sources = chain.full_tensors(entry.cache) if whole and chained else entry.tensors()
        own_end = len(entry.token_ids) if end is None else end
        if own_end < len(entry.token_ids):
            sources = [(k[..., :own_end - entry.prefix_tokens, :], v[..., :own_end - entry.prefix_tokens, :])
                       for k, v in sources]
        if base is not None:
            sources = _from(sources, len(base.token_ids) - entry.prefix_tokens)
        if kv_dtype == "int8":
            sources, scales = quantize(sources)
            sources = [*sources, *scales]
        targets = self._to_host(sources, buffer)
        digest, stamp = checksum(targets), entry.fingerprint  # every stored byte, scales included
        if scales is not None:
            targets, scales = targets[:len(targets) - len(scales)], targets[len(targets) - len(scales):]
            stamp = dataclasses.replace(stamp, quantized="int8") if stamp is not None else None
        own = chained and not whole
        return HostEntry(targets, entry.token_ids[:own_end], stamp, digest, entry.session_version, buffer, scales,
                         entry.cache.prefix.segment_key if own else None, entry.prefix_tokens if own else 0, base)

    def snapshot(self, entry: CacheEntry, start: int, kv_dtype: KVDtype = "same"
                 ) -> tuple[KVTensors, KVTensors | None]:
        """Its keys and values from position `start` on (its shared segments' included), in host memory and in
        `kv_dtype` (int8: quantised on the device, `start` being on a key-scale group's edge), with their scales:
        the part of a Redis copy that Redis does not hold yet."""
        if isinstance(entry.cache, ArenaCache):
            sources = chain.tensors_from(entry.cache, start)
        else:
            sources = _from(entry.tensors(), start)
        scales = None
        if kv_dtype == "int8":
            sources, scales = quantize(sources)
        targets = self._to_host([*sources, *(scales or [])])
        return (targets, None) if scales is None else (targets[:len(sources)], targets[len(sources):])

    def _to_host(self, sources: KVTensors, buffer: torch.Tensor | None = None) -> KVTensors:
        """Host copies of `sources`: views of `buffer` (from the pool), or new tensors; complete on return."""
        targets = _views(buffer, sources) if buffer is not None else [
            (torch.empty(k.shape, dtype=k.dtype), torch.empty(v.shape, dtype=v.dtype)) for k, v in sources]
        if self._stream is None:
            for (host_keys, host_values), (keys, values) in zip(targets, sources, strict=True):
                host_keys.copy_(keys)
                host_values.copy_(values)
            return targets
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for (host_keys, host_values), (keys, values) in zip(targets, sources, strict=True):
                host_keys.copy_(keys, non_blocking=True)
                host_values.copy_(values, non_blocking=True)
                keys.record_stream(self._stream)  # keep the device memory until the copy has run
                values.record_stream(self._stream)
        self._stream.synchronize()  # checksums need the bytes on the host
        return targets

    def restore(self, host: HostEntry, new_cache: NewCache, prefix: ArenaCache | None = None
                ) -> tuple[CacheEntry, torch.cuda.Event | None]:
        """The host entry as a device cache (starting with the resident segment `prefix`, which holds the
        positions before its own), and the event after which its host memory may be reused (None: at once)."""
        dtype = host.fingerprint.layout.dtype if host.fingerprint is not None else None  # (what int8 becomes)
        parts, copied = self._device_parts([(piece.tensors, piece.scales) for piece in host.pieces()], dtype)
        # Views of host buffers (exact copies on a CPU) are copied where they land; anything else is new memory.
        views = self._stream is None and host.scales is None
        entry = entry_from_parts(new_cache, parts, host.token_ids, host.fingerprint, owned=not views, prefix=prefix)
        entry.session_version = host.session_version
        return entry, copied

    def to_device(self, parts: list[tuple[KVTensors, KVTensors | None]], dtype: torch.dtype) -> list[KVTensors]:
        """Host keys and values (int8 with their scales, or exact) as the device's, in `dtype`: a Redis copy's
        chunks, whose memory is nobody else's."""
        return self._device_parts(parts, dtype)[0]

    def _device_parts(self, parts: list[tuple[KVTensors, KVTensors | None]], dtype: torch.dtype | None
                      ) -> tuple[list[KVTensors], torch.cuda.Event | None]:
        """Each part on the device (dequantised where it has scales), and the event after which the host memory
        may be reused (None: at once)."""
        copied, moved_parts = None, []
        for tensors, scales in parts:
            if self._stream is not None:
                moved, copied = self._to_device([*tensors, *(scales or [])])
                tensors, scales = moved[:len(tensors)], moved[len(tensors):] or None
            moved_parts.append(dequantize(tensors, scales, dtype) if scales is not None else tensors)
        return moved_parts, copied

    def _to_device(self, host_tensors: KVTensors) -> tuple[KVTensors, torch.cuda.Event]:
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
        return tensors, restored


def _from(tensors: KVTensors, start: int) -> KVTensors:
    """The positions from `start` on."""
    return tensors if start == 0 else [(k[..., start:, :], v[..., start:, :]) for k, v in tensors]


def _views(buffer: torch.Tensor, like: KVTensors) -> KVTensors:
    """Consecutive views of a flat byte buffer shaped like `like`."""
    views, offset = [], 0
    for pair in like:
        shaped = []
        for tensor in pair:
            size = tensor.nbytes
            shaped.append(buffer[offset:offset + size].view(tensor.dtype).view(tensor.shape))
            offset += size
        views.append((shaped[0], shaped[1]))
    return views
