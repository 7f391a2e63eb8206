"""Drafts for speculative decoding with no draft model: what a support reply restates is already written.

Two sources, looked up by the last few tokens of a row (its prompt and what it has generated):
- the conversation itself (prompt lookup: transformers' `prompt_lookup_num_tokens`, vLLM's `ngram`, llama.cpp's
  lookup decoding): the policy in the system prompt, the order number the customer typed, an earlier reply;
- the owner's recent replies (suffix decoding, Arctic Inference): the answer the desk gave the last customers who
  asked the same. Kept per owner (API key), never across owners: another tenant's replies must not leak through a
  draft, nor through how fast a reply comes. Bounded in tokens, the least recently used owner dropped first.

A row's index is built a little each step, its conversation's newest positions first (`INDEX_STEP_TOKENS` for the
whole batch, `INDEXED_TOKENS` at most): a 32K-token prompt would take about 56 ms and 14 MB to index at once, on the
engine thread, at the turn's first decode step, while the batch waits, even for a turn that never drafts. The system
prompt the rows start with (a desk's policy) is indexed once for all of them (`SharedIndexes`): sixteen rows each
indexing their own copy of a 1,000-token policy at that budget had it indexed only after about thirty steps, when most
of their replies were written, so the best draft source there is was hardly used (issue 63).

A draft is only a guess: the batched step verifies it, and only what the model itself would have sampled is kept
(`StepUpdater._advance`). Each row's draft length follows its acceptance, a row whose drafts are seldom accepted
stops drafting for the rest of its turn, and a draft is proposed only when its expected acceptance (the row's own,
and that of drafts found by as long a match) is above what a step of this shape needs for it to pay
(`StepCost.break_even`): at a large batch on a CPU, only drafts that are mostly taken.
"""

from __future__ import annotations

import os
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from chatd.engine.step_cost import StepCost

NGRAMS = (8, 4, 2)  # the lengths of tail looked up, longest first (8: the customer's question, and the turn's start)
INDEX_STEP_TOKENS = 512  # conversation positions indexed per decode step, all rows together (about 1 ms on a CPU)
INDEXED_TOKENS = 16_384  # a conversation's newest positions that its drafts are looked up in, at most
BOOK_TOKENS = 32_768  # an owner's recent replies, in tokens (with their contexts)
BOOK_TOKEN_BYTES = 460  # host memory a book takes per token (its ids and the n-gram index; measured, tracemalloc)
BOOKS_MAX_BYTES = 256 * 2**20  # every owner's books together by default: 1% of the host's memory, at most this
TRIAL_DRAFTS = 4  # drafts a row tries before its acceptance decides whether it drafts on
PAYING_ACCEPTANCE = 0.3  # accepted draft tokens per draft token below which a row stops drafting
SHARED_TOKENS = 65_536  # the system prompts indexed once for all their rows, in tokens together (the LRU leaves first)
PRIOR_TOKENS = 4  # how many draft tokens the acceptance of drafts found by as long a match weighs in a row's estimate
_GAP = -1  # between two replies in a book: no n-gram spans it, no draft runs past it


class NgramIndex:
    """Where each n-gram of a growing token sequence was last followed by a token (for n in `NGRAMS`). What it
    starts with is indexed at once, or (`newest`) only its last `newest` positions, a few at a time (`index_back`)
    newest first; what `extend` appends is indexed at once."""

    def __init__(self, ids: Sequence[int] = (), newest: int | None = None):
        self.ids: list[int] = []
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in NGRAMS}
        if newest is None:
            self.extend(ids)
        else:
            self.ids.extend(ids)
        self._back = len(self.ids)  # the positions before it are not indexed yet (down to `_floor`)
        self._floor = self._back if newest is None else max(0, self._back - newest)

    @property
    def unindexed(self) -> int:
        """Positions it started with that `index_back` has still to index."""
        return self._back - self._floor

    def extend(self, ids: Sequence[int]) -> None:
        """Append `ids`; every n-gram that now has a next token is indexed at its end (the latest wins)."""
        old = len(self.ids)
        self.ids.extend(ids)
        for n, ends in self._ends.items():
            for end in range(max(n, old), len(self.ids)):
                gram = tuple(self.ids[end - n:end])
                if _GAP not in gram:
                    ends[gram] = end

    def index_back(self, budget: int) -> int:
        """Index up to `budget` more of the positions it started with, the newest first (a later occurrence, already
        indexed, stays the one found); returns how many."""
        stop = max(self._floor, self._back - budget)
        for n, ends in self._ends.items():
            for end in range(self._back - 1, max(n, stop) - 1, -1):
                gram = tuple(self.ids[end - n:end])
                if _GAP not in gram:
                    ends.setdefault(gram, end)
        taken, self._back = self._back - stop, stop
        return taken

    def follow(self, tail: Sequence[int], limit: int, n: int | None = None) -> list[int]:
        """Up to `limit` tokens that followed the last `n` tokens of `tail` where they last occurred (without `n`:
        the longest of `NGRAMS` that occurred)."""
        for length in NGRAMS if n is None else (n,):
            if len(tail) >= length and (end := self._ends[length].get(tuple(tail[-length:]))) is not None:
                follows = self.ids[end:end + limit]
                return follows[:follows.index(_GAP)] if _GAP in follows else follows
        return []


