"""A cache as Redis holds it (`--remote-kv`): the records a write and a fetch pass around, and their bytes.

A cache is a run of immutable chunks (`cache_store/remote/chunks.py`) plus its session's own two keys, all with one
TTL. `chatd:kvchunk:{name}` holds one chunk as safetensors bytes (each tensor's dtype and shape in a checked
header, its name and checksum in the header's metadata), the same key for every session of one owner whose
history starts with the same ids. `chatd:{id}:kv` holds the
session's token ids (int32) and the keys and values of its tail (the positions after its last whole chunk);
`chatd:{id}:kvmeta` a JSON header (format version, fingerprint, session version, the chunks' names, the tail's
shapes, dtype and checksum). Moving them is `remote_tier.py`'s job.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass

import safetensors.torch
import torch
from safetensors import SafetensorError

from cache_store.checks.integrity import checksum
from cache_store.device.entry import KVTensors
from cache_store.identity import CacheLayout, Fingerprint
from cache_store.units import GROUP_TOKENS
from sessions.encoding import pack_ids, unpack_ids

# 2: checksums carry their kind (xxh3:…); 3: int8 caches with their scales; 4: key scales per group; 5: a cache may
# hold only its own positions, naming the shared segment it starts with; 6: chains of chunks; 7: chunks named by
# the one hash of token ids (`sessions.encoding.token_hash`), so a version-6 copy's names would never match, and
# chunks as safetensors bytes
FORMAT_VERSION = 7
_HEADER = struct.Struct("<Q")  # the length of a safetensors header, before it


# Every write and delete of a session's own keys is conditional, in one Lua call, on the version Redis holds: a late
# write of an older turn never takes a newer copy's place, and a delete removes only the copies it means to (those
# at most the version it names: a stale fetch that gave up never deletes the copy its turn wrote since). A header
# that cannot be read has no version, and any delete removes it.
_NEWER_HELD = """
local current = redis.call('GET', KEYS[2])
if current then
  local ok, meta = pcall(cjson.decode, current)
  if ok and type(meta) == 'table' and tonumber(meta['session_version']) and
      tonumber(meta['session_version']) > tonumber(ARGV[1]) then
    return 0
  end
end
"""
# KEYS kv, kvmeta; ARGV version, bytes, header, TTL.
WRITE_SESSION = _NEWER_HELD + """
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[4])
redis.call('SET', KEYS[2], ARGV[3], 'EX', ARGV[4])
return 1
"""
# KEYS kv, kvmeta; ARGV the latest version the delete means to remove.
DELETE_SESSION = _NEWER_HELD + """
redis.call('DEL', KEYS[1], KEYS[2])
return 1
"""
EVERY_VERSION = 2**53  # (a delete of whatever version Redis holds: the session is closed; Lua's numbers are doubles)


def chunk_key(name: str) -> str:
    """A chunk's Redis key: a hash tag of its own, so that chunks spread over a Redis Cluster."""
    return f"chatd:kvchunk:{{{name}}}"


@dataclass
class StoredKV:
    """Keys and values as Redis stored them (int8 with their scales, or exact), with the checksum written with
    them: a chunk (`name`) or a session's tail."""

    tensors: KVTensors
    scales: KVTensors | None
    checksum: str
    name: str | None = None

    @property
    def stored(self) -> KVTensors:
        """Every tensor it stores, scales included: what its checksum covers."""
        return [*self.tensors, *(self.scales or [])]

    @property
    def tokens(self) -> int:
        return self.tensors[0][0].shape[2] if self.tensors else 0

    def after(self, skip: int) -> StoredKV:
        """Its positions after the first `skip` (a whole number of key-scale groups), as views."""
        if skip == 0:
            return self
        groups = skip // GROUP_TOKENS
        return StoredKV([(k[..., skip:, :], v[..., skip:, :]) for k, v in self.tensors],
                        None if self.scales is None else [(ks[..., groups:, :], vs[..., skip:, :])
                                                          for ks, vs in self.scales], self.checksum, self.name)


@dataclass
class RemoteSnapshot:
    """A session's cache on its way to Redis: the names of its whole chunks, and its keys and values (in host
    memory, int8 with their scales or exact) from the first chunk Redis is not known to hold on."""

    token_ids: list[int]
    fingerprint: Fingerprint
    session_version: int
    kind: str  # how its chunks' bytes are stored (part of their names: `chunks.chunk_identity`)
    chunks: list[str]
    start: int  # the first chunk whose bytes it carries (those before it Redis held when it was taken)
    tensors: KVTensors  # the positions from `start` chunks on
    scales: KVTensors | None

    @property
    def nbytes(self) -> int:
        """The host memory its keys, values and scales hold while it waits to be written."""
        return sum(k.nbytes + v.nbytes for k, v in [*self.tensors, *(self.scales or [])])


