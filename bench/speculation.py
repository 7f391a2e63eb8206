"""Speculative decoding with no draft model, through `chatd serve` with SmolLM2, greedy: decode tokens/s and the
share of draft tokens accepted, for this checkout with speculation on and off and, with --a-checkout DIR, another
(the commit before, in a `git worktree`). The servers run side by side, idle but for the one measured, and take
turns case by case (this machine's speed drifts from minute to minute); each repeat speaks as its own API key, so
that no repeat drafts from an earlier one's replies.

- policy: one customer asking questions whose answers restate the ~1,000-token policy in the system prompt;
- tenth customer: nine customers ask the desk's three common questions, the tenth asks one of them again;
- crowd, long policy: sixteen customers at once on the ~1,000-token policy (a shared segment), eight questions;
- crowd, short prompt: the same sixteen on a one-line system prompt (against which the long policy is compared);
- crowd, policy questions: sixteen customers at once on the policy, each asking one of the questions whose answers
  restate it (what a desk's crowd drafts from its policy when the replies quote it);
- crowd, all different: sixteen customers at once asking sixteen different questions (what drafting costs when
  little of it is accepted).

    .venv/bin/python bench/speculation.py --a-checkout /tmp/w/before [--tokens 48] [--repeats 3] [--cases crowd...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from common import checkouts, write_result

from chatd.cli.client import ChatClient
from chatd.cli.server_process import ServerProcess

HERE = Path(__file__).resolve()
KEYS = [f"bench-key-{number}" for number in range(64)]  # one per case and repeat: each its own reply book
SECTIONS = [
    ("Refunds", "A refund is paid to the card used for the order within fourteen days of the day the returned parcel "
     "reaches our warehouse in Leeds. Shipping costs are refunded only when the item arrived damaged or was not "
     "what was ordered. Never promise a date earlier than fourteen days."),
    ("Returns", "Items can be returned within thirty days of delivery, unused and in their original packaging. The "
     "customer prints the return label from the Orders page; the label is free for orders over forty pounds."),
    ("Delivery", "Standard delivery takes three to five working days and costs three pounds ninety-nine. Express "
     "delivery takes one working day when ordered before two in the afternoon and costs seven pounds fifty."),
    ("Damaged items", "Ask the customer for a photo of the damage and the order number. Send a replacement at once "
     "when the item is in stock; otherwise offer a full refund including shipping."),
    ("Accounts", "Never discuss an order before the customer has given the order number and the postcode of the "
     "delivery address. Passwords are reset only through the link on the sign-in page."),
    ("Warranty", "Electrical items carry a two-year warranty from the date of delivery. A fault within the first "
     "ninety days is replaced without a repair; after that, the item is repaired at our service centre."),
    ("Vouchers", "Vouchers cannot be exchanged for cash, expire twelve months after they are issued, and only one "
     "voucher can be used per order. A voucher lost by a customer cannot be replaced."),
    ("Complaints", "Apologise once, state what will happen next and when, and give the case number. Escalate to a "
     "team leader when the customer asks twice or when the order is over five hundred pounds."),
]
POLICY = "You are the customer service desk of the Northwind shop. Follow this policy exactly.\n" + "\n".join(
    f"{title}: {text}" for title, text in SECTIONS * 2)
RESTATING = ["What exactly is your refund policy? Please quote it.", "How long does standard delivery take and what "
             "does it cost?", "Can you repeat the warranty terms word for word?", "What is the rule for vouchers?"]
SHORT = "You are the customer service desk of the Northwind shop."
COMMON = ["How do I return an item?", "When will I get my refund?", "My parcel arrived damaged, what now?"]
DIFFERENT = ["My order NW-2231 has not arrived.", "Can I change the colour of my sofa order?",
             "Why was I charged twice for one jacket?", "Do you sell gift wrapping?", "The app will not let me log in.",
             "Is the blue kettle back in stock?", "Can I collect my order from a store?",
             "My discount code is rejected.",
             "How do I update my delivery address?", "Are your cotton shirts organic?", "Can I pay in instalments?",
             "The zip on my bag broke after a week.", "Do you deliver on Saturdays?", "Where is your Leeds warehouse?",
             "Can I cancel an order that has shipped?", "What size is a large in your coats?"]
CROWD = ["Hello, my order has not arrived.", "I want to return a jacket.", "Can I use two vouchers?",
         "My kettle stopped working.", "How do I reset my password?", "Is express delivery available?",
         "My parcel is damaged.", "When does my voucher expire?"]


async def policy_case(url: str, key: str, tokens: int) -> list[dict]:
    """One customer, questions whose answers restate the policy."""
    async with await ChatClient.connect(url, api_key=key) as client:
        session_id = (await client.open_session(system=POLICY)).session_id
        await (await client.chat(session_id, "Hello.", max_new_tokens=4)).result()
        return [_figures(await (await client.chat(session_id, question, max_new_tokens=tokens, temperature=0))
                         .result()) for question in RESTATING]


async def tenth_customer_case(url: str, key: str, tokens: int) -> dict:
    """Nine customers ask the common questions; the tenth asks the first of them again (measured)."""
    async with await ChatClient.connect(url, api_key=key) as client:
        dones = []
        for number in range(10):
            session_id = (await client.open_session(system=POLICY)).session_id
            turn = await client.chat(session_id, COMMON[number % len(COMMON)] if number < 9 else COMMON[0],
                                     max_new_tokens=tokens, temperature=0)
            dones.append(await turn.result())
        return _figures(dones[-1])


async def crowd_case(url: str, key: str, system: str, questions: list[str], tokens: int, customers: int = 16
                     ) -> dict:
    """`customers` conversations at once: their tokens over the time from the first streamed piece to the last."""
    async with await ChatClient.connect(url, api_key=key) as client:
        sessions = [(await client.open_session(system=system)).session_id for _ in range(customers)]
        await asyncio.gather(*(_first_turn(client, session_id) for session_id in sessions))  # prefilled, cached
        started = time.perf_counter()
        turns = [await client.chat(session_id, questions[number % len(questions)], max_new_tokens=tokens,
                                   temperature=0)
                 for number, session_id in enumerate(sessions)]
        dones = await asyncio.gather(*(turn.result() for turn in turns))
        finished = time.perf_counter()
        first = started + min(done.timings.ttft_ms for done in dones) / 1000
        return {"tokens_per_s": round(sum(done.usage.completion_tokens for done in dones) / (finished - first), 1),
                **_acceptance(dones)}


async def _first_turn(client: ChatClient, session_id: str) -> None:
    await (await client.chat(session_id, "Hello.", max_new_tokens=4)).result()


def _figures(done) -> dict:
    return {"tokens_per_s": round(done.timings.tokens_per_s, 1), **_acceptance([done])}


def _acceptance(dones) -> dict:
    drafted = sum(done.speculation.draft_tokens for done in dones)
    accepted = sum(done.speculation.accepted_tokens for done in dones)
    return {"draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance": round(accepted / drafted, 2) if drafted else None}


CASES = ("policy", "tenth customer", "crowd, long policy", "crowd, short prompt", "crowd, all different",
         "crowd, policy questions")


async def run_case(case: str, url: str, key: str, tokens: int) -> dict:
    if case == "policy":
        turns = await policy_case(url, key, tokens)
        return {"tokens_per_s": statistics.median(turn["tokens_per_s"] for turn in turns), **_summed(turns)}
    if case == "tenth customer":
        return await tenth_customer_case(url, key, tokens)
    questions = {"crowd, all different": DIFFERENT, "crowd, policy questions": RESTATING}.get(case, CROWD)
    system = POLICY if case in ("crowd, long policy", "crowd, policy questions") else SHORT
    return await crowd_case(url, key, system, questions, tokens)


def measure(servers: dict[str, ServerProcess], tokens: int, repeats: int, cases: list[str]) -> dict:
    """Every case `repeats` times on every server, the servers taking turns; the median run of each."""
    runs: dict[str, dict[str, list[dict]]] = {label: {case: [] for case in cases} for label in servers}
    for case in cases:
        for repeat in range(repeats):
            for label, server in servers.items():
                key = KEYS[CASES.index(case) * repeats + repeat]
                runs[label][case].append(asyncio.run(run_case(case, server.url, key, tokens)))
    report = {label: {case: _median_run(case_runs) for case, case_runs in by_case.items()}
              for label, by_case in runs.items()}
    for figures in report.values():
        if "crowd, long policy" in figures and "crowd, short prompt" in figures:
            figures["long / short"] = round(figures["crowd, long policy"]["tokens_per_s"]
                                            / figures["crowd, short prompt"]["tokens_per_s"], 2)
    for label in [label for label in report if label.endswith("speculation on")]:
        off = label.replace("speculation on", "speculation off")
        if off in report:
            report[label]["on / off"] = {case: round(report[label][case]["tokens_per_s"]
                                                     / report[off][case]["tokens_per_s"], 2) for case in cases}
    return report


def _median_run(runs: list[dict]) -> dict:
    """The run of median tokens/s, with every run's tokens/s."""
    ordered = sorted(runs, key=lambda run: run["tokens_per_s"])
    return {**ordered[len(ordered) // 2], "every_run": [run["tokens_per_s"] for run in runs]}


def _summed(figures: list[dict]) -> dict:
    drafted, accepted = sum(f["draft_tokens"] for f in figures), sum(f["accepted_tokens"] for f in figures)
    return {"draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance": round(accepted / drafted, 2) if drafted else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a-checkout", type=Path, help="also measure this checkout (the commit before)")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each case (the median run is reported)")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES, metavar="CASE",
                        help=f"the cases to run (default: all): {', '.join(CASES)}")
    args = parser.parse_args()
    # (the idle servers must not take the measured one's load for a neighbour's: threads fixed)
    flags = ["--verify-sample-rate", "0", "--no-adaptive-threads", *(f"--api-key={key}" for key in KEYS)]
    here = checkouts(HERE, args.a_checkout)
    servers = {"after, speculation on": ServerProcess(flags, checkout=here["after"]),
               "after, speculation off": ServerProcess([*flags, "--speculation", "off"], checkout=here["after"])}
    if "before" in here:
        servers["before, speculation on"] = ServerProcess(flags, checkout=here["before"])
        servers["before, speculation off"] = ServerProcess([*flags, "--speculation", "off"], checkout=here["before"])
    try:
        report = measure(servers, args.tokens, args.repeats, args.cases)
    finally:
        for server in servers.values():
            server.stop()
    print(json.dumps(report, indent=2))
    write_result(HERE.parent / "results" / "speculation.json", report)


if __name__ == "__main__":
    main()
