"""What an int8 restore costs in accuracy: replies from an int8 copy of each turn's cache against
replies from the exact cache, over the bench scenarios, turn by turn.

For every scenario the conversation follows the exact (greedy) replies. At each turn after the first,
the history's cache is prefilled exactly; a copy goes through `quantize`/`dequantize` as an int8 host
or Redis tier would store it; both then take the new message and reply greedily. Reported: the share
of replies identical token for token, the mean length of the identical prefix, the KL divergence of
the next-token distribution at the first reply token, and the deep check's distance for int8 copies
(which sets its int8 tolerance).

    .venv/bin/python bench/int8_accuracy.py [--turns 6] [--max-new-tokens 32]

`--round-trips 1 3 6 --groups 16 32 64 0`: what repeated offloads do, per key-scale group size (0: one
group for the whole cache, the layout before groups). At each turn the history is built in as many pieces as
there are round trips: prefill a piece on top of the cache, send the cache through int8 and back (as an
offload and a restore would, the whole cache each time), and so on; then both reply. A group size whose
agreement falls with the round trips lets the error add up.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from common import write_result
from transformers import DynamicCache

from cache_store.host.quantize import GROUP_TOKENS, dequantize, quantize
from cache_store.lookup import common_prefix_length
from chatd.model.loader import load_model
from chatd.model.prompt import PromptRenderer
from sessions import Message

HERE = Path(__file__).parent


def cache_of(model, ids: list[int]) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=1)
    return cache


def int8_copy(model, cache: DynamicCache, group_tokens: int = GROUP_TOKENS) -> DynamicCache:
    tensors = [(layer.keys, layer.values) for layer in cache.layers]
    group = group_tokens or max(1, tensors[0][0].shape[2])  # 0: one group over every token
    quantized, scales = quantize(tensors, group)
    copy = DynamicCache(config=model.config)
    for index, (keys, values) in enumerate(dequantize(quantized, scales, model.dtype, group)):
        copy.update(keys, values, index)
    return copy


def round_tripped_cache(model, ids: list[int], round_trips: int, group_tokens: int) -> DynamicCache:
    """A cache of `ids` built in `round_trips` pieces, each followed by a trip through int8 and back."""
    cache = DynamicCache(config=model.config)
    bounds = [len(ids) * (piece + 1) // round_trips for piece in range(round_trips)]
    start = 0
    for end in bounds:
        model(input_ids=torch.tensor([ids[start:end]]), cache=cache, use_cache=True, logits_to_keep=1)
        cache, start = int8_copy(model, cache, group_tokens), end
    return cache


def round_trips(model, renderer, stop, loaded, args) -> dict:
    """Agreement with the exact replies per (group size, round trips), over every scenario's turns 2 to
    `--turns` (the conversation follows the exact replies)."""
    cells: dict[str, list[bool]] = {}
    for path in sorted((HERE / "scenarios").glob("*.json")):
        scenario = json.loads(path.read_text())
        messages = [Message("system", scenario["system"])]
        for turn, content in enumerate(scenario["turns"][:args.turns], start=1):
            prompt = renderer.render([*messages, Message("user", content)])
            history = common_prefix_length(renderer.render(messages, add_generation_prompt=False), prompt) \
                if turn > 1 else 0
            cache = cache_of(model, prompt[:history]) if history else DynamicCache(config=model.config)
            exact, _ = reply(model, cache, prompt[history:], stop, args.max_new_tokens)
            if turn > 1:
                for group in args.groups:
                    for trips in args.round_trips:
                        approx, _ = reply(model, round_tripped_cache(model, prompt[:history], trips, group),
                                          prompt[history:], stop, args.max_new_tokens)
                        cells.setdefault(f"group {group or 'whole'}, {trips} round trips", []).append(approx == exact)
                print(f"{scenario['name']:<18} turn {turn}: {history:>4} cached", flush=True)
            messages += [Message("user", content), Message("assistant", loaded.tokenizer.decode(exact))]
    return {cell: f"{sum(same)} of {len(same)}" for cell, same in cells.items()}


def reply(model, cache: DynamicCache, new_ids: list[int], stop: set[int], max_new_tokens: int
          ) -> tuple[list[int], torch.Tensor]:
    """Greedy reply ids after `new_ids` on top of `cache`, and the logits of the first reply token."""
    logits = model(input_ids=torch.tensor([new_ids]), cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
    first, ids = logits.float(), []
    while len(ids) < max_new_tokens:
        token = int(logits.argmax())
        if token in stop:
            break
        ids.append(token)
        logits = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
    return ids, first


def deep_distance(model, cache: DynamicCache, ids: list[int]) -> float:
    """The deep check's distance for `cache` (which covers `ids`): the last token's logits fed on top of
    the rest of it, against a prefill from scratch."""
    cache.crop(-1)
    from_cache = model(input_ids=torch.tensor([ids[-1:]]), cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
    from_scratch = model(input_ids=torch.tensor([ids]), cache=DynamicCache(config=model.config), use_cache=True,
                         logits_to_keep=1).logits[0, -1]
    return float((from_cache - from_scratch).abs().max() / from_scratch.abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--round-trips", type=int, nargs="*", default=[])
    parser.add_argument("--groups", type=int, nargs="+", default=[GROUP_TOKENS])
    parser.add_argument("--output", type=Path, default=HERE / "results" / "int8_accuracy.json")
    args = parser.parse_args()
    loaded = load_model("smollm2-135m", device="cpu", dtype="float32")
    model, renderer, stop = loaded.model, PromptRenderer(loaded.tokenizer), set(loaded.stop_token_ids)
    if args.round_trips:
        with torch.inference_mode():
            summary = round_trips(model, renderer, stop, loaded, args)
        print(json.dumps(summary, indent=2))
        write_result(args.output.with_name("int8_round_trips.json"), summary)
        return
    rows = []
    with torch.inference_mode():
        for path in sorted((HERE / "scenarios").glob("*.json")):
            scenario = json.loads(path.read_text())
            messages = [Message("system", scenario["system"])]
            for turn, content in enumerate(scenario["turns"][:args.turns], start=1):
                prompt = renderer.render([*messages, Message("user", content)])
                if turn > 1:
                    history = common_prefix_length(renderer.render(messages, add_generation_prompt=False), prompt)
                    exact_cache = cache_of(model, prompt[:history])
                    quantized_cache = int8_copy(model, exact_cache)
                    distance = deep_distance(model, int8_copy(model, exact_cache), prompt[:history])
                    exact, exact_logits = reply(model, exact_cache, prompt[history:], stop, args.max_new_tokens)
                    approx, approx_logits = reply(model, quantized_cache, prompt[history:], stop, args.max_new_tokens)
                    kl = float(torch.nn.functional.kl_div(approx_logits.log_softmax(-1), exact_logits.log_softmax(-1),
                                                          log_target=True, reduction="sum"))
                    rows.append({"scenario": scenario["name"], "turn": turn, "cached_tokens": history,
                                 "identical": exact == approx, "identical_prefix": common_prefix_length(exact, approx),
                                 "reply_tokens": len(exact), "kl_first_token": kl, "deep_distance": distance})
                    print(f"{scenario['name']:<18} turn {turn}: {history:>4} cached, identical {exact == approx!s:<5} "
                          f"prefix {rows[-1]['identical_prefix']:>2}/{len(exact):<2} KL {kl:.2e} deep {distance:.2e}",
                          flush=True)
                else:
                    exact, _ = reply(model, DynamicCache(config=model.config), prompt, stop, args.max_new_tokens)
                messages += [Message("user", content), Message("assistant", loaded.tokenizer.decode(exact))]
    summary = {"replies": len(rows), "identical_share": sum(r["identical"] for r in rows) / len(rows),
               "mean_identical_prefix": statistics.mean(r["identical_prefix"] for r in rows),
               "mean_reply_tokens": statistics.mean(r["reply_tokens"] for r in rows),
               "kl_first_token_mean": statistics.mean(r["kl_first_token"] for r in rows),
               "kl_first_token_max": max(r["kl_first_token"] for r in rows),
               "deep_distance_max": max(r["deep_distance"] for r in rows),
               "deep_distance_median": statistics.median(r["deep_distance"] for r in rows)}
    print(json.dumps(summary, indent=2))
    write_result(args.output, {"summary": summary, "rows": rows})


if __name__ == "__main__":
    main()
