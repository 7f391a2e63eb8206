"""`chatd bench`: simulated customers chatting over websockets, measured the way they feel it.

Each customer opens a session and plays a scripted multi-turn conversation (scenarios under
bench/scenarios/), pausing between turns as a person would. TTFT is measured at the client, from
sending the request to the first delta. With --compare, two server configurations (--a, --b) run the
same workload in turn and every figure is shown side by side with its ratio.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from chatd.cli.client import ChatClient, ChatError
from chatd.cli.server_process import ServerProcess
from chatd.observability.stats import percentile

STATS_SETTLE_S = 1.5  # longer than /v1/stats keeps a snapshot
DEFAULT_SCENARIOS = Path(__file__).resolve().parents[2] / "bench" / "scenarios"


@dataclass
class TurnSample:
    """What a simulated customer measured of one turn."""

    customer: int
    turn: int  # 1-based
    ttft_ms: float | None = None
    inter_token_ms: list[float] = field(default_factory=list)
    e2e_ms: float = 0.0
    completion_tokens: int = 0
    prompt_tokens: int | None = None  # as the server reported them, with the part a cache covered
    cached_tokens: int | None = None
    cache_source: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class Workload:
    """The customers a benchmark plays: scenarios, how many, turns, think time."""

    scenarios: list[dict]
    customers: int
    turns: int
    think_s: float
    max_new_tokens: int
    seed: int
    api_key: str | None = field(default=None, repr=False)  # never written to the results


def load_scenarios(folder: Path) -> list[dict]:
    """The scripted conversations under a folder."""
    scenarios = [json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))]
    if not scenarios:
        raise SystemExit(f"chatd bench: no scenarios (*.json) in {folder}")
    return scenarios


async def play_customer(url: str, workload: Workload, index: int, samples: list[TurnSample], progress: tqdm) -> None:
    """One simulated customer's conversation over the websocket protocol."""
    scenario = workload.scenarios[index % len(workload.scenarios)]
    pauses = random.Random(workload.seed * 1000 + index)
    async with await ChatClient.connect(url, api_key=workload.api_key) as client:
        session_id = (await client.open_session(system=scenario["system"])).session_id
        for turn in range(1, workload.turns + 1):
            sample = TurnSample(customer=index, turn=turn)
            content = scenario["turns"][(turn - 1) % len(scenario["turns"])]
            sent = time.perf_counter()
            stream = await client.chat(session_id, content, max_new_tokens=workload.max_new_tokens)
            arrivals = []
            async for _ in stream:
                arrivals.append(time.perf_counter())
            try:
                done = await stream.result()
                sample.cache_source, sample.completion_tokens = done.cache.source, done.usage.completion_tokens
                sample.prompt_tokens, sample.cached_tokens = done.usage.prompt_tokens, done.usage.cached_tokens
            except ChatError as error:
                sample.error = error.code
            if arrivals:
                sample.ttft_ms = 1000 * (arrivals[0] - sent)
                sample.inter_token_ms = [1000 * (b - a) for a, b in zip(arrivals, arrivals[1:], strict=False)]
            sample.e2e_ms = 1000 * (time.perf_counter() - sent)
            samples.append(sample)
            progress.update(1)
            if turn < workload.turns and workload.think_s > 0:
                await asyncio.sleep(workload.think_s * pauses.uniform(0.5, 1.5))


def _openai_headers(api_key: str | None) -> dict[str, str]:
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}


def served_model(url: str, api_key: str | None) -> str:
    """The first model an OpenAI-compatible server lists (`GET /v1/models`)."""
    request = urllib.request.Request(f"{url}/models", headers=_openai_headers(api_key))
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)["data"][0]["id"]


def openai_url(websocket_url: str) -> str:
    """chatd's OpenAI-compatible API beside its websocket endpoint: ws://host:port/ws -> http://host:port/v1."""
    return re.sub(r"^ws(s?)://", r"http\1://", websocket_url).removesuffix("/ws") + "/v1"


