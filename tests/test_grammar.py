"""Constrained decoding in the engine (llguidance): a reply held to a JSON schema is valid JSON for it,
alone and in a batch; the unconstrained rows of the same batch answer exactly as they do alone; a lazy
grammar holds a reply only from its trigger on; a schema that cannot compile is refused before any work."""

import json
import threading

import jsonschema
import pytest

from chatd.engine.grammar import GrammarError, GrammarSpec
from chatd.engine.sampling import SamplingParams
from chatd.engine.turn import TokenText, Turn, TurnResult
from sessions import Session
from tests.support import run_turn, running_engine

TICKET = {"type": "object", "properties": {
    "category": {"type": "string", "enum": ["billing", "shipping", "account", "other"]},
    "priority": {"type": "integer", "minimum": 1, "maximum": 5},
    "escalate": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["refund", "late", "broken"]}, "maxItems": 2},
}, "required": ["category", "priority", "escalate", "tags"], "additionalProperties": False}


def _compiled(engine, schema=TICKET, trigger=None):
    return engine.grammars.compile(GrammarSpec("json_schema", json.dumps(schema), trigger)).result()


def test_a_reply_held_to_a_schema_is_valid_json_for_it(tiny):
    with running_engine(tiny) as engine:
        grammar = _compiled(engine)
        for seed, temperature in ((None, 0.0), (3, 1.0), (4, 1.5)):
            result, _ = run_turn(engine, Session(f"s{seed}"), "Open a ticket.", max_new_tokens=120,
                                 temperature=temperature, seed=seed, grammar=grammar)
            assert result.finish_reason == "stop", result
            jsonschema.validate(json.loads(result.content), TICKET)
        assert _compiled(engine) is grammar, "compiled once, then taken from the cache"
        assert engine.grammars.stats.cache_hits >= 1


def test_unconstrained_rows_beside_constrained_ones_answer_as_they_do_alone(tiny):
    questions = ["Where is my parcel?", "My invoice is wrong.", "Reset my password.", "Cancel order 12."]
    with running_engine(tiny, max_batch=4) as batched, running_engine(tiny, max_batch=1) as alone:
        grammar = _compiled(batched)
        results: dict[int, TurnResult] = {}
        finished = threading.Event()

        def emitter(index):
            def emit(event):
                if not isinstance(event, TokenText):
                    results[index] = event
                    if len(results) == len(questions):
                        finished.set()
            return emit

        for index, question in enumerate(questions):
            params = SamplingParams(max_new_tokens=24 + 4 * index, grammar=grammar if index % 2 else None)
            batched.submit(Turn(f"t{index}", f"b{index}", Session(f"b{index}").prompt_messages(question), params,
                                emitter(index)))
        assert finished.wait(120)
        assert max(batched.counts.batch_sizes) > 1, "the constrained and the free rows decoded together"
        for index, question in enumerate(questions):
            if index % 2:
                jsonschema.validate(json.loads(results[index].content), TICKET)
            else:
                expected, _ = run_turn(alone, Session(f"a{index}"), question, max_new_tokens=24 + 4 * index)
                assert results[index].token_ids == expected.token_ids


def test_a_lazy_grammar_holds_the_reply_only_from_its_trigger(tiny):
    with running_engine(tiny) as engine:
        call = {"type": "object", "properties": {"name": {"const": "lookup"}}, "required": ["name"],
                "additionalProperties": False}
        lark = f'start: "<call>" %json {json.dumps(call)} "</call>"'
        compiled = engine.grammars.compile(GrammarSpec("lark", lark, trigger="<call>")).result()
        reply = engine.grammars.start(compiled)
        tokenizer = tiny.tokenizer
        assert not reply.active
        text = ""
        for token in tokenizer("Let me check. <call>", add_special_tokens=False)["input_ids"]:
            text += tokenizer.decode([token])
            reply.accept(token, text)
        assert reply.active and reply.error is None, "the trigger switched the grammar on, mid-reply"
        for token in tokenizer('{"name":"lookup"}</call>', add_special_tokens=False)["input_ids"]:
            reply.accept(token, text)
        assert reply.complete and reply.error is None


def test_a_grammar_that_cannot_compile_is_refused_with_the_reason(tiny):
    with running_engine(tiny) as engine:
        with pytest.raises(GrammarError):
            engine.grammars.compile(GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {
                "a": {"$ref": "#/definitions/missing"}}}))).result()
        with pytest.raises(GrammarError, match="at most"):
            engine.grammars.compile(GrammarSpec("regex", "a" * 300_000)).result()


def test_a_draft_checked_while_the_mask_thread_fills_the_same_grammar_never_collides(tiny):
    """The engine checks a row's draft against its grammar while the mask thread may still fill that grammar's
    mask (llguidance borrows the matcher for each and frees the GIL while it fills): one at a time, never an
    "Already borrowed" error, and the fill's mask and the check's answer stay right."""
    from chatd.engine.grammar import GrammarCompiler, fill_masks

    with running_engine(tiny) as engine:
        compiler: GrammarCompiler = engine.grammars
        grammar = compiler.start(_compiled(engine))
        opening = tiny.tokenizer.encode('{"category": "billing"', add_special_tokens=False)
        wrong = tiny.tokenizer.encode('"nope"', add_special_tokens=False)
        accepted = grammar.accepted_prefix(opening)  # (alone)
        assert accepted > 0 and grammar.accepted_prefix(wrong) == 0
        errors: list[BaseException] = []
        stop = threading.Event()

        def fill_on_and_on():
            try:
                while not stop.is_set():
                    assert bool(fill_masks(compiler, [grammar]).ne(0).any())
            except BaseException as error:  # noqa: BLE001 (reported by the test)
                errors.append(error)

        filler = threading.Thread(target=fill_on_and_on)
        filler.start()
        try:
            for _ in range(2000):
                assert grammar.accepted_prefix(opening) == accepted
                assert grammar.accepted_prefix(wrong) == 0
                assert not grammar.complete
        finally:
            stop.set()
            filler.join(10)
        assert not errors, errors
