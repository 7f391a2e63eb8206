"""Speculative decoding with no draft model: drafts from the conversation and from the owner's recent replies,
verified in the batched step. Greedy replies equal plain decoding's token for token, batched and alone, held to a
grammar or not; a seeded sampled reply is the same on every run; another owner's replies are never proposed; a
cancel in the middle of a verified draft leaves nothing of it."""

import json

from chatd.engine.drafts import (
    BOOK_TOKEN_BYTES,
    INDEX_STEP_TOKENS,
    INDEXED_TOKENS,
    NgramIndex,
    ReplyBooks,
    RowDrafts,
    Speculator,
)
from chatd.engine.grammar import GrammarSpec
from chatd.engine.step_cost import PROBE_EVERY, StepCost
from sessions import Session
from tests.support import run_together, run_turn, running_engine

QUESTIONS = ["Where is my parcel?", "My invoice is wrong.", "I need a new password.", "Cancel my order 12."]
SYSTEM = "You answer for the Northwind shop. Be brief."
POLICY = SYSTEM + " Refunds are paid within fourteen days of the day the parcel reaches our warehouse. " * 6


def ask(engine, prefix: str, owner: str | None = None, length: int = 24, **params):
    """Each question once, by a new customer of `owner`'s desk, one after another."""
    return [run_turn(engine, Session(f"{prefix}{number}", system=SYSTEM), question, owner=owner,
                     max_new_tokens=length, **params)[0] for number, question in enumerate(QUESTIONS)]


def test_the_longest_ngram_seen_before_proposes_what_followed_it():
    index = NgramIndex([5, 6, 7, 8, 9, 5, 6, 7])
    assert index.follow(index.ids, 4) == [8, 9, 5, 6], "(5, 6, 7) was followed by 8, 9, 5, 6"
    assert index.follow([1, 9, 5], 2) == [6, 7], "(9, 5), the longest n-gram that occurred"
    assert index.follow([1, 2, 3], 4) == []


def test_a_prompt_is_indexed_a_little_each_step_newest_first_and_within_its_bound():
    """A row's prompt is indexed by `index_back`, its newest positions first (the latest occurrence is the one found,
    as when indexed whole), never further back than its bound; what it generates is indexed at once."""
    ids = [7, 8, 9, 40, 50, 60, 70, 1, 2, 3, 41, 42, 43, 44]
    index = NgramIndex(ids, newest=11)
    assert index.unindexed == 11 and index.follow([1, 2, 3], 4) == [], "nothing indexed yet"
    assert index.index_back(5) == 5 and index.follow([1, 2, 3], 4) == [41, 42, 43, 44]
    assert index.index_back(100) == 6 and index.unindexed == 0
    assert index.follow([1, 2, 3], 4) == [41, 42, 43, 44], "the latest occurrence stays the one found"
    assert index.follow([9, 40], 2) == [50, 60]
    assert index.follow([7, 8], 1) == [] and NgramIndex(ids).follow([7, 8], 1) == [9], "(7, 8) is past its bound"
    index.extend([1, 2, 3, 99])
    assert index.follow([1, 2, 3], 1) == [99], "what is generated is indexed at once, and is the latest"


def test_the_rows_of_one_step_index_at_most_a_budget_of_positions_together():
    speculator = Speculator(4)
    rows = [speculator.start(list(range(row * 100_000, row * 100_000 + 20_000))) for row in range(3)]
    speculator.new_step()
    for row in rows:
        speculator.propose(row, "owner", [], room=8)
    assert rows[0].index.unindexed == INDEXED_TOKENS - INDEX_STEP_TOKENS, "no more than its bound is ever indexed"
    assert sum(INDEXED_TOKENS - row.index.unindexed for row in rows) == INDEX_STEP_TOKENS, "the first row took it all"