@dataclass(frozen=True)
class RemoteHeader:
    """What Redis says about a session's cache before its bytes are fetched."""

    session_id: str
    fingerprint: Fingerprint
    session_version: int
    kind: str
    chunks: list[str]
    chunk_tokens: int
    chunk_nbytes: int  # the stored bytes of one chunk
    shapes: list[list[int]]  # of the tail's tensors
    dtype: torch.dtype
    scale_shapes: list[list[int]]  # of a quantised tail's float32 scales (after its int8 tensors), or none
    checksum: str  # of the tail
    nbytes: int  # of the session's own key: its token ids and tail

    def fetch_nbytes(self, first: int) -> int:
        """The bytes a fetch of the chunks from `first` on and the session's own key moves."""
        return (len(self.chunks) - first) * self.chunk_nbytes + self.nbytes


@dataclass
class RemoteCopy:
    """What a fetch brought: the session's token ids, its chunks from the first asked for (None: gone from Redis)
    and its tail. Nothing in it is checked yet."""

    token_ids: list[int]
    first: int
    chunks: list[StoredKV | None]
    tail: StoredKV


def header_from(session_id: str, raw: bytes) -> RemoteHeader | None:
    """The session's header as Redis holds it; None for another format. Raises (KeyError, TypeError, ValueError,
    AttributeError) when it cannot be read."""
    meta = json.loads(raw)
    if meta["format"] != FORMAT_VERSION:
        return None
    stamp = meta["fingerprint"]
    layout = CacheLayout(**{**stamp["layout"], "dtype": _dtype(stamp["layout"]["dtype"])})
    return RemoteHeader(session_id, Fingerprint(**{**stamp, "layout": layout}), meta["session_version"],
                        meta["kind"], list(meta["chunks"]), meta["chunk_tokens"], meta["chunk_nbytes"],
                        meta["shapes"], _dtype(meta["dtype"]), meta["scale_shapes"], meta["checksum"],
                        meta["nbytes"])


def session_bytes(snapshot: RemoteSnapshot, tail: StoredKV, chunk_tokens: int, chunk_nbytes: int) -> tuple[bytes, str]:
    """The session's own key (its token ids, then its tail's bytes) and its header, for a snapshot whose whole chunks
    are stored `chunk_nbytes` each (0: none written yet)."""
    tail_bytes = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in _flat(tail.stored))
    blob = pack_ids(snapshot.token_ids) + tail_bytes
    stamp = asdict(snapshot.fingerprint)
    stamp["layout"]["dtype"] = str(snapshot.fingerprint.layout.dtype)
    meta = {"format": FORMAT_VERSION, "fingerprint": stamp, "session_version": snapshot.session_version,
            "kind": snapshot.kind, "chunks": snapshot.chunks, "chunk_tokens": chunk_tokens,
            "chunk_nbytes": chunk_nbytes or _chunk_nbytes(tail, chunk_tokens),
            "shapes": [list(t.shape) for t in _flat(tail.tensors)], "dtype": str(tail.tensors[0][0].dtype),
            "scale_shapes": [list(t.shape) for t in _flat(tail.scales or [])], "checksum": tail.checksum,
            "nbytes": len(blob)}
    return blob, json.dumps(meta)


def copy_from(header: RemoteHeader, first: int, blob: bytes, chunks: list[bytes | None]) -> RemoteCopy:
    """What a fetch of the session's own key and its chunks from `first` on brought (nothing checked yet)."""
    num_tokens = header.fingerprint.num_tokens
    tail = _stored(_byte_tensor(blob[4 * num_tokens:]), header.shapes, header.dtype, header.scale_shapes,
                   header.checksum)
    return RemoteCopy(unpack_ids(blob[:4 * num_tokens]), first,
                      [decode_chunk(chunk) if chunk is not None else None for chunk in chunks], tail)


def split(snapshot: RemoteSnapshot, chunk_tokens: int) -> list[StoredKV]:
    """The snapshot's chunks from its first carried one, then its tail, each contiguous with its checksum."""
    groups = chunk_tokens // GROUP_TOKENS
    carried = len(snapshot.chunks) - snapshot.start
    pieces = []
    for index in range(carried + 1):
        start, end = index * chunk_tokens, (index + 1) * chunk_tokens if index < carried else None
        tensors = [(k[..., start:end, :].contiguous(), v[..., start:end, :].contiguous())
                   for k, v in snapshot.tensors]
        scales = None if snapshot.scales is None else [
            (ks[..., index * groups:(index + 1) * groups if end else None, :].contiguous(),
             vs[..., start:end, :].contiguous()) for ks, vs in snapshot.scales]
        piece = StoredKV(tensors, scales, "")
        piece.checksum = checksum(piece.stored)
        pieces.append(piece)
    return pieces