def device_tier(url: str) -> dict | None:
    """What a chatd server's device tier holds now (`/v1/stats`): resident sessions, the bytes their regions
    hold and the bytes of their keys and values; None for a server without chatd's stats."""
    stats_url = re.sub(r"^ws(s?)://", r"http\1://", url).removesuffix("/ws").removesuffix("/v1") + "/v1/stats"
    try:
        with urllib.request.urlopen(stats_url, timeout=10) as response:
            device = json.load(response)["now"]["tiers"]["device"]
    except (OSError, ValueError, KeyError):
        return None
    held, kv = device.get("bytes", 0), device.get("kv_bytes", 0)
    return {"sessions": device.get("sessions"), "held_bytes": held, "kv_bytes": kv,
            "held_per_kv": round(held / kv, 3) if kv else None}


def _openai_turn(url: str, model: str, messages: list[dict], max_new_tokens: int,
                 api_key: str | None) -> tuple[float, list[float], str, dict]:
    """One streamed chat completion from an OpenAI-compatible server (chatd's own, or a peer such as
    llama.cpp's): when it was sent, when each content chunk arrived, the reply, and the usage the server
    reported (empty if it reported none)."""
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_new_tokens, "temperature": 0.0,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    request = urllib.request.Request(f"{url}/chat/completions", data=body, headers=_openai_headers(api_key))
    sent, arrivals, reply, usage = time.perf_counter(), [], [], {}
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            delta = chunk["choices"][0].get("delta", {}).get("content") if chunk.get("choices") else None
            if delta:
                arrivals.append(time.perf_counter())
                reply.append(delta)
    return sent, arrivals, "".join(reply), usage


def _failure(error: OSError) -> str:
    """What a failed request is counted as: its HTTP status and OpenAI error code, or the kind of error."""
    if isinstance(error, urllib.error.HTTPError):
        try:
            code = json.loads(error.read() or b"{}").get("error", {}).get("code")
        except (ValueError, AttributeError):
            code = None
        return f"HTTP {error.code}" + (f" {code}" if code else "")
    return type(error).__name__


async def play_openai_customer(url: str, workload: Workload, index: int, samples: list[TurnSample],
                               progress: tqdm) -> None:
    """The same customer as a stateless OpenAI client: it resends the whole history every turn."""
    scenario = workload.scenarios[index % len(workload.scenarios)]
    model = await asyncio.to_thread(served_model, url, workload.api_key)
    pauses = random.Random(workload.seed * 1000 + index)
    messages = [{"role": "system", "content": scenario["system"]}]
    for turn in range(1, workload.turns + 1):
        sample = TurnSample(customer=index, turn=turn)
        messages.append({"role": "user", "content": scenario["turns"][(turn - 1) % len(scenario["turns"])]})
        try:
            sent, arrivals, reply, usage = await asyncio.to_thread(_openai_turn, url, model, messages,
                                                                   workload.max_new_tokens, workload.api_key)
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            sample.cache_source = "unreported" if cached is None else "cached" if cached else "miss"
            sample.prompt_tokens, sample.cached_tokens = usage.get("prompt_tokens"), cached
        except OSError as error:
            sample.error, arrivals, sent, reply = _failure(error), [], time.perf_counter(), ""
        messages.append({"role": "assistant", "content": reply})
        if arrivals:
            sample.ttft_ms = 1000 * (arrivals[0] - sent)
            sample.inter_token_ms = [1000 * (b - a) for a, b in zip(arrivals, arrivals[1:], strict=False)]
        sample.completion_tokens = len(arrivals)  # one streamed chunk per token
        sample.e2e_ms = 1000 * (time.perf_counter() - sent)
        samples.append(sample)
        progress.update(1)
        if turn < workload.turns and workload.think_s > 0:
            await asyncio.sleep(workload.think_s * pauses.uniform(0.5, 1.5))


async def run_workload(url: str, workload: Workload, label: str) -> tuple[list[TurnSample], float]:
    """Every customer's whole conversation, all at once; the samples and the wall time."""
    samples: list[TurnSample] = []
    play = play_openai_customer if url.startswith("http") else play_customer
    with tqdm(total=workload.customers * workload.turns, desc=label, unit="turn", file=sys.stderr) as progress:
        started = time.perf_counter()
        await asyncio.gather(*(play(url, workload, index, samples, progress) for index in range(workload.customers)))
        return samples, time.perf_counter() - started


