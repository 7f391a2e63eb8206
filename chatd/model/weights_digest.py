"""A digest of a model's weights by their content, for the model identity every cache is stamped with: two
checkpoints served under one name (a fine-tune rolled out over the old one) never share a cache, on any tier.

Each weight file is hashed once (xxh3-128 over its bytes) and the digest kept in the cache folder, keyed by the
file's path, size, modification time and inode: a later start reads it back, and a changed file is hashed again. A
model whose files cannot be found (built in memory) is hashed from its parameters.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

import torch
import xxhash
from transformers import PreTrainedModel

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
BLOCK_BYTES = 16 * 2**20


def weights_digest(source: str | Path, model: PreTrainedModel, cache_dir: Path) -> str:
    """The digest of the weights `model` was loaded from (`source`: a checkpoint folder or a Hugging Face id), or
    of its parameters when no file holds them."""
    files = weight_files(source)
    if not files:
        return parameters_digest(model)
    digest = xxhash.xxh3_128()
    for path in files:
        digest.update(f"{path.name}:{file_digest(path, cache_dir)};".encode())
    return digest.hexdigest()


def weight_files(source: str | Path) -> list[Path]:
    """The weight files of a checkpoint folder, or of a Hugging Face id's snapshot already on this machine (nothing
    is downloaded); none when there are none."""
    folder = Path(source)
    if not folder.is_dir():
        try:
            from huggingface_hub import snapshot_download
            folder = Path(snapshot_download(str(source), local_files_only=True))
        except Exception:  # (no snapshot here, or not an id at all: the parameters are hashed instead)
            return []
    return sorted(path for path in folder.iterdir() if path.is_file() and path.name.endswith(WEIGHT_SUFFIXES))


def file_digest(path: Path, cache_dir: Path) -> str:
    """The file's digest, from the cache folder when the file has not changed since it was hashed."""
    stat = path.stat()
    real = str(path.resolve())
    key = {"path": real, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino}
    record = cache_dir / "weight-digests" / f"{xxhash.xxh3_64_hexdigest(real.encode())}.json"
    try:
        kept = json.loads(record.read_text())
        if {name: kept.get(name) for name in key} == key:
            return kept["digest"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    digest = xxhash.xxh3_128()
    with path.open("rb") as weights:
        while block := weights.read(BLOCK_BYTES):
            digest.update(block)
    found = digest.hexdigest()
    log.info("hashed the weights in %s once (%.0f MB); kept in %s", path, stat.st_size / 2**20, record.parent)
    _write_atomically(record, json.dumps({**key, "digest": found}))
    return found


def parameters_digest(model: PreTrainedModel) -> str:
    """A digest of every parameter and buffer's bytes (a model built in memory)."""
    digest = xxhash.xxh3_128()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        digest.update(name.encode())
        digest.update(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _write_atomically(path: Path, text: str) -> None:
    """Best effort (a read-only cache folder only means hashing again next start)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as staged:
            staged.write(text)
        os.replace(staged.name, path)
    except OSError as error:
        log.warning("could not keep the weights' digest in %s (%s); it is computed again at the next start",
                    path.parent, error)