def _chunk_nbytes(tail: StoredKV, chunk_tokens: int) -> int:
    """What one chunk would store, from the tail's bytes per position (for a cache with no chunk written yet)."""
    per_token = sum(k.element_size() * k.shape[1] * k.shape[3] * 2 for k, _ in tail.tensors)
    scale_bytes = 0 if tail.scales is None else sum(
        4 * ks.shape[1] * ks.shape[3] * (chunk_tokens // GROUP_TOKENS) + 4 * vs.shape[1] * chunk_tokens
        for ks, vs in tail.scales)
    return per_token * chunk_tokens + scale_bytes


def encode_chunk(name: str, piece: StoredKV) -> bytes:
    """A chunk as Redis holds it: safetensors bytes (a checked header with each tensor's dtype and shape: every
    layer's keys stacked, then values, then a quantised chunk's scales), its name and checksum in the header's
    metadata."""
    tensors = {"keys": torch.stack([keys for keys, _ in piece.tensors]),
               "values": torch.stack([values for _, values in piece.tensors])}
    if piece.scales is not None:
        tensors |= {"key_scales": torch.stack([scales for scales, _ in piece.scales]),
                    "value_scales": torch.stack([scales for _, scales in piece.scales])}
    return safetensors.torch.save(tensors, metadata={"format": str(FORMAT_VERSION), "name": name,
                                                     "checksum": piece.checksum})


def decode_chunk(blob: bytes) -> StoredKV:
    """A chunk as Redis holds it; an unreadable one (another format, a damaged header, bytes missing) yields a chunk
    with no layers and no name, which the checks refuse."""
    try:
        (length,) = _HEADER.unpack_from(blob)
        metadata = json.loads(blob[_HEADER.size:_HEADER.size + length])["__metadata__"]
        if metadata["format"] != str(FORMAT_VERSION):
            raise ValueError(f"a chunk of format {metadata['format']}")
        tensors = safetensors.torch.load(blob)
        scales = None if "key_scales" not in tensors else \
            list(zip(tensors["key_scales"].unbind(0), tensors["value_scales"].unbind(0), strict=True))
        return StoredKV(list(zip(tensors["keys"].unbind(0), tensors["values"].unbind(0), strict=True)), scales,
                        metadata["checksum"], metadata["name"])
    except (struct.error, KeyError, TypeError, ValueError, RuntimeError, SafetensorError):
        return StoredKV([], None, "unreadable")


def _stored(data: torch.Tensor, shapes: list[list[int]], dtype: torch.dtype, scale_shapes: list[list[int]],
            digest: str) -> StoredKV:
    tensors, offset = _tensors(data, 0, shapes, dtype)
    scales, _ = _tensors(data, offset, scale_shapes, torch.float32)
    return StoredKV(_pairs(tensors), _pairs(scales) if scale_shapes else None, digest)


def _byte_tensor(raw: bytes) -> torch.Tensor:
    """Bytes from Redis as a writable uint8 tensor of their own (one zero byte for none: an empty tail)."""
    return torch.frombuffer(bytearray(raw) or bytearray(1), dtype=torch.uint8)


def _flat(pairs: KVTensors) -> list[torch.Tensor]:
    return [t for pair in pairs for t in pair]


def _tensors(data: torch.Tensor, offset: int, shapes: list[list[int]], dtype: torch.dtype
             ) -> tuple[list[torch.Tensor], int]:
    """Tensors of `shapes` read from `data` at `offset`, and the offset after them; a short blob still
    yields tensors, cut in a shape the checks refuse."""
    element, tensors = dtype.itemsize, []
    for shape in shapes:
        size = element * int(torch.Size(shape).numel())
        chunk = data[offset:offset + size]
        if chunk.numel() < size:  # truncated: keep what is there, in a shape the checks will refuse
            per_token = element * shape[1] * shape[3]
            shape = [1, shape[1], chunk.numel() // per_token, shape[3]]
            chunk = chunk[:element * int(torch.Size(shape).numel())]
        tensors.append(chunk.view(dtype).reshape(shape))
        offset += size
    return tensors, offset


def _pairs(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(zip(tensors[0::2], tensors[1::2], strict=True))


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))