def summarize(samples: list[TurnSample], wall_s: float) -> dict:
    """Percentiles, throughput, cache sources and errors of a run."""
    ok = [s for s in samples if s.error is None]
    by_turn = {}
    for turn in sorted({s.turn for s in ok}):
        ttfts = [s.ttft_ms for s in ok if s.turn == turn and s.ttft_ms is not None]
        by_turn[turn] = {"p50": percentile(ttfts, 50), "p95": percentile(ttfts, 95), "n": len(ttfts)}
    late = [s.ttft_ms for s in ok if s.turn >= 3 and s.ttft_ms is not None]
    gaps = [gap for s in ok for gap in s.inter_token_ms]
    e2e = [s.e2e_ms for s in ok]
    sources, errors = {}, {}
    for s in samples:
        if s.error:
            errors[s.error] = errors.get(s.error, 0) + 1
        else:
            sources[s.cache_source] = sources.get(s.cache_source, 0) + 1
    reported = [s for s in ok if s.turn >= 3 and s.prompt_tokens and s.cached_tokens is not None]
    return {
        "ttft_ms_by_turn": by_turn,
        # of the prompt tokens of turns 3+, the percentage a cache covered (None when the server reports no usage)
        "cached_percent_turn3_plus": (100 * sum(s.cached_tokens for s in reported)
                                      / sum(s.prompt_tokens for s in reported) if reported else None),
        "ttft_ms_turn3_plus": {"p50": percentile(late, 50), "p95": percentile(late, 95)},
        "inter_token_ms": {"p50": percentile(gaps, 50), "p95": percentile(gaps, 95)},
        "e2e_ms": {"p50": percentile(e2e, 50), "p95": percentile(e2e, 95)},
        "tokens_per_s": sum(s.completion_tokens for s in ok) / wall_s if wall_s > 0 else 0.0,
        "cache_sources": sources,
        "errors": errors,
    }


def _device_line(device: dict | None) -> str:
    if not device:
        return "device tier not reported"
    ratio = f" ({device['held_per_kv']:.2f}x)" if device["held_per_kv"] else ""
    return (f"device tier at the end: {device['sessions']} sessions resident, {device['held_bytes'] / 2**20:.0f} MB "
            f"held for {device['kv_bytes'] / 2**20:.0f} MB of keys and values{ratio}")


FIGURES = [("TTFT p50, turns 3+ (ms)", ("ttft_ms_turn3_plus", "p50")),
           ("TTFT p95, turns 3+ (ms)", ("ttft_ms_turn3_plus", "p95")),
           ("inter-token p50 (ms)", ("inter_token_ms", "p50")), ("inter-token p95 (ms)", ("inter_token_ms", "p95")),
           ("end-to-end p50 (ms)", ("e2e_ms", "p50")), ("end-to-end p95 (ms)", ("e2e_ms", "p95")),
           ("tokens/s (aggregate)", ("tokens_per_s",)),
           ("cached % of prompts, t3+", ("cached_percent_turn3_plus",))]