def default_books_bytes() -> int:
    """What every owner's books may take by default: 1% of the host's memory, at most `BOOKS_MAX_BYTES`."""
    try:
        host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # (not POSIX)
        return BOOKS_MAX_BYTES
    return min(BOOKS_MAX_BYTES, host // 100)


class ReplyBooks:
    """Each owner's recent replies, indexed by n-grams (a reply is kept with the tokens just before it, so that the
    start of a reply is found from the prompt's last tokens). Bounded: `book_tokens` per owner (the oldest replies
    leave first), `budget_bytes` for all (--speculation-books-mb; the least recently used owner leaves first)."""

    def __init__(self, book_tokens: int = BOOK_TOKENS, budget_bytes: int | None = None):
        self.budget_bytes = default_books_bytes() if budget_bytes is None else budget_bytes
        self.book_tokens, self.total_tokens = book_tokens, self.budget_bytes // BOOK_TOKEN_BYTES
        self._books: OrderedDict[str, tuple[deque[list[int]], NgramIndex]] = OrderedDict()
        self.tokens = 0

    def add(self, owner: str, context: Sequence[int], reply: Sequence[int]) -> None:
        if not reply:
            return
        replies, index = self._books.pop(owner, None) or (deque(), NgramIndex())
        kept = [*context[-max(NGRAMS):], *reply, _GAP]
        replies.append(kept)
        self.tokens += len(kept)
        if len(index.ids) + len(kept) > self.book_tokens:  # the oldest leave; the index is built again
            while replies and sum(map(len, replies)) > self.book_tokens // 2:
                self.tokens -= len(replies.popleft())
            index = NgramIndex([token for kept_reply in replies for token in kept_reply])
        else:
            index.extend(kept)
        self._books[owner] = (replies, index)
        while self.tokens > self.total_tokens and self._books:
            _, (dropped, _) = self._books.popitem(last=False)
            self.tokens -= sum(map(len, dropped))

    @property
    def nbytes(self) -> int:
        """The host memory the books take, as `BOOK_TOKEN_BYTES` estimates it."""
        return self.tokens * BOOK_TOKEN_BYTES

    def follow(self, owner: str, tail: Sequence[int], limit: int, n: int | None = None) -> list[int]:
        book = self._books.get(owner)
        if book is None:
            return []
        self._books.move_to_end(owner)
        return book[1].follow(tail, limit, n)


class SharedIndexes:
    """The index of each system prompt that an owner's rows start with, one for all of them (per owner, as the
    cache shares a system prompt: whether another key's rows use the same one must not show, even in how soon a
    row drafts). Bounded: `max_tokens` for all, the least recently used leaving first."""

    def __init__(self, max_tokens: int = SHARED_TOKENS):
        self.max_tokens = max_tokens
        self._indexes: OrderedDict[tuple[str, tuple[int, ...]], NgramIndex] = OrderedDict()
        self.tokens = 0

    def get(self, owner: str, ids: Sequence[int]) -> NgramIndex:
        """The index of `owner`'s system prompt `ids` (its newest `INDEXED_TOKENS` positions, indexed a few at a time
        as rows draft)."""
        key = (owner, tuple(ids))
        index = self._indexes.get(key)
        if index is None:
            index = self._indexes[key] = NgramIndex(ids, newest=INDEXED_TOKENS)
            self.tokens += len(ids)
            while self.tokens > self.max_tokens and len(self._indexes) > 1:
                _, dropped = self._indexes.popitem(last=False)
                self.tokens -= len(dropped.ids)
        self._indexes.move_to_end(key)
        return index


@dataclass
class RowDrafts:
    """One turn's drafting: its own tokens indexed, how long its next draft may be, and how its drafts fared."""

    index: NgramIndex  # over its prompt after the shared system prompt, then what it generates
    prompt_len: int  # the prompt's tokens in `index`
    limit: int
    shared: NgramIndex | None = None  # the system prompt it starts with, indexed once for every row that does
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens the model sampled too
    tries: int = 0  # drafts proposed
    stopped: bool = False  # its drafts did not pay: no more this turn
    match: int = 0  # the length of the match its latest draft was found by

    def record(self, drafted: int, accepted: int, most: int) -> None:
        """A verified draft: the next may be longer when all of this one was taken, else just past what was."""
        self.tries += 1
        self.drafted += drafted
        self.accepted += accepted
        self.limit = min(most, self.limit + 2) if accepted == drafted else max(1, accepted + 1)
        if self.tries >= TRIAL_DRAFTS and self.accepted < PAYING_ACCEPTANCE * self.drafted:
            self.stopped = True


@dataclass
class SpeculationCounters:
    """Every draft the engine verified, as vLLM counts them (`spec_decode_*`)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: Counter[int] = field(default_factory=Counter)  # 0: a draft's first token

    def published(self) -> dict[str, int]:
        """As the engine publishes its figures (for /metrics and /v1/stats)."""
        return {"spec_drafts": self.drafts, "spec_draft_tokens": self.draft_tokens,
                "spec_accepted_tokens": self.accepted_tokens,
                **{f"spec_accepted_at_{position}": count for position, count in self.accepted_per_position.items()}}


class Speculator:
    """Proposes each decoding row's draft (the longest match of its last tokens, in its conversation first, then in
    its owner's replies) and learns from what the step verified. `max_tokens` caps a draft; 0 turns speculation off."""

    def __init__(self, max_tokens: int, books: ReplyBooks | None = None):
        self.max_tokens = max_tokens
        self.books = books or ReplyBooks()
        self.shared = SharedIndexes()
        self.counters = SpeculationCounters()
        self._index_budget = INDEX_STEP_TOKENS  # what the rows of this step may still index
        self.cost = StepCost()
        # The recent acceptance of drafts found by each length of match (hopeful at first: tried, then measured).
        self.acceptance = dict.fromkeys(NGRAMS, 1.0)

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    def start(self, ids: Sequence[int], shared: int = 0, owner: str = "") -> RowDrafts | None:
        """A turn's drafting, over its prompt `ids` whose first `shared` tokens are a system prompt other rows of
        `owner` may start with (None with speculation off): nothing is indexed yet."""
        if not self.enabled:
            return None
        own = ids[shared:]
        return RowDrafts(NgramIndex(own, newest=INDEXED_TOKENS), len(own), self.max_tokens,
                         self.shared.get(owner, ids[:shared]) if shared else None)

    def new_step(self) -> None:
        """A decode step begins: its rows may index `INDEX_STEP_TOKENS` more positions of their prompts, together."""
        self._index_budget = INDEX_STEP_TOKENS

    def published(self) -> dict[str, int]:
        """The counters and the books' size and bound, for /metrics and /v1/stats."""
        return {**self.counters.published(), "spec_max_tokens": self.max_tokens, "spec_books_bytes": self.books.nbytes,
                "spec_books_limit_bytes": self.books.budget_bytes}

    def propose(self, row: RowDrafts | None, owner: str, generated: Sequence[int], room: int, needed: float = 0.0
                ) -> list[int]:
        """A draft to follow the row's last token (at most `room` tokens: what its reply may still add), when its
        expected acceptance is at least `needed` (what the step's shape needs for a draft to pay)."""
        if row is None or row.stopped or room <= 0:
            return []
        for index in (row.index, row.shared):
            if index is not None and index.unindexed and self._index_budget > 0:
                self._index_budget -= index.index_back(self._index_budget)
        row.index.extend(generated[len(row.index.ids) - row.prompt_len:])
        limit, tail = min(row.limit, room), row.index.ids
        for n in NGRAMS:  # the longest match: in the conversation (its own tokens, its system prompt), in the books
            if draft := self._follow(row, owner, tail, limit, n):
                expected = (row.accepted + PRIOR_TOKENS * self.acceptance[n]) / (row.drafted + PRIOR_TOKENS)
                if expected < needed:
                    return []
                row.match = n
                return draft
        return []

    def _follow(self, row: RowDrafts, owner: str, tail: Sequence[int], limit: int, n: int) -> list[int]:
        """What followed the last `n` tokens of `tail` in the row's own tokens, else its system prompt, else its
        owner's replies."""
        for index in (row.index, row.shared):
            if index is not None and (draft := index.follow(tail, limit, n)):
                return draft
        return self.books.follow(owner, tail, limit, n)

    def verified(self, row: RowDrafts, drafted: int, accepted: int) -> None:
        row.record(drafted, accepted, self.max_tokens)
        self.acceptance[row.match] = 0.9 * self.acceptance[row.match] + 0.1 * accepted / drafted
        self.counters.drafts += 1
        self.counters.draft_tokens += drafted
        self.counters.accepted_tokens += accepted
        for position in range(accepted):
            self.counters.accepted_per_position[position] += 1

    def finished(self, owner: str, prompt_ids: Sequence[int], reply: Sequence[int]) -> None:
        """A reply to remember for the owner's next customers."""
        if self.enabled:
            self.books.add(owner, prompt_ids, reply)