def test_a_system_prompt_is_indexed_once_for_every_row_that_starts_with_it():
    """Sixteen rows on one 1,000-token policy all draft from it at their first step (each indexing its own copy at
    the step's budget, all but the first found nothing); another system prompt, or the same one of another owner,
    has its own index."""
    policy = [*range(1000, 1990), 7, 8, 9, 10, 11, 12, 13, *range(2000, 2003)]
    speculator = Speculator(4)
    rows = [speculator.start([*policy, 5000 + row, 7, 8, 9], len(policy), "owner") for row in range(16)]
    speculator.new_step()
    assert [speculator.propose(row, "owner", [], room=8) for row in rows] == [[10, 11, 12, 13]] * 16
    assert all(row.shared is rows[0].shared for row in rows) and rows[0].prompt_len == 4
    assert speculator.start([*policy, 7], len(policy), "another owner").shared is not rows[0].shared
    other = speculator.start([*range(3000, 3100), 5000, 7, 8, 9], 100, "owner")
    assert other.shared is not rows[0].shared
    assert speculator.propose(other, "owner", [], room=8) == [], "(7, 8, 9) is not in its system prompt"


def test_reply_books_are_per_owner_and_bounded():
    books = ReplyBooks(book_tokens=64, budget_bytes=100 * BOOK_TOKEN_BYTES)
    books.add("alpha", [1, 2, 3], [10, 11, 12, 13])
    assert books.follow("alpha", [2, 3], 8) == [10, 11, 12, 13], "a reply found from the tokens before it"
    assert books.follow("beta", [2, 3], 8) == [], "never another owner's"
    for number in range(20):
        books.add("alpha", [1, 2, 3], [100 + number] * 4)
    assert books.tokens <= 64 and books.follow("alpha", [2, 3], 1) == [119], "the oldest replies left"
    for owner in ("beta", "gamma"):
        books.add(owner, [7, 8, 9], list(range(20, 60)))
    assert books.tokens <= 100 and books.follow("alpha", [2, 3], 1) == [], "the least recently used owner left"


def test_a_row_whose_drafts_do_not_pay_stops_drafting():
    row = RowDrafts(NgramIndex(), 0, limit=6)
    for _ in range(4):
        row.record(drafted=row.limit, accepted=0, most=6)
    assert row.stopped and row.limit == 1
    paying = RowDrafts(NgramIndex(), 0, limit=2)
    for _ in range(4):
        paying.record(drafted=paying.limit, accepted=paying.limit, most=6)
    assert not paying.stopped and paying.limit == 6, "a draft taken whole lets the next be longer"


def test_greedy_replies_with_drafts_equal_plain_decoding_together_and_alone(tiny):
    with running_engine(tiny, max_batch=4) as on, running_engine(tiny, max_batch=4, speculation="off") as off:
        lengths = [24, 18, 30, 12]
        first = [Session(f"first{number}", system=SYSTEM) for number in range(4)]
        plain = [Session(f"first{number}", system=SYSTEM) for number in range(4)]
        assert [r.token_ids for r in run_together(on, first, QUESTIONS, lengths)] == \
            [r.token_ids for r in run_together(off, plain, QUESTIONS, lengths)]
        # The next customers ask the same: the desk's replies are proposed, verified together, then alone.
        second = run_together(on, [Session(f"next{n}", system=SYSTEM) for n in range(4)], QUESTIONS, lengths)
        expected = run_together(off, [Session(f"next{n}", system=SYSTEM) for n in range(4)], QUESTIONS, lengths)
        assert [r.token_ids for r in second] == [r.token_ids for r in expected]
        assert sum(result.accepted_tokens for result in second) > 0, "drafts were accepted in the batched step"
        alone, _ = run_turn(on, Session("alone", system=SYSTEM), QUESTIONS[2], max_new_tokens=30)
        reference, _ = run_turn(off, Session("alone", system=SYSTEM), QUESTIONS[2], max_new_tokens=30)
        assert alone.token_ids == reference.token_ids and alone.accepted_tokens > 0
        counters = on.speculator.counters
        assert counters.accepted_tokens == sum(counters.accepted_per_position.values()) > 0
        assert off.speculator.counters.drafts == 0