def _figure(result: dict, path: tuple[str, ...]) -> float | None:
    value = result
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def report(results: list[dict]) -> str:
    """The side-by-side table of one or two configurations."""
    header = f"{'':<26}" + "".join(f"{r['label']:>12}" for r in results)
    header += "   A/B" if len(results) == 2 else ""
    lines = [header]
    for name, path in FIGURES:
        values = [_figure(r, path) for r in results]
        row = f"{name:<26}" + "".join(f"{v:>12.1f}" if v is not None else f"{'-':>12}" for v in values)
        if len(values) == 2 and all(values) and values[1]:
            row += f"  {values[0] / values[1]:>5.2f}x"
        lines.append(row)
    for r in results:
        lines.append(f"{r['label']}: TTFT p50/p95 by turn " + ", ".join(
            f"{turn}: {stats['p50']:.0f}/{stats['p95']:.0f}" for turn, stats in r["ttft_ms_by_turn"].items()
            if stats["p50"] is not None) + f" ms; cache sources {r['cache_sources']}; errors {r['errors'] or 'none'}")
        lines.append(f"{r['label']}: " + _device_line(r.get("device_tier")))
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    """TTFT by turn and the inter-token distribution, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, axes = plt.subplots(figsize=(8, 4.5))
    for result in results:
        turns = [int(t) for t in result["ttft_ms_by_turn"]]
        p50 = [stats["p50"] for stats in result["ttft_ms_by_turn"].values()]
        p95 = [stats["p95"] for stats in result["ttft_ms_by_turn"].values()]
        line, = axes.plot(turns, p50, marker="o", label=f"{result['label']} p50")
        axes.plot(turns, p95, linestyle="--", color=line.get_color(), label=f"{result['label']} p95")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("turn of the conversation")
    axes.set_ylabel("time to first token (ms)")
    axes.set_title("TTFT by turn index")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _start_servers(flag_sets: list[str], checkouts: list[Path | None]) -> list[ServerProcess]:
    """The servers to bench, started at once (most of a start is loading torch and the model); if one cannot
    start, the others are stopped and the bench exits saying why."""
    with ThreadPoolExecutor(2) as pool:
        starting = [pool.submit(ServerProcess, flags, checkout)
                    for flags, checkout in zip(flag_sets, checkouts, strict=False)]
    servers, errors = [], []
    for future in starting:
        try:
            servers.append(future.result())
        except RuntimeError as error:
            errors.append(error)
    if errors:
        for server in servers:
            server.stop()
        raise SystemExit(f"chatd bench: {errors[0]}")
    return servers


def main(args) -> None:
    """`chatd bench` with its parsed flags: start the servers it names (or use --url), play the same workload on
    each, alternating rounds, then print the report and write the JSON and the plot."""
    workload = Workload(load_scenarios(args.scenarios), args.customers, args.turns, args.think_s,
                        args.max_new_tokens, args.seed, args.api_key)
    flag_sets = [args.a, args.b] if args.compare else ([args.serve] if args.serve is not None else [])
    checkouts = [args.a_checkout, args.b_checkout] if args.compare else [None]
    servers = _start_servers(flag_sets, checkouts)
    served = openai_url if args.api == "openai" else str
    targets = [(args.url, "server")] if args.url else [(served(server.url), label) for server, label
                                                      in zip(servers, "AB" if len(servers) == 2 else ["server"],
                                                             strict=True)]
    described = {label: (args.url or flags or "(defaults)") + (f" (code of {checkout})" if checkout else "")
                 for (_, label), flags, checkout in zip(targets, flag_sets or [args.url], checkouts, strict=False)}
    runs = {label: ([], 0.0) for _, label in targets}
    device_tiers: dict[str, dict | None] = {}
    try:
        for _ in range(args.rounds):  # alternate, so that drift of the machine affects both alike
            for url, label in targets:
                samples, wall_s = asyncio.run(run_workload(url, workload, label))
                runs[label] = (runs[label][0] + samples, runs[label][1] + wall_s)
        time.sleep(STATS_SETTLE_S)  # past the stats' snapshot age: the last write-backs counted
        for url, label in targets:  # what each device tier holds after the whole run
            device_tiers[label] = device_tier(url)
    finally:
        for server in servers:
            server.stop()
    results = [{"label": label, "config": described[label], "wall_s": wall_s, **summarize(samples, wall_s),
                "device_tier": device_tiers.get(label), "samples": [asdict(s) for s in samples]}
               for label, (samples, wall_s) in runs.items()]
    for result in results:
        print(f"{result['label']}: {result['config']}")
    print(report(results))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"workload": {k: v for k, v in asdict(workload).items()
                                                    if k not in ("scenarios", "api_key")},
                                       "scenarios": [s["name"] for s in workload.scenarios], "results": results},
                                      indent=2))
    plot(results, args.output.with_suffix(".png"))
    print(f"wrote {args.output} and {args.output.with_suffix('.png')}", file=sys.stderr)
