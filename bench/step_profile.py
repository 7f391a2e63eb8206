"""Where a crowd's decode step goes: sixteen customers at once on the ~1,000-token policy (a shared segment) and on a
one-line system prompt, drafts on and off, the engine in-process (no sockets), SmolLM2 in float32, greedy.

Drafts "every one": each draft found is verified, whether or not the step's cost model expects it to pay (what a
verification row costs, per draft token: the steps with drafts against those without).

Each customer's first turn is prefilled and cached; then all sixteen ask their question at once (the speculation
bench's crowd; each reply runs to --tokens, its end-of-sequence token ignored, so that the sixteen decode together
to the end) and every step in which the sixteen decode together (no prompt riding, no prefill chunk) is timed by
part:
- linear layers: every `nn.Linear` of the model (projections, MLP, the output head), timed by module hooks;
- attention, shared segment: the policy read once for every row that starts with it (`ChainPlan._segment_parts`);
- attention, own tokens: each row's own positions (`ChainPlan._gathered`/`_own_parts`, or plain rows' sdpa);
- merge: the log-sum-exp merge of the parts;
- KV write: each layer's new keys and values stored in the arena;
- step plans: the rows' attention plans and masks, built once a step (`ArenaRows`, `ChainPlan`);
- model, rest: the model's forward less the above (embedding, norms, rotary, activations, Python in the layer loop);
- drafts: proposing the rows' drafts (`Speculator.propose`, the rows' n-gram indexes);
- sampling, verification, streaming: the updater (`StepUpdater.stepped`);
- planning and Python between: the step less everything above.
Beside them, the raw forward pass of transformers at batch 16 on an empty cache (the floor `bench/decode_floor.py`
reports) and on a `DynamicCache` of the same length as the rows' (no arena, no chain: every row as long).

    .venv/bin/python bench/step_profile.py [--tokens 48] [--rounds 2] [--history-tokens 470]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from common import median_ms, synthetic_history, write_result
from decode_floor import run_turns
from speculation import CROWD, POLICY, SHORT
from torch import nn
from transformers import DynamicCache

import chatd.engine.attention as attention_module
import chatd.engine.chain_attention as chain_module
from chatd.config import Settings
from chatd.engine import batch as batch_module
from chatd.engine.drafts import Speculator
from chatd.engine.engine import Engine
from chatd.engine.step_cost import StepCost
from chatd.engine.updater import StepUpdater
from chatd.model.loader import load_model
from chatd.model.prompt import PromptRenderer
from sessions import Message, Session

HERE = Path(__file__).parent
CUSTOMERS = 16
PARTS = ["linear layers", "attention, shared segment", "attention, own tokens", "merge", "KV write", "step plans",
         "model, rest", "drafts", "sampling, verification, streaming", "planning and Python between"]


class StepClock:
    """Seconds per part of the steps being measured; a step counts when all `CUSTOMERS` rows decode in it."""

    def __init__(self):
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self.decoding = self.prefills = 0
        self.tokens = 0
        self.batches: Counter[tuple[int, bool]] = Counter()

    def timed(self, part: str, function: Callable) -> Callable:
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.current[part] += time.perf_counter() - started
        return wrapper

    def step(self, function: Callable) -> Callable:
        def wrapper(parts):
            self.current, self.decoding, self.prefills, self.tokens = defaultdict(float), 0, 0, 0
            started = time.perf_counter()
            function(parts)
            self.current["step"] = time.perf_counter() - started
            self.batches[self.decoding, bool(self.prefills)] += 1
            if self.decoding == CUSTOMERS and not self.prefills:
                self.steps.append({**self.current, "tokens": self.tokens})
        return wrapper

    def hook_linears(self, model: nn.Module) -> list:
        """Time every linear layer (a pre-hook starts the clock, a hook stops it); the hooks' handles."""
        started: list[float] = []

        def before(module, args):
            started.append(time.perf_counter())

        def after(module, args, output):
            self.current["linear layers"] += time.perf_counter() - started.pop()

        return [hook for module in model.modules() if isinstance(module, nn.Linear)
                for hook in (module.register_forward_pre_hook(before), module.register_forward_hook(after))]

    def summary(self) -> dict[str, float]:
        """Milliseconds per step of each part (the median step's parts would not add up: means)."""
        count = len(self.steps)
        total = {key: sum(step.get(key, 0.0) for step in self.steps) / count for key in
                 {key for step in self.steps for key in step}}
        inside = sum(total.get(part, 0.0) for part in PARTS[:6])
        total["model, rest"] = total["forward"] - inside
        total["planning and Python between"] = total["step"] - total["forward"] - total.get("drafts", 0.0) - total.get(
            "sampling, verification, streaming", 0.0)
        figures = {part: round(1000 * total.get(part, 0.0), 2) for part in PARTS}
        figures["step"] = round(1000 * total["step"], 2)
        figures["tokens per step"] = round(total["tokens"], 2)
        figures["tokens/s"] = round(total["tokens"] / total["step"], 1)
        figures["steps"] = count
        figures["median step ms"] = round(1000 * statistics.median(step["step"] for step in self.steps), 2)
        figures["per draft token"] = self._per_draft_token()
        return figures

    def _per_draft_token(self) -> dict[str, float] | None:
        """What a draft token added to each part: the steps with drafts against those without, per draft token
        (None unless both kinds of step were measured)."""
        plain = [step for step in self.steps if step["tokens"] == CUSTOMERS]
        drafted = [step for step in self.steps if step["tokens"] > CUSTOMERS]
        if not plain or not drafted:
            return None
        tokens = statistics.mean(step["tokens"] for step in drafted) - CUSTOMERS
        parts = [*PARTS[:6], "forward", "step"]
        return {part: round(1000 * (statistics.mean(step.get(part, 0.0) for step in drafted)
                                    - statistics.mean(step.get(part, 0.0) for step in plain)) / tokens, 2)
                for part in parts} | {"draft tokens per step with drafts": round(tokens, 2)}