def test_a_later_turn_continues_from_a_cache_that_holds_no_rejected_draft(tiny):
    with running_engine(tiny, max_batch=2) as on, running_engine(tiny, speculation="off") as off:
        reply = ask(on, "warm")[0]
        # The desk's latest reply after this context: right for three tokens, then wrong (rejected mid-draft).
        wrong = [*reply.token_ids[:3], *(token + 1 for token in reply.token_ids[3:])]
        prompt = reply.conversation_ids[:reply.prompt_tokens]
        on.call(lambda _: on.speculator.books.add("", prompt, wrong)).result()
        session, plain = Session("customer", system=SYSTEM), Session("customer", system=SYSTEM)
        for question in QUESTIONS[:3]:
            got, _ = run_turn(on, session, question, max_new_tokens=20)
            expected, _ = run_turn(off, plain, question, max_new_tokens=20)
            assert got.token_ids == expected.token_ids and got.conversation_ids == expected.conversation_ids
        assert on.cache.device.get("customer").token_ids == off.cache.device.get("customer").token_ids
        counters = on.speculator.counters
        assert counters.accepted_per_position[2] > 0 and counters.draft_tokens > counters.accepted_tokens, \
            "a draft was accepted in part, and the rest rejected"


def test_a_crowd_on_a_shared_policy_replies_the_same_with_drafts_on_and_off_together_and_alone(tiny):
    """Verification rows over caches that start with the shared policy (its segment read once a step, each row's own
    tokens and draft beside it): every reply equal to plain decoding's, batched and alone."""
    with running_engine(tiny, max_batch=8) as on, running_engine(tiny, max_batch=8, speculation="off") as off:
        lengths, questions = [24, 18, 30, 12] * 2, QUESTIONS * 2
        replies = {}
        for label, engine in (("on", on), ("off", off)):
            first = [Session(f"first{n}", system=POLICY) for n in range(8)]
            second = [Session(f"next{n}", system=POLICY) for n in range(8)]  # (drafted from the first's replies)
            replies[label] = [[r.token_ids for r in run_together(engine, crowd, questions, lengths)]
                              for crowd in (first, second)]
            replies[label].append(run_turn(engine, Session("alone", system=POLICY), QUESTIONS[2],
                                           max_new_tokens=30)[0].token_ids)
        assert replies["on"] == replies["off"]
        assert replies["on"][2] == replies["on"][1][2], "alone, the reply it gave in the crowd"
        assert on.cache.device.get("next3").cache.prefix is not None, "the crowd's caches start with the policy"
        assert on.speculator.counters.accepted_tokens > 0 and off.speculator.counters.drafts == 0


def test_drafts_continue_a_cache_restored_from_the_host_tier_exactly(tiny):
    """Offloaded after every turn (int8 on the host too), restored for the next, which verifies drafts on top."""
    for kv_dtype in ("same", "int8"):
        with running_engine(tiny, host_kv_dtype=kv_dtype) as on, \
                running_engine(tiny, host_kv_dtype=kv_dtype, speculation="off") as off:
            ask(on, "warm")
            session, plain = Session("restored", system=SYSTEM), Session("restored", system=SYSTEM)
            for number, question in enumerate([QUESTIONS[0], QUESTIONS[1], QUESTIONS[0]]):
                on.offload_idle()
                off.offload_idle()
                got, _ = run_turn(on, session, question, max_new_tokens=20)
                expected, _ = run_turn(off, plain, question, max_new_tokens=20)
                assert got.token_ids == expected.token_ids, (kv_dtype, number)
                if number:
                    assert got.cache_source == expected.cache_source == "host"
            assert on.speculator.counters.accepted_tokens > 0


