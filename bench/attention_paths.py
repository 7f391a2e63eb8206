"""What the eager attention path (for models that sdpa cannot serve: soft-capping, attention sinks) costs
against sdpa, on the same model and the same caches, in one run.

The engine in-process serves SmolLM2 once with each path; for each, `--sessions` sessions with caches of
about --history-tokens tokens in the KV arena send a new message together (the batched decode step), then
one session alone (a single stream's step and the prefill of the new message on top of its cache).

    .venv/bin/python bench/attention_paths.py [--sessions 16] [--history-tokens 500]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from common import synthetic_history, write_result
from decode_floor import run_turns

from chatd.config import Settings
from chatd.engine.engine import Engine
from chatd.model.loader import load_model
from chatd.model.prompt import PromptRenderer
from sessions import Session

HERE = Path(__file__).parent


def measure(attention: str, sessions_count: int, history_tokens: int, new_tokens: int, device: str) -> dict:
    loaded = load_model("smollm2-135m", device=device)
    loaded.model.set_attn_implementation(attention)
    engine = Engine(lambda: loaded, Settings(device=device, max_batch=sessions_count))
    engine.start()
    engine.ready.wait()
    scenario = json.loads((HERE / "scenarios" / "internet_support.json").read_text())
    history = synthetic_history(scenario, PromptRenderer(loaded.tokenizer), history_tokens)
    sessions = [Session(f"s{i}", system=scenario["system"], messages=list(history)) for i in range(sessions_count)]
    run_turns(engine, sessions, "Hello again.", 1)  # every cache built once, in the arena
    together = run_turns(engine, sessions, "Any news on my case?", new_tokens)
    alone = [run_turns(engine, sessions[:1], f"And now? ({i})", new_tokens)[0] for i in range(3)]
    engine.stop()
    return {
        "attention": engine.runner.attention,
        "batch_step_ms": 1000 * statistics.median(gap for r in together for gap in r.inter_token_s[2:-2]),
        "single_step_ms": 1000 * statistics.median(gap for r in alone for gap in r.inter_token_s[2:-2]),
        "prefill_ms": statistics.median(r.timings["prefill_ms"] for r in alone),
        "cached_tokens": alone[0].cached_tokens, "prompt_tokens": alone[0].prompt_tokens,
        "greedy_tokens": [r.token_ids for r in together],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--history-tokens", type=int, default=500)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--output", type=Path, default=HERE / "results" / "attention_paths.json")
    args = parser.parse_args()
    rows = [measure(path, args.sessions, args.history_tokens, args.new_tokens, args.device)
            for path in ("sdpa", "eager")]
    sdpa, eager = rows
    for row in rows:
        print(f"{row['attention']:>5}: batch {args.sessions} step {row['batch_step_ms']:7.1f} ms, single step "
              f"{row['single_step_ms']:6.1f} ms, prefill of {row['prompt_tokens'] - row['cached_tokens']} new "
              f"tokens on {row['cached_tokens']} cached {row['prefill_ms']:6.1f} ms")
    ratio = {key: eager[key] / sdpa[key] for key in ("batch_step_ms", "single_step_ms", "prefill_ms")}
    print(f"eager / sdpa: batch step {ratio['batch_step_ms']:.2f}x, single step {ratio['single_step_ms']:.2f}x, "
          f"prefill {ratio['prefill_ms']:.2f}x; same greedy replies: {eager['greedy_tokens'] == sdpa['greedy_tokens']}")
    write_result(args.output, {"device": str(torch.device(args.device if args.device != "auto" else "cpu")),
                               "torch_threads": torch.get_num_threads(), "rows": rows})


if __name__ == "__main__":
    main()
