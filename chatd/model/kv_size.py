"""`chatd kv-size`: how large one session's KV cache is for a model, and how many fit a budget."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig

from cache_store import KVGeometry, kv_bytes_per_token
from chatd.model.loader import BUNDLED_MODELS, converted_checkpoint, default_cache_dir

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
INT8 = "int8"  # the host and remote tiers' quantised copy (--host-kv-dtype int8)


def _bytes_per_token(config, shape: KVGeometry, name: str) -> int:
    if name == INT8:  # one byte per key and value element, and a float32 scale per token and head for values
        return shape.layers * shape.kv_heads * (2 * shape.head_dim + 4)
    return kv_bytes_per_token(config, DTYPES[name])


def kv_size_table(model: str, tokens: list[int], dtypes: list[str], budget_mb: float | None,
                  cache_dir: Path | None = None, shared_prompt: int = 0) -> str:
    """The `chatd kv-size` table: bytes per token and per session, and sessions per budget; with a shared
    prompt, sessions per GB when each holds its own copy of it and when it is held once."""
    source = converted_checkpoint(model, cache_dir or default_cache_dir()) if model in BUNDLED_MODELS else model
    config = AutoConfig.from_pretrained(source)
    shape = KVGeometry.of(config)
    lines = [f"{model}: {shape.layers} layers{_windows_note(shape)}, {shape.kv_heads} KV heads "
             f"(of {shape.attention_heads}), head_dim {shape.head_dim}"]
    header = f"{'dtype':<9} {'bytes/token':>11} " + " ".join(f"{f'{n} tok':>12}" for n in tokens)
    if budget_mb:
        header += "   " + " ".join(f"{f'n@{n}':>8}" for n in tokens)
    lines.append(header)
    for name in dtypes:
        per_token = _bytes_per_token(config, shape, name)
        row = f"{name:<9} {per_token:>11,} " + " ".join(f"{_human(per_token * n):>12}" for n in tokens)
        if budget_mb:
            row += "   " + " ".join(f"{int(budget_mb * 2**20 // (per_token * n)):>8,}" for n in tokens)
        lines.append(row)
        if shape.sliding_layers:
            needed = [per_token * n * shape.needed_share(n) for n in tokens]
            row = f"{'  windows':<21} " + " ".join(f"{_human(int(b)):>12}" for b in needed)
            if budget_mb:
                row += "   " + " ".join(f"{int(budget_mb * 2**20 // b):>8,}" for b in needed)
            lines.append(row)
    if budget_mb:
        lines.append(f"n@T: sessions of T tokens that a {budget_mb:g} MB budget holds")
    if shared_prompt:
        lines += shared_prompt_rows(config, shape, tokens, dtypes, shared_prompt)
    if shape.sliding_layers:
        lines.append("windows: what the layers' sliding windows need of those bytes (a sliding layer only its last "
                     "window - 1 tokens); the KV arena keeps every token of every layer")
    if INT8 in dtypes:
        lines.append(f"{INT8}: an offloaded copy with --host-kv-dtype/--remote-kv-dtype int8 (plus "
                     f"{_human(4 * shape.layers * shape.kv_heads * shape.head_dim)} of key scales per session)")
    return "\n".join(lines)


def shared_prompt_rows(config, shape: KVGeometry, tokens: list[int], dtypes: list[str], prompt: int) -> list[str]:
    """Sessions per GB of device budget whose conversations of T tokens follow a shared prompt of `prompt`
    tokens: each with a private copy of the prompt, and with the prompt held once (a shared segment)."""
    lines = [f"sessions per GB after a {prompt}-token shared prompt (T: each session's own tokens): "
             "private copies -> held once",
             f"{'dtype':<9} " + " ".join(f"{f'T={n}':>18}" for n in tokens)]
    for name in dtypes:
        if name == INT8:
            continue  # the device holds the model's dtype; int8 is a host and Redis copy
        per_token = _bytes_per_token(config, shape, name)
        cells = [f"{int(2**30 // (per_token * (prompt + n))):,} -> "
                 f"{max(0, int((2**30 - per_token * prompt) // (per_token * n))):,}" for n in tokens]
        lines.append(f"{name:<9} " + " ".join(f"{cell:>18}" for cell in cells))
    return lines


def _windows_note(shape: KVGeometry) -> str:
    windows = sorted({window for window in shape.windows if window is not None})
    if not windows:
        return ""
    return f" ({shape.sliding_layers} sliding, window {'/'.join(map(str, windows))} tokens)"


def kv_report(shape: KVGeometry, bytes_per_token: int, tokens: tuple[int, ...] = (512, 2048, 8192)) -> dict:
    """For `/v1/stats`: the layers' windows, and what a session of N tokens holds against what its windows need."""
    return {"layers": shape.layers, "sliding_layers": shape.sliding_layers,
            "windows": sorted({window for window in shape.windows if window is not None}),
            "bytes_per_token": bytes_per_token,
            "sessions": [{"tokens": n, "holds_bytes": bytes_per_token * n,
                          "windows_need_bytes": int(bytes_per_token * n * shape.needed_share(n))} for n in tokens]}


def _human(nbytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{nbytes} B"
        nbytes /= 1024
    raise AssertionError("unreachable")
