"""Constrained decoding: a reply held to a grammar by a token mask on its logits (llguidance).

The API layer turns JSON schemas, tool calls and `json_object` into a `GrammarSpec`; `GrammarCompiler`
validates and compiles it in a thread of its own (never the engine's, never the event loop), cached by
its text; each constrained turn then gets a `ReplyGrammar` that says which tokens may come next and
follows what was sampled. A spec with a `trigger` is lazy, as llama.cpp's lazy grammars are: the reply
is free until the trigger text appears, and the grammar holds it from the trigger on (a tool call that
the model opens after some prose). Why llguidance and not xgrammar: docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import llguidance
import llguidance.hf
import torch
from cachetools import LRUCache
from transformers import PreTrainedTokenizerBase

from cache_store import FaultPoints

log = logging.getLogger(__name__)
GRAMMAR_CACHE_SIZE = 256
MAX_GRAMMAR_CHARS = 256 * 1024  # a larger schema is refused before any work (an abuse, not a support bot)
_BITS = torch.arange(32, dtype=torch.int32)


@dataclass(frozen=True)
class GrammarSpec:
    """What a reply must follow: a JSON schema (as JSON text), a Lark grammar or a regex; with a
    trigger, only from the first place the reply's text holds the trigger on."""

    kind: Literal["json_schema", "lark", "regex"]
    source: str
    trigger: str | None = None


class GrammarError(ValueError):
    """A grammar the engine cannot compile; the message says why."""


@dataclass(frozen=True)
class CompiledGrammar:
    """A grammar ready for matchers: llguidance's serialized form, checked against the vocabulary."""

    spec: GrammarSpec
    grammar: str


@dataclass
class GrammarStats:
    """Compilations, cache hits and mask-fill times, for tests and the benchmark."""

    compiled: int = 0
    cache_hits: int = 0
    mask_ms: deque[float] = field(default_factory=lambda: deque(maxlen=4096))  # per filled batch of masks


class GrammarCompiler:
    """Compiles grammar specs for one tokenizer in a worker thread, keeping the latest ones by spec."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: frozenset[int],
                 faults: FaultPoints | None = None):
        self._hf_tokenizer, self._stop_token_ids = tokenizer, stop_token_ids
        self.vocab_size = vocab_size
        self.faults = faults or FaultPoints()  # (the "grammar" stage fails one session's mask, for tests and drills)
        self.stats = GrammarStats()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="chatd-grammar")
        self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="chatd-masks")
        self._cache: LRUCache[GrammarSpec, CompiledGrammar] = LRUCache(GRAMMAR_CACHE_SIZE)
        self._lock = threading.Lock()
        self.executor = llguidance.LLExecutor()  # fills the masks of a batch's constrained rows in parallel

    @functools.cached_property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """The vocabulary as llguidance reads it: built (about a second) by the first compile, in the grammar
        thread, so that the engine is ready without it."""
        return llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                            eos_token=sorted(self._stop_token_ids))

    def compile(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        """The compiled grammar, from the cache or compiled in the worker thread; a `GrammarError` fails it."""
        with self._lock:
            if (hit := self._cache.get(spec)) is not None:
                self.stats.cache_hits += 1
                done: Future[CompiledGrammar] = Future()
                done.set_result(hit)
                return done
        return self._pool.submit(self._compile, spec)

    def masks_ahead(self, grammars: list[ReplyGrammar]) -> Future[torch.Tensor]:
        """`fill_masks` in a thread of its own, to run while the model computes the step's logits."""
        return self._mask_pool.submit(fill_masks, self, grammars)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._mask_pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        if len(spec.source) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"the grammar is {len(spec.source)} characters; at most {MAX_GRAMMAR_CHARS}")
        try:
            if spec.kind == "json_schema":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    json.loads(spec.source), defaults={"whitespace_flexible": False})
            elif spec.kind == "lark":
                grammar = llguidance.LLMatcher.grammar_from_lark(spec.source)
            else:
                grammar = llguidance.LLMatcher.grammar_from_regex(spec.source)
        except ValueError as error:
            raise GrammarError(str(error)) from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        compiled = CompiledGrammar(spec, grammar)
        with self._lock:
            self.stats.compiled += 1
            self._cache[spec] = compiled
        return compiled

    def start(self, compiled: CompiledGrammar, session_id: str | None = None) -> ReplyGrammar:
        """A new reply (of `session_id`) held to `compiled`."""
        return ReplyGrammar(self, compiled, session_id)