def test_another_owners_replies_are_never_proposed(tiny):
    with running_engine(tiny) as engine:
        ask(engine, "alpha-first", owner="alpha")
        again = ask(engine, "alpha-next", owner="alpha")
        other = ask(engine, "beta", owner="beta")
        assert sum(result.accepted_tokens for result in again) > 0, "the same desk's replies are proposed"
        assert sum(result.draft_tokens for result in other) == 0, "another desk's never are"
        assert [r.token_ids for r in other] == [r.token_ids for r in again], "and the replies are the same"


def test_a_seeded_sampled_reply_is_the_same_on_every_run(tiny):
    replies, accepted = [], 0
    for speculation in ("on", "on", "off"):
        with running_engine(tiny, speculation=speculation) as engine:
            ask(engine, "warm", temperature=0.8, seed=11)
            replies.append([r.token_ids for r in ask(engine, "next", temperature=0.8, seed=11)])
            if speculation == "on":  # (how many drafts are proposed follows measured step costs: a loaded machine
                accepted += engine.speculator.counters.accepted_tokens  # proposes fewer; over both runs, some)
    assert accepted > 0, "drafts were proposed and kept"
    assert replies[0] == replies[1], "the same seed, the same reply"
    assert replies[0] == replies[2], "each kept token drawn as plain decoding draws it"


def test_a_reply_held_to_a_schema_with_drafts_equals_plain_decoding(tiny):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40}},
              "required": ["answer"], "additionalProperties": False}
    results = []
    for speculation in ("on", "off"):
        with running_engine(tiny, speculation=speculation) as engine:
            grammar = engine.grammars.compile(GrammarSpec("json_schema", json.dumps(schema))).result()
            ask(engine, "warm", length=40, grammar=grammar)
            results.append(ask(engine, "next", length=40, grammar=grammar))
    drafted, plain = results
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
    assert sum(result.accepted_tokens for result in drafted) > 0, "drafts were verified under the grammar"
    for result in drafted:
        if result.finish_reason == "stop":
            assert set(json.loads(result.content)) == {"answer"}


def test_a_cancel_in_the_middle_of_a_verified_draft_keeps_nothing_of_it(tiny):
    with running_engine(tiny) as engine:
        ask(engine, "warm", length=30)
        pieces = []

        def cancel_at_the_third_piece(turn, text):
            pieces.append(text)
            if len(pieces) == 3:
                turn.cancel()

        result, _ = run_turn(engine, Session("cancelled", system=SYSTEM), QUESTIONS[0],
                             on_text=cancel_at_the_third_piece, max_new_tokens=30)
        assert result.finish_reason == "cancelled" and 3 <= result.completion_tokens < 30
        assert result.draft_tokens > 0, "it was cancelled while verifying a draft"
        kept = engine.cache.device.get("cancelled")
        assert kept is None or len(kept.token_ids) <= result.prompt_tokens, "nothing of the reply or its draft stays"
        with running_engine(tiny, speculation="off") as plain:
            reference, _ = run_turn(plain, Session("reference", system=SYSTEM), QUESTIONS[0], max_new_tokens=30)
        assert result.token_ids == reference.token_ids[:result.completion_tokens]


def test_speculation_off_proposes_nothing():
    speculator = Speculator(0)
    assert not speculator.enabled and speculator.start([1, 2, 3]) is None
    assert speculator.propose(None, "alpha", [], 10) == []


def step_seconds(rows: int, drafted: int = 0, positions: int = 0) -> float:
    """A machine where a step costs 30 ms, 4 ms a row, 10 ms a thousand positions read, and a draft token 2 ms plus
    1 ms for every row beside it (padded in the attention over the rows' own positions)."""
    return 0.030 + 0.004 * rows + 0.010 * positions / 1000 + drafted * (0.002 + 0.001 * rows)


