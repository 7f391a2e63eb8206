"""The engine's batched decode step against the compute floor, in one run.

For each batch size, the engine in-process (no sockets) decodes that many sessions at once, each with
a cache of about --history-tokens tokens in the KV arena; a step's time is the median gap between
reply tokens while the whole batch decodes together. The floor is one forward step of the same model
at the same batch size on a nearly empty cache (what the step would cost if reading and writing the
caches were free).

    .venv/bin/python bench/decode_floor.py [--batches 1 4 8 16 32] [--history-tokens 500]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
from pathlib import Path

import torch
from common import median_ms, synthetic_history, write_result
from transformers import DynamicCache

from chatd.config import Settings
from chatd.engine.engine import Engine
from chatd.engine.sampling import SamplingParams
from chatd.engine.turn import TokenText, Turn, TurnResult
from chatd.model.loader import load_model
from chatd.model.prompt import PromptRenderer
from sessions import Session

HERE = Path(__file__).parent


def run_turns(engine: Engine, sessions: list[Session], content: str | list[str], max_new_tokens: int,
              owner: str | None = None, **params) -> list[TurnResult]:
    """One turn of every session (`content`, or each its own), submitted at once, as `owner`'s key; their
    results."""
    contents = [content] * len(sessions) if isinstance(content, str) else content
    results: list[TurnResult | None] = [None] * len(sessions)
    done = threading.Semaphore(0)

    def emitter(index: int):
        def emit(event) -> None:
            if not isinstance(event, TokenText):
                results[index] = event
                done.release()
        return emit

    for index, (session, text) in enumerate(zip(sessions, contents, strict=True)):
        engine.submit(Turn(turn_id=f"{session.session_id}-{len(session.messages)}", session_id=session.session_id,
                           messages=session.prompt_messages(text), emit=emitter(index), owner=owner,
                           params=SamplingParams(max_new_tokens=max_new_tokens, **params),
                           session_version=session.version))
    for _ in sessions:
        done.acquire()
    for session, text, result in zip(sessions, contents, results, strict=True):
        assert isinstance(result, TurnResult), result
        session.record_turn(text, result.content)
    return results


def floor_step_ms(loaded, batch: int) -> float:
    """One decode step of `batch` rows on a nearly empty cache: the model's compute alone."""
    ids = torch.randint(100, 1000, (batch, 1), device=loaded.device)
    return median_ms(lambda: loaded.model(input_ids=ids, cache=DynamicCache(config=loaded.model.config),
                                          use_cache=True, logits_to_keep=1), 10)


def device_held_per_kv(engine: Engine) -> float:
    """Bytes the device tier holds over the bytes of its caches' keys and values (1.0: nothing wasted), read
    while the engine is idle between two batches."""
    stats = engine.cache.stats()
    return stats["device_bytes"] / stats["device_kv_bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--history-tokens", type=int, default=500)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--output", type=Path, default=HERE / "results" / "decode_floor.json")
    args = parser.parse_args()

    loaded = load_model("smollm2-135m", device=args.device)
    # Drafts off: a step with drafts gives a row several tokens at once, and the gap between them is no step.
    engine = Engine(lambda: loaded, Settings(device=args.device, max_batch=max(args.batches), speculation="off"))
    engine.start()
    engine.ready.wait()
    scenario = json.loads((HERE / "scenarios" / "internet_support.json").read_text())
    history = synthetic_history(scenario, PromptRenderer(loaded.tokenizer), args.history_tokens)
    sessions = [Session(f"s{i}", system=scenario["system"], messages=list(history)) for i in range(max(args.batches))]
    run_turns(engine, sessions, "Hello again.", 1)  # every cache built once, in the arena
    rows = []
    for batch in args.batches:
        results = run_turns(engine, sessions[:batch], "Any news on my case?", args.new_tokens)
        steady = [gap for result in results for gap in result.inter_token_s[2:-2]]
        step_ms = 1000 * statistics.median(steady)
        with torch.inference_mode():
            floor_ms = floor_step_ms(loaded, batch)
        held_per_kv = device_held_per_kv(engine)
        rows.append({"batch": batch, "cached_tokens": results[0].cached_tokens, "step_ms": step_ms,
                     "floor_ms": floor_ms, "of_floor": floor_ms / step_ms,
                     "tokens_per_s": batch * 1000 / step_ms, "device_held_per_kv": held_per_kv})
        print(f"batch {batch:>3}: {step_ms:7.1f} ms per step ({batch * 1000 / step_ms:6.1f} tokens/s), floor "
              f"{floor_ms:7.1f} ms, {floor_ms / step_ms:.2f} of the floor; caches of ~{results[0].cached_tokens} "
              f"tokens; the device tier holds {held_per_kv:.2f}x their keys and values", flush=True)
    engine.stop()
    write_result(args.output, {"device": str(loaded.device), "dtype": str(loaded.model.dtype),
                               "torch_threads": torch.get_num_threads(), "rows": rows})


if __name__ == "__main__":
    main()