class ReplyGrammar:
    """One reply's place in its grammar: the mask of the tokens that may come next, and the tokens taken.

    llguidance borrows a matcher mutably for each call, and its mask fill releases the GIL while it borrows: a second
    call on the same matcher meanwhile (a draft's check on the engine thread beside the fill on the mask thread)
    raises "Already borrowed". So every use of the matcher holds `lock`: one thread at a time."""

    def __init__(self, compiler: GrammarCompiler, compiled: CompiledGrammar, session_id: str | None = None):
        self._compiler, self._compiled, self.session_id = compiler, compiled, session_id
        self.lock = threading.Lock()
        self.trigger = compiled.spec.trigger
        self.matcher: llguidance.LLMatcher | None = None if self.trigger else self._new_matcher()
        self.error: str | None = None
        self._searched = 0  # how much of the reply's text a lazy grammar has looked through for its trigger

    @property
    def active(self) -> bool:
        """Whether the grammar holds the next token (a lazy one only after its trigger)."""
        return self.matcher is not None and self.error is None

    @property
    def complete(self) -> bool:
        """The grammar is satisfied and allows nothing but the end of the reply."""
        if self.matcher is None:
            return False
        with self.lock:
            return self.matcher.is_stopped() and not self.matcher.is_error()

    def accept(self, token: int, text: str) -> None:
        """Follow a sampled token (`text`: the reply's text so far, where a lazy grammar looks for its trigger)."""
        if self.error is not None:
            return
        if self.matcher is not None:
            with self.lock:
                if not self.matcher.consume_token(token):
                    self.error = self.matcher.get_error() or "the sampled token is outside the grammar"
            return
        # Only the new text (and a trigger it may complete) is searched: once per token, never the whole reply.
        start = text.find(self.trigger, max(0, self._searched - len(self.trigger) + 1))
        self._searched = len(text)
        if start >= 0:
            self.matcher = self._new_matcher()
            if not self.matcher.consume_tokens(self._compiler.tokenizer.tokenize_str(text[start:])):
                self.error = self.matcher.get_error() or "the text after the trigger is outside the grammar"

    def accepted_prefix(self, draft: list[int]) -> int:
        """How many of `draft`'s first tokens the grammar accepts from here (nothing is consumed)."""
        with self.lock:
            return self.matcher.validate_tokens(draft)

    def _new_matcher(self) -> llguidance.LLMatcher:
        return llguidance.LLMatcher(self._compiler.tokenizer, self._compiled.grammar, log_level=0)


def allocate_masks(rows: int, vocab_size: int) -> torch.Tensor:
    """A bitmask per row, 32 tokens a word, every token allowed."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def fill_masks(compiler: GrammarCompiler, grammars: list[ReplyGrammar]) -> torch.Tensor:
    """The next-token masks of active grammars, one row each (in parallel threads for several); the GIL
    is released while llguidance computes, so this may run beside the model's forward pass."""
    started = time.perf_counter()
    for grammar in grammars:
        compiler.faults.check("grammar", grammar.session_id)
    masks = allocate_masks(len(grammars), compiler.vocab_size)
    with contextlib.ExitStack() as holding:
        for grammar in grammars:  # (each reply's grammar is in one batch at a time: no two fills wait on each other)
            holding.enter_context(grammar.lock)
        if len(grammars) == 1:
            row = masks[0]
            grammars[0].matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        elif grammars:
            compiler.executor.unsafe_compute_mask_ptr([(g.matcher, i) for i, g in enumerate(grammars)],
                                                      masks.data_ptr(), masks.shape[1] * 4, len(grammars))
        for grammar in grammars:
            if grammar.matcher.is_error():
                grammar.error = grammar.matcher.get_error()
    compiler.stats.mask_ms.append((time.perf_counter() - started) * 1000.0)
    return masks


def masks_by_row(compiler: GrammarCompiler, grammars: list[ReplyGrammar], filled: Future[torch.Tensor]
                 ) -> list[torch.Tensor | Exception]:
    """Each grammar's mask, from a batch's fill (`masks_ahead`). When the grammar library failed that fill, each
    grammar is filled alone, so that one whose own fill fails gets its error instead of a mask, and the others
    their masks."""
    try:
        return list(filled.result())
    except Exception as error:
        log.warning("filling the masks of %d constrained turns failed (%s: %s); filling each alone", len(grammars),
                    type(error).__name__, error)
    masks: list[torch.Tensor | Exception] = []
    for grammar in grammars:
        try:
            masks.append(fill_masks(compiler, [grammar])[0])
        except Exception as error:
            masks.append(error)
    return masks


def masked_logits(compiler: GrammarCompiler, grammar: ReplyGrammar | None, logits: torch.Tensor,
                  mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """The logits with what the reply's grammar forbids at -inf (as they are when no grammar holds the
    reply); None when the grammar allows no token at all or has failed."""
    if grammar is None or not grammar.active:
        return logits
    if mask is None:
        mask = fill_masks(compiler, [grammar])[0]
    if grammar.error is not None:
        return None
    allowed = ((mask.unsqueeze(-1) >> _BITS) & 1).flatten()[:logits.shape[-1]].bool().to(logits.device)
    return logits.masked_fill(~allowed, float("-inf")) if bool(allowed.any()) else None