def measured(shapes) -> StepCost:
    cost = StepCost()
    for rows, drafted, positions in shapes:
        cost.record(step_seconds(rows, drafted, positions), rows, drafted, positions)
    return cost


def test_a_draft_pays_where_its_cost_is_small_beside_the_step_for_the_steps_shape():
    assert StepCost().break_even(16) == 0.0, "before any step is measured, drafts are tried (and so measured)"
    cost = measured([(rows, drafted, positions) for rows in (1, 4, 6, 16) for drafted in (0, 0, 3)
                     for positions in (500, 8000)])
    assert abs(cost.draft_cost(1) - 0.003) < 1e-4 and abs(cost.draft_cost(16) - 0.018) < 1e-4
    assert abs(cost.break_even(1, 500) - 0.003 / step_seconds(1, 0, 500)) < 1e-4
    assert abs(cost.break_even(16, 500) - 0.018 * 16 / step_seconds(16, 0, 500)) < 1e-4
    assert cost.break_even(16, 500) > 1 > cost.break_even(16, 40_000), "a long context makes the step long: it pays"
    assert abs(cost.break_even(8, 500) - 0.010 * 8 / step_seconds(8, 0, 500)) < 1e-4, \
        "a batch size never measured reads the fit of the others"
    speculator = Speculator(6)
    speculator.acceptance = dict.fromkeys(speculator.acceptance, 0.5)
    row = speculator.start([1, 2, 3, 4, 9, 1, 2, 3])
    assert speculator.propose(row, "", [], 10, needed=cost.break_even(1, 500)) == [4, 9, 1, 2, 3]
    assert speculator.propose(row, "", [], 10, needed=cost.break_even(16, 500)) == [], "a likely loss at 16"


def test_the_draft_cost_measured_at_small_batches_decides_at_large_ones():
    """A crowd's steps at sixteen rows seldom draft; its steps at fewer rows, where drafts pay, measure what a draft
    token costs, and sixteen rows read that (no one-token draft at sixteen rows, divided by one token, decides)."""
    shapes = [(16, 0, 2000)] * 40 + [(rows, drafted, 1000) for rows in (4, 6, 10) for drafted in (0, 4, 0, 6)] * 2
    cost = measured(shapes)
    assert abs(cost.break_even(16, 2000) - 0.018 * 16 / step_seconds(16, 0, 2000)) < 1e-4


def test_one_stall_never_turns_drafts_off_for_good():
    """One 50 ms stall in a step with drafts leaves drafting on (a step off the fit counts only as far as a few of
    its typical errors); where drafts truly stop paying, one step in PROBE_EVERY drafts anyway, and once those probes
    measure drafts cheap again, they pay again."""
    shapes = [(rows, drafted, 1000) for rows in (2, 8, 16) for drafted in (0, 4)] * 12
    cost = measured(shapes)
    before = cost.break_even(2, 1000)
    cost.record(step_seconds(16, 4, 1000) + 0.050, 16, 4, 1000)  # the stall
    assert before < 1 and abs(cost.break_even(2, 1000) - before) < 0.1 * before, "one stall hardly moves it"
    for _ in range(60):
        for rows in (2, 8, 16):
            cost.record(step_seconds(rows, 0, 1000), rows, 0, 1000)
            cost.record(step_seconds(rows, 0, 1000) + 0.040 * 4, rows, 4, 1000)  # now 40 ms a draft token
    needed = [cost.break_even(2, 1000) for _ in range(PROBE_EVERY)]
    assert min(needed[:-1]) > 1 and needed[-1] == 0.0 and cost.probes == 1, "a probe every PROBE_EVERY steps"
    for _ in range(60):  # what the probes measure: drafts are cheap again
        for rows in (2, 16):
            cost.record(step_seconds(rows, 0, 1000), rows, 0, 1000)
            cost.record(step_seconds(rows, 4, 1000), rows, 4, 1000)
    assert cost.break_even(2, 1000) < 1
