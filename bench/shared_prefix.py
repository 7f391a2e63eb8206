"""The support desk: many sessions that start with the same long system prompt (issue 31).

Three measurements, each run for this checkout and, with --a-checkout DIR, for another (the commit before,
in a `git worktree`) in the same run, one after the other, alone on the machine:

- memory: 16 idle sessions sharing a ~1,000-token policy, one short turn each, under --device-cache-mb 256:
  how many stay resident, and the device tier's bytes against the distinct keys and values (the policy once
  plus each session's own tokens); then eight sessions with eight different short prompts.
- decode: 16 sessions decoding together: the batch-16 step (ms) and the crowd's tokens/s for shared prompts
  of 25, 500, 1,000, 2,000 and 4,000 tokens (timed in the engine thread on the sessions' real caches) under
  `--shared-prompt-min-tokens 256`; and prompts of 25 and 200 tokens held as a segment
  (`--shared-prompt-min-tokens 16`) against copied, at batch 1, 4 and 16.
- redis: the same 16 sessions with `--remote-kv` on a redis-server of their own: the bytes of their caches in
  Redis against the distinct keys and values.
- capacity: sessions per GB of device budget with a 2,000-token shared prompt and 300-token conversations,
  simulated in the arena's allocator (10,000 sessions do not fit this machine).

    .venv/bin/python bench/shared_prefix.py --a-checkout /tmp/base
    .venv/bin/python bench/shared_prefix.py --a-checkout /tmp/base --measure decode --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from common import checkouts, in_checkout

HERE = Path(__file__).resolve()
POLICY_LINE = ("Refunds are issued within 14 days to the original payment method once the returned item has been "
               "inspected; shipping costs are refunded only for faulty items. ")
QUESTIONS = ["Where is my parcel?", "My invoice is wrong.", "I need a new password.", "Cancel my order 12.",
             "Do you ship to Norway?", "Is the shop open on Sunday?", "My router is blinking red.",
             "Can I change my plan?"]


def policy(tokens: int, renderer) -> str:
    """A system prompt of about `tokens` tokens (a policy with numbered sections): the closest one."""
    from sessions import Message
    length = lambda text: len(renderer.render([Message("system", text)], add_generation_prompt=False))  # noqa: E731
    text, section = "You are the support agent of Northwind Internet. Follow this policy.\n", 1
    while length(text) < tokens:
        longer = text + f"Section {section}. {POLICY_LINE}"
        if length(longer) - tokens > tokens - length(text):
            break
        text, section = longer, section + 1
    return text


def worker(measure: str) -> dict:
    """Run one measurement in this process (the checkout on PYTHONPATH) and return its numbers."""
    import torch

    from cache_store import kv_bytes_per_token
    from chatd.model.loader import load_model
    from chatd.model.prompt import PromptRenderer
    from sessions import Message, Session
    from tests.support import run_together, run_turn, running_engine

    torch.manual_seed(0)
    loaded = load_model("smollm2-135m", device="cpu", dtype="float32")
    renderer = PromptRenderer(loaded.tokenizer)
    per_token = kv_bytes_per_token(loaded.model.config, loaded.model.dtype)
    if measure == "memory":
        result = {}
        for name, prompts in (("one 1,000-token policy, 16 sessions", [policy(1000, renderer)] * 16),
                              ("eight short prompts, 8 sessions", [f"You are agent {i} of Northwind. Be brief and "
                                                                   f"kind to customer group {i}." for i in range(8)])):
            with running_engine(loaded, device_cache_mb=256, verify_sample_rate=0.0) as engine:
                conversations, prompt_tokens = [], {}
                for index, system in enumerate(prompts):
                    session = Session(f"s{index}", system=system)
                    done, _ = run_turn(engine, session, QUESTIONS[index % len(QUESTIONS)], max_new_tokens=8)
                    conversations.append(len(done.conversation_ids))
                    prompt_tokens[system] = len(renderer.render([Message("system", system)],
                                                                add_generation_prompt=False))
                stats = engine.call(lambda store: store.stats()).result()
            distinct = sum(prompt_tokens.values()) + sum(conversations) - sum(prompt_tokens[p] for p in prompts)
            result[name] = {"resident": stats["device_sessions"], "sessions": len(prompts),
                            "device_bytes": stats["device_bytes"], "distinct_kv_bytes": distinct * per_token,
                            "held_over_distinct": round(stats["device_bytes"] / (distinct * per_token), 3)}
        return result
    if measure == "decode":
        result = {}
        cases = [(tokens, 256, 16, str(tokens)) for tokens in (25, 500, 1000, 2000, 4000)]
        cases += [(200, 256, batch, f"200 copied, batch {batch}") for batch in (1, 4, 16)]
        cases += [(tokens, 16, batch, f"{tokens} as a segment, batch {batch}") for tokens in (25, 200)
                  for batch in (1, 4, 16)]
        for tokens, min_shared, batch, name in cases:
            system = policy(tokens, renderer)
            with running_engine(loaded, device_cache_mb=4096, max_batch=16, verify_sample_rate=0.0,
                                shared_prompt_min_tokens=min_shared) as engine:
                sessions = [Session(f"s{i}", system=system) for i in range(batch)]
                run_together(engine, sessions, [QUESTIONS[i % 8] + f" (customer {i})" for i in range(batch)],
                             [1] * batch)
                ids = [session.session_id for session in sessions]
                step_ms = engine.call(lambda store, ids=ids, engine=engine: _time_steps(engine, store, ids)).result()
            result[name] = {"prompt_tokens": len(renderer.render([Message("system", system)],
                                                                 add_generation_prompt=False)),
                            "batch": batch, "step_ms": round(step_ms, 1),
                            "tokens_per_s": round(batch / step_ms * 1000, 1)}
        return result
    if measure == "redis":
        return _redis_bytes(loaded, renderer, per_token)
    if measure == "host":
        return _host_bytes(loaded, renderer, per_token)
    raise ValueError(measure)


def _redis_bytes(loaded, renderer, per_token: int) -> dict:
    """16 sessions sharing a ~1,000-token policy, one short turn each, with `--remote-kv` on a redis-server of
    its own: the bytes of their caches in Redis against the distinct keys and values (the policy once plus each
    session's own tokens)."""
    import tempfile

    import redis

    from sessions import Message, Session
    from tests.redis_server import RedisServer
    from tests.support import run_turn, running_engine

    system = policy(1000, renderer)
    prompt = len(renderer.render([Message("system", system)], add_generation_prompt=False))
    with tempfile.TemporaryDirectory() as folder:
        server = RedisServer(Path(folder))
        server.start()
        try:
            with running_engine(loaded, device_cache_mb=256, verify_sample_rate=0.0, redis_url=server.url,
                                remote_kv=True) as engine:
                conversations = []
                for index in range(16):
                    session = Session(f"s{index}", system=system)
                    done, _ = run_turn(engine, session, QUESTIONS[index % len(QUESTIONS)], max_new_tokens=8)
                    conversations.append(len(done.conversation_ids))
                    engine.wait_shared(session.session_id, 30)
            client = redis.Redis.from_url(server.url)
            # sessions' own keys (and their segments' before chunks), and chains' chunks where there are chunks
            held = sum(client.strlen(key) for pattern in ("chatd:*:kv", "chatd:kvchunk:*")
                       for key in client.scan_iter(pattern))
            client.close()
        finally:
            server.stop()
    distinct = prompt + sum(conversations) - 16 * prompt
    return {"sessions": 16, "policy_tokens": prompt, "redis_kv_bytes": held, "distinct_kv_bytes": distinct * per_token,
            "held_over_distinct": round(held / (distinct * per_token), 3)}


def _host_bytes(loaded, renderer, per_token: int) -> dict:
    """16 sessions sharing a policy, one short turn each, then every cache offloaded to the host tier: the host
    bytes held (whole pool buffers) and the bytes of the copies, against the distinct keys and values. A ~1,000-
    token policy is a shared segment on the device; a ~200-token one (under `--shared-prompt-min-tokens`) is
    copied into each session there."""
    from sessions import Message, Session
    from tests.support import run_turn, running_engine

    result = {}
    for tokens in (1000, 200):
        system = policy(tokens, renderer)
        prompt = len(renderer.render([Message("system", system)], add_generation_prompt=False))
        with running_engine(loaded, device_cache_mb=256, verify_sample_rate=0.0) as engine:
            conversations = []
            for index in range(16):
                session = Session(f"s{index}", system=system)
                done, _ = run_turn(engine, session, QUESTIONS[index % len(QUESTIONS)], max_new_tokens=8)
                conversations.append(len(done.conversation_ids))

            def offload_all(store) -> tuple[int, int, int]:
                store.evict_idle()
                pieces = {id(piece): piece for key in store.host.keys()
                          for piece in getattr(store.host.get(key), "pieces", lambda key=key: [store.host.get(key)])()}
                return store.host.used_bytes(), sum(piece.nbytes for piece in pieces.values()), len(store.host)

            held, copies, entries = engine.call(offload_all).result()
        distinct = (prompt + sum(conversations) - 16 * prompt) * per_token
        result[f"{prompt}-token policy"] = {
            "sessions": 16, "host_entries": entries, "host_bytes": held, "host_copy_bytes": copies,
            "distinct_kv_bytes": distinct, "held_over_distinct": round(held / distinct, 3),
            "copies_over_distinct": round(copies / distinct, 3)}
    return result


def _time_steps(engine, store, session_ids: list[str], steps: int = 12) -> float:
    """The median decode step of the sessions together' real caches (in the engine thread); the caches are
    cropped back after."""
    import statistics

    import torch
    entries = [store.device.get(session_id) for session_id in session_ids]
    lengths = [entry.num_tokens for entry in entries]
    samples = []
    with torch.inference_mode():
        for step in range(steps + 2):
            started = time.perf_counter()
            engine.runner.decode(entries, [[200 + step]] * len(entries))
            if step >= 2:  # two warm-up steps
                samples.append(time.perf_counter() - started)
    for entry, length in zip(entries, lengths, strict=True):
        entry.crop(length)
    return 1000 * statistics.median(samples)


def capacity(gb: float = 1.0, prompt: int = 2000, own: int = 300, sessions: int = 10_000) -> dict:
    """Sessions per GB with a shared prompt, in the arena's allocator: private copies against one shared copy."""
    from cache_store.device.allocator import RunAllocator
    from cache_store.device.arena import UNIT, units_for
    per_token = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M, float32
    units = int(gb * 2**30 // per_token) // UNIT
    counts = {}
    for layout, first, each in (("private copies", 0, units_for(prompt + own)),
                                ("shared once", units_for(prompt), units_for(own))):
        allocator, placed = RunAllocator(units), 0
        if first and allocator.allocate(first) is None:
            counts[layout] = 0
            continue
        while placed < sessions and allocator.allocate(each) is not None:
            placed += 1
        counts[layout] = placed
    return {"prompt_tokens": prompt, "own_tokens": own, "gb": gb, "sessions_per_gb": counts}


def _median_of_rounds(compared: dict[str, Path], rounds: int) -> dict:
    """The decode measurement `rounds` times per checkout, alternating: each prompt's median step."""
    runs = [{label: in_checkout(HERE, checkout, "decode") for label, checkout in compared.items()}
            for _ in range(rounds)]
    report = {}
    for label in compared:
        report[label] = {}
        for prompt, first in runs[0][label].items():
            steps = [numbers[label][prompt]["step_ms"] for numbers in runs]
            step = statistics.median(steps)
            report[label][prompt] = {**first, "step_ms": step, "step_ms_runs": steps,
                                     "tokens_per_s": round(first["batch"] / step * 1000, 1)}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a-checkout", type=Path, help="also measure this checkout (the commit before)")
    parser.add_argument("--measure", nargs="+", default=["memory", "decode", "capacity"])
    parser.add_argument("--rounds", type=int, default=1, help="decode runs per checkout, alternating; medians")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return
    compared = checkouts(HERE, args.a_checkout)
    report = {}
    for measure in args.measure:
        if measure == "capacity":
            report[measure] = capacity()
            continue
        if measure == "decode" and args.rounds > 1:
            report[measure] = _median_of_rounds(compared, args.rounds)
            continue
        report[measure] = {label: in_checkout(HERE, checkout, measure) for label, checkout in compared.items()}
    print(json.dumps(report, indent=2))
    results = HERE.parent / "results"
    results.mkdir(exist_ok=True)
    (results / "shared_prefix.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
