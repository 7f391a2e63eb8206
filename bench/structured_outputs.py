"""Tools and structured outputs (issue 32): what the grammar costs, and what the session cache saves an agent.

- masks: grammar compile time (cold, and from chatd's cache) and the time to fill the next-token masks of 1
  and 16 replies walking realistic support schemas, for llguidance (chatd's choice) and, when it is installed
  (`pip install xgrammar`), xgrammar; then SmolLM2's decode step at batch 1 and 16 with every row held to a
  schema against the same rows free, in the engine (the mask is filled while the model computes the logits).
- replies: 100 json_schema replies over the support schemas, 16 at a time in the engine, sampled at
  temperature 0.8: how many validate (`jsonschema`), how many finished.
- agent: an agent loop of six tool rounds through the `openai` SDK against `chatd serve` with and without
  `--no-session-cache`: TTFT and prompt tokens read from the cache per round.

    .venv/bin/python bench/structured_outputs.py --measure masks replies agent
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SCHEMAS = {
    "refund": {"type": "object", "properties": {
        "order_id": {"type": "string", "pattern": "^NW-[0-9]{6}$"},
        "reason": {"type": "string", "enum": ["damaged", "late", "wrong_item", "not_as_described", "other"]},
        "amount": {"type": "number", "minimum": 0, "maximum": 2000},
        "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}, "quantity": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 9}},
            "required": ["sku", "quantity"], "additionalProperties": False}}},
        "required": ["order_id", "reason", "amount", "items"], "additionalProperties": False},
    "ticket": {"type": "object", "properties": {
        "category": {"type": "string", "enum": ["billing", "outage", "hardware", "account", "other"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 4},
        "summary": {"type": "string", "minLength": 5, "maxLength": 120},
        "customer": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 60},
                                                      "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9.]+$",
                                                                "maxLength": 80},
                                                      "vip": {"type": "boolean"}},
                     "required": ["name", "email", "vip"], "additionalProperties": False}},
        "required": ["category", "priority", "summary", "customer"], "additionalProperties": False},
    "appointment": {"type": "object", "properties": {
        "date": {"type": "string", "pattern": "^2027-[01][0-9]-[0-3][0-9]$"},
        "slot": {"type": "string", "enum": ["morning", "afternoon", "evening"]},
        "technician_needed": {"type": "boolean"}, "notes": {"type": "string", "maxLength": 100}},
        "required": ["date", "slot", "technician_needed"], "additionalProperties": False},
    "survey": {"type": "object", "properties": {
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
        "topics": {"type": "array", "maxItems": 3, "items": {"type": "string", "enum": ["speed", "price", "support",
                                                                                     "coverage"]}},
        "comment": {"type": "string", "maxLength": 100}},
        "required": ["score", "topics"], "additionalProperties": False},
    "plan_change": {"type": "object", "properties": {
        "from_plan": {"type": "string", "enum": ["basic", "plus", "pro"]},
        "to_plan": {"type": "string", "enum": ["basic", "plus", "pro"]},
        "effective": {"type": "string", "enum": ["now", "next_cycle"]},
        "monthly_delta": {"type": "number", "minimum": -50, "maximum": 50}},
        "required": ["from_plan", "to_plan", "effective", "monthly_delta"], "additionalProperties": False},
}
SAMPLES = {
    "refund": {"order_id": "NW-204518", "reason": "damaged", "amount": 149.9,
               "items": [{"sku": "RTR-200", "quantity": 1}, {"sku": "CBL-010", "quantity": 2}]},
    "ticket": {"category": "outage", "priority": 2, "summary": "Internet down since 8am in the whole building",
               "customer": {"name": "Ada Lovelace", "email": "ada@example.org", "vip": False}},
    "appointment": {"date": "2027-01-14", "slot": "morning", "technician_needed": True, "notes": "Gate code 4411"},
    "survey": {"score": 7, "topics": ["speed", "support"], "comment": "Fast fix, slow hotline."},
    "plan_change": {"from_plan": "basic", "to_plan": "pro", "effective": "next_cycle", "monthly_delta": 25},
}
QUESTIONS = {"refund": "Order NW-204518: the router arrived broken and one cable is missing. Refund please.",
             "ticket": "I am Ada Lovelace (ada@example.org); our internet has been down since 8am.",
             "appointment": "Can a technician come on January 14th in the morning? The gate code is 4411.",
             "survey": "Rate us: the fix was fast but the hotline was slow.",
             "plan_change": "Move me from basic to pro at the next billing cycle."}


MAX_REPLY_TOKENS = 400  # room for the longest reply the schemas allow (their strings are capped at 120 characters)


def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1000, 3)


def masks(loaded) -> dict:
    """Compile and mask-fill times per library, on the served model's vocabulary."""
    import torch

    from chatd.engine.grammar import GrammarCompiler, GrammarSpec, fill_masks
    vocab = loaded.model.config.vocab_size
    report: dict = {"llguidance": {}, "xgrammar": {}}
    compiler = GrammarCompiler(loaded.tokenizer, vocab, loaded.stop_token_ids)
    docs = {name: loaded.tokenizer(json.dumps(SAMPLES[name], separators=(",", ":")), add_special_tokens=False)
            ["input_ids"] for name in SCHEMAS}
    for name, schema in SCHEMAS.items():
        spec = GrammarSpec("json_schema", json.dumps(schema))
        started = time.perf_counter()
        compiled = compiler.compile(spec).result()
        cold = time.perf_counter() - started
        started = time.perf_counter()
        compiler.compile(spec).result()
        cached = time.perf_counter() - started
        steps: dict[int, list[float]] = {1: [], 16: []}
        for batch in steps:
            replies = [compiler.start(compiled) for _ in range(batch)]
            for token in docs[name]:
                started = time.perf_counter()
                fill_masks(compiler, replies)
                steps[batch].append(time.perf_counter() - started)
                for reply in replies:
                    reply.accept(token, "")
            assert all(reply.error is None for reply in replies), f"llguidance refused the {name} sample"
        report["llguidance"][name] = {"compile_cold_ms": round(cold * 1000, 2), "compile_cached_ms":
                                      round(cached * 1000, 3), "mask_ms_batch1": _median_ms(steps[1]),
                                      "mask_ms_batch16": _median_ms(steps[16]), "tokens": len(docs[name])}
    try:
        import xgrammar as xgr
    except ImportError:
        report["xgrammar"] = "not installed (pip install xgrammar)"
        return report
    info = xgr.TokenizerInfo.from_huggingface(loaded.tokenizer, vocab_size=vocab,
                                              stop_token_ids=sorted(loaded.stop_token_ids))
    xcompiler = xgr.GrammarCompiler(info, cache_enabled=True)
    for name, schema in SCHEMAS.items():
        started = time.perf_counter()
        # The samples are compact JSON, as llguidance's grammar writes it: the same separators, so that every
        # token is accepted and each mask is a real one (a matcher that refused a token fills nothing useful).
        compiled = xcompiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
        cold = time.perf_counter() - started
        started = time.perf_counter()
        xcompiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
        cached = time.perf_counter() - started
        steps = {1: [], 16: []}
        for batch in steps:
            matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
            bitmask = torch.full((batch, (vocab + 31) // 32), -1, dtype=torch.int32)
            for token in docs[name]:
                started = time.perf_counter()
                for row, matcher in enumerate(matchers):
                    matcher.fill_next_token_bitmask(bitmask, row)
                steps[batch].append(time.perf_counter() - started)
                for matcher in matchers:
                    assert matcher.accept_token(token), f"xgrammar refused a token of the {name} sample"
        report["xgrammar"][name] = {"compile_cold_ms": round(cold * 1000, 2), "compile_cached_ms":
                                    round(cached * 1000, 3), "mask_ms_batch1": _median_ms(steps[1]),
                                    "mask_ms_batch16": _median_ms(steps[16]), "tokens": len(docs[name])}
    return report


def _run_turns(engine, turns: list[tuple[str, object, int]], first_seed: int = 0) -> list:
    """Submit (question, grammar, max tokens) turns at once, seeded from `first_seed` on; their results in order."""
    from chatd.engine.sampling import SamplingParams
    from chatd.engine.turn import TokenText, Turn
    from sessions import Session
    results, finished = {}, threading.Event()

    def emitter(index):
        def emit(event):
            if not isinstance(event, TokenText):
                results[index] = event
                if len(results) == len(turns):
                    finished.set()
        return emit

    for index, (question, grammar, tokens) in enumerate(turns):
        session = Session(f"b{time.monotonic_ns()}-{index}", system="File the customer's request as JSON.")
        engine.submit(Turn(f"t{index}", session.session_id, session.prompt_messages(question), SamplingParams(
            max_new_tokens=tokens, temperature=0.8, seed=first_seed + index, grammar=grammar), emitter(index)))
    finished.wait(1200)
    return [results[i] for i in range(len(turns))]


def decode_steps(loaded) -> dict:
    """The decode step at batch 1 and 16, every row held to a schema against the same rows free."""
    from chatd.engine.grammar import GrammarSpec
    from tests.support import running_engine
    report = {}
    with running_engine(loaded, max_batch=16) as engine:
        grammar = engine.grammars.compile(GrammarSpec("json_schema", json.dumps(SCHEMAS["ticket"]))).result()
        for batch in (1, 16):
            for constrained in (False, True, False, True):
                engine.grammars.stats.mask_ms.clear()
                results = _run_turns(engine, [(QUESTIONS["ticket"], grammar if constrained else None, 40)] * batch)
                per_step = [r.timings["decode_ms"] / max(1, r.completion_tokens - 1) for r in results]
                key = f"batch{batch}_{'schema' if constrained else 'free'}_step_ms"
                report.setdefault(key, []).append(round(statistics.median(per_step), 2))
                if constrained:
                    report.setdefault(f"batch{batch}_mask_fill_ms", []).append(
                        round(statistics.median(engine.grammars.stats.mask_ms), 3))
    return {key: statistics.median(values) for key, values in report.items()}


def replies(loaded, count: int) -> dict:
    """`count` json_schema replies over the support schemas, 16 at a time: how many validate."""
    import jsonschema

    from chatd.engine.grammar import GrammarSpec
    from tests.support import running_engine
    names = list(SCHEMAS)
    valid, finished, invalid = 0, 0, []
    with running_engine(loaded, max_batch=16) as engine:
        grammars = {n: engine.grammars.compile(GrammarSpec("json_schema", json.dumps(SCHEMAS[n]))).result()
                    for n in names}
        started = time.perf_counter()
        for first in range(0, count, 16):
            chosen = [names[i % len(names)] for i in range(first, min(count, first + 16))]
            for name, result in zip(chosen, _run_turns(engine, [(QUESTIONS[n], grammars[n], MAX_REPLY_TOKENS)
                                                                 for n in chosen], first_seed=first),
                                    strict=True):
                finished += result.finish_reason == "stop"
                try:
                    jsonschema.validate(json.loads(result.content), SCHEMAS[name])
                    valid += 1
                except (ValueError, jsonschema.ValidationError) as error:
                    invalid.append((name, result.finish_reason, str(error)[:80]))
    return {"replies": count, "valid": valid, "finished_stop": finished, "invalid": invalid[:5],
            "seconds": round(time.perf_counter() - started, 1)}


async def agent(loaded) -> dict:
    """Six tool rounds through the openai SDK, with and without the session cache: TTFT and cached tokens."""
    import openai

    from chatd.api.server import ChatServer
    from chatd.config import Settings
    tools = [{"type": "function", "function": {"name": "lookup_order", "parameters": {
        "type": "object", "properties": {"order_id": {"type": "string", "pattern": "^NW-[0-9]{6}$"}},
        "required": ["order_id"], "additionalProperties": False}}},
        {"type": "function", "function": {"name": "open_ticket", "parameters": SCHEMAS["ticket"]}}]
    report = {}
    for label, settings in (("session_cache", Settings(port=0)), ("no_session_cache",
                                                                  Settings(port=0, session_cache=False))):
        async with ChatServer(settings, load=lambda: loaded) as server:
            await server.wait_ready()
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
            messages = [{"role": "system", "content": "You are Northwind's support agent. Use the tools."},
                        {"role": "user", "content": QUESTIONS["refund"]}]
            rounds = []
            for _ in range(6):
                started = time.perf_counter()
                first_at = None
                async with client.chat.completions.stream(model="smollm2-135m", messages=messages, tools=tools,
                                                          tool_choice="required", max_tokens=80, temperature=0,
                                                          stream_options={"include_usage": True}) as stream:
                    async for _event in stream:
                        first_at = first_at or time.perf_counter()
                    completion = await stream.get_final_completion()
                message = completion.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                for call in message.tool_calls or ():
                    messages.append({"role": "tool", "tool_call_id": call.id,
                                     "content": json.dumps({"status": "ok", "detail": "in transit, 2 days late"})})
                usage = completion.usage
                rounds.append({"ttft_ms": round((first_at - started) * 1000), "prompt_tokens": usage.prompt_tokens,
                               "cached_tokens": usage.prompt_tokens_details.cached_tokens})
            report[label] = rounds
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measure", nargs="+", default=["masks", "replies", "agent"],
                        choices=["masks", "replies", "agent"])
    parser.add_argument("--replies", type=int, default=100)
    args = parser.parse_args()
    from chatd.model.loader import default_cache_dir, load_model
    loaded = load_model("smollm2-135m", device="cpu", dtype="float32", cache_dir=default_cache_dir())
    if "masks" in args.measure:  # each part printed as it ends
        print(json.dumps({"masks": masks(loaded), "decode_steps": decode_steps(loaded)}, indent=1), flush=True)
    if "replies" in args.measure:
        print(json.dumps({"replies": replies(loaded, args.replies)}, indent=1), flush=True)
    if "agent" in args.measure:
        print(json.dumps({"agent": asyncio.run(agent(loaded))}, indent=1), flush=True)


if __name__ == "__main__":
    main()
