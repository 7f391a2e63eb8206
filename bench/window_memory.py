"""What sliding-window layers would save if the KV arena kept only each layer's window: the bytes a session
holds today (every token of every layer) against what its layers' windows need, for the shapes of models
teams deploy. The shapes are those their published config.json files give (built here from transformers'
config classes, nothing downloaded); `chatd kv-size --model DIR` prints the same for any checkpoint.

    .venv/bin/python bench/window_memory.py [--tokens 2048 8192 32768]
"""

from __future__ import annotations

import argparse

import torch
import transformers

from cache_store import KVGeometry, kv_bytes_per_token

SHAPES = {  # name -> (config class, the fields of its published config.json that size its KV cache)
    "gemma-3-1b (bf16)": ("Gemma3TextConfig", dict(num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                                                   head_dim=256, sliding_window=512, sliding_window_pattern=6)),
    "gemma-3-27b (bf16)": ("Gemma3TextConfig", dict(num_hidden_layers=62, num_attention_heads=32,
                                                    num_key_value_heads=16, head_dim=128, sliding_window=1024,
                                                    sliding_window_pattern=6)),
    "gemma-2-9b (bf16)": ("Gemma2Config", dict(num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8,
                                               head_dim=256, sliding_window=4096)),
    "gpt-oss-20b (bf16)": ("GptOssConfig", dict(num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
                                                head_dim=64, sliding_window=128)),
    "Mistral-7B-v0.1 (bf16)": ("MistralConfig", dict(num_hidden_layers=32, num_attention_heads=32,
                                                     num_key_value_heads=8, head_dim=128, sliding_window=4096)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768])
    args = parser.parse_args()
    print(f"{'model':<24} {'layers':>14} " + " ".join(f"{f'{n} tok: held -> needed':>30}" for n in args.tokens))
    for name, (class_name, fields) in SHAPES.items():
        config = getattr(transformers, class_name)(**fields)
        shape = KVGeometry.of(config)
        per_token = kv_bytes_per_token(config, torch.bfloat16)
        cells = []
        for tokens in args.tokens:
            held, share = per_token * tokens, shape.needed_share(tokens)
            cells.append(f"{held / 2**20:>9,.0f} -> {held * share / 2**20:>7,.0f} MB ({1 / share:4.1f}x)")
        windows = "/".join(str(w) for w in sorted({w for w in shape.windows if w}))
        print(f"{name:<24} {f'{shape.sliding_layers}/{shape.layers} w{windows}':>14} " +
              " ".join(f"{cell:>30}" for cell in cells))


if __name__ == "__main__":
    main()