def instrument_classes(clock: StepClock, model: nn.Module) -> list:
    """Wrap the parts of every engine's step in `clock`'s timers (in this process only; once); the linear layers'
    hooks."""
    hooks = clock.hook_linears(model)
    chain = chain_module.ChainPlan
    chain._segment_parts = clock.timed("attention, shared segment", chain._segment_parts)
    chain._gathered = clock.timed("attention, own tokens", chain._gathered)
    chain._own_parts = clock.timed("attention, own tokens", chain._own_parts)
    chain.__init__ = clock.timed("step plans", chain.__init__)
    attention_module.ArenaRows.__init__ = clock.timed("step plans", attention_module.ArenaRows.__init__)
    attention_module.sdpa_attention_forward = clock.timed("attention, own tokens",
                                                          attention_module.sdpa_attention_forward)
    chain_module.merge_partials = clock.timed("merge", chain_module.merge_partials)
    batch_module._StepLayer.update = clock.timed("KV write", batch_module._StepLayer.update)
    Speculator.propose = clock.timed("drafts", Speculator.propose)
    StepUpdater.stepped = clock.timed("sampling, verification, streaming", StepUpdater.stepped)
    Engine._step = staticmethod(clock.step(Engine._step))
    return hooks


def instrument_engine(clock: StepClock, engine: Engine) -> None:
    """Time `engine`'s forward passes and count what each step feeds."""
    runner = engine.runner
    runner.decode = clock.timed("forward", runner.decode)
    planner = engine.parts.planner
    decode_plan = planner.decode_plan

    def counted_plan(riders):
        plan = decode_plan(riders)
        if plan is not None:
            clock.decoding = plan.decoding if len(plan.rows) == plan.decoding else 0
            clock.tokens = plan.tokens
        return plan
    planner.decode_plan = counted_plan
    prefill = engine.parts.executor.prefill

    def counted_prefill(chunk):
        clock.prefills += 1
        return prefill(chunk)
    engine.parts.executor.prefill = counted_prefill


def crowd(engine: Engine, clock: StepClock, system: str, label: str, tokens: int, history: list[Message]
          ) -> tuple[dict, list[list[int]]]:
    """Sixteen customers on `system` (each after `history`): a first turn, then their questions at once (measured)."""
    sessions = [Session(f"{label}-{number}", system=system, messages=list(history)) for number in range(CUSTOMERS)]
    run_turns(engine, sessions, "Hello.", 4, owner=label, ignore_eos=True)
    clock.steps, clock.batches = [], Counter()
    results = run_turns(engine, sessions, [CROWD[number % len(CROWD)] for number in range(CUSTOMERS)], tokens,
                        owner=label, ignore_eos=True)
    print("steps by (batch, with a prefill):", sorted(clock.batches.items()))
    figures = clock.summary()
    figures["cached tokens"] = results[0].cached_tokens
    figures["draft tokens"] = sum(result.draft_tokens for result in results)
    figures["accepted tokens"] = sum(result.accepted_tokens for result in results)
    return figures, [result.token_ids for result in results]


def raw_forward(loaded, clock: StepClock, hooks: list, batch: int, history: int) -> dict[str, float]:
    """transformers' own forward of one token for `batch` rows after `history` cached positions each: its
    milliseconds without hooks, and the share of them its linear layers took (timed with the hooks)."""
    clock.current = defaultdict(float)
    started = time.perf_counter()
    _raw_forward_ms(loaded, batch, history)
    share = clock.current["linear layers"] / (time.perf_counter() - started)
    for hook in hooks:
        hook.remove()
    plain = _raw_forward_ms(loaded, batch, history)
    return {"ms": round(plain, 2), "linear layers ms": round(share * plain, 2) if hooks else None}


def _raw_forward_ms(loaded, batch: int, history: int) -> float:
    model = loaded.model
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        if history:
            model(input_ids=torch.randint(100, 1000, (batch, history)), cache=cache, use_cache=True, logits_to_keep=1)
        ids = torch.randint(100, 1000, (batch, 1))

        def one() -> None:
            model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
            cache.crop(-1)
        return median_ms(one, 10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2, help="crowds of each case (fresh sessions and owner each)")
    parser.add_argument("--drafts", nargs="+", default=["off", "on", "every one"], choices=["off", "on", "every one"])
    parser.add_argument("--history-tokens", type=int, default=0,
                        help="each customer's earlier turns, in tokens (the support scenario's, canned replies)")
    parser.add_argument("--output", type=Path, default=HERE / "results" / "step_profile.json")
    args = parser.parse_args()
    loaded = load_model("smollm2-135m", device="cpu", dtype="float32")
    scenario = json.loads((HERE / "scenarios" / "internet_support.json").read_text())
    history = synthetic_history(scenario, PromptRenderer(loaded.tokenizer), args.history_tokens) \
        if args.history_tokens else []
    report: dict[str, dict] = {}
    replies: dict[str, list[list[int]]] = {}
    clock = StepClock()
    hooks = instrument_classes(clock, loaded.model)
    break_even = StepCost.break_even
    for drafts in args.drafts:
        # (every one: each draft found is verified, whatever it is likely to pay: what verification rows cost)
        StepCost.break_even = break_even if drafts != "every one" else lambda cost, rows, positions=0: 0.0
        engine = Engine(lambda: loaded, Settings(device="cpu", max_batch=CUSTOMERS, verify_sample_rate=0,
                                                 speculation="off" if drafts == "off" else "on"))
        engine.start()
        engine.ready.wait()
        instrument_engine(clock, engine)
        for number in range(args.rounds):
            for case, system in (("policy", POLICY), ("short prompt", SHORT)):
                figures, ids = crowd(engine, clock, system, f"{case}-{drafts}-{number}", args.tokens, history)
                key = f"{case}, drafts {drafts}"
                report.setdefault(key, {"rounds": []})["rounds"].append(figures)
                assert replies.setdefault(case, ids) == ids, f"{key}: a reply differs from the first round's"
                print(key, figures, flush=True)
        engine.stop()
    for figures in report.values():
        figures["mean"] = {part: round(statistics.mean(r[part] for r in figures["rounds"]), 2)
                           for part in [*PARTS, "step", "tokens per step", "tokens/s", "cached tokens"]}
    history = report[f"policy, drafts {args.drafts[0]}"]["rounds"][0]["cached tokens"]
    report["raw forward, batch 16"] = {"empty cache": raw_forward(loaded, clock, hooks, CUSTOMERS, 0)}
    report["raw forward, batch 16"][f"{history}-token cache"] = raw_forward(loaded, clock, [], CUSTOMERS, history)
    print(_table(report))
    write_result(args.output, report)


def _table(report: dict) -> str:
    cases = [key for key in report if key.startswith(("policy", "short"))]
    lines = ["| part, ms per step | " + " | ".join(cases) + " |", "|---|" + "---:|" * len(cases)]
    for part in [*PARTS, "step", "tokens per step", "tokens/s"]:
        lines.append(f"| {part} | " + " | ".join(f"{report[case]['mean'][part]}" for case in cases) + " |")
    raw = report["raw forward, batch 16"]
    figures = [f"{key} {value['ms']} ms" + (f" (linear layers {value['linear layers ms']})"
                                            if value["linear layers ms"] else "") for key, value in raw.items()]
    lines.append("raw forward at batch 16: " + ", ".join(figures))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
