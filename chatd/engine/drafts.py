"""Drafts for speculative decoding with no draft model: what a support reply restates is already written.

Two sources, looked up by the last few tokens of a row (its prompt and what it has generated):
- the conversation itself (prompt lookup: transformers' `prompt_lookup_num_tokens`, vLLM's `ngram`, llama.cpp's
  lookup decoding): the policy in the system prompt, the order number the customer typed, an earlier reply;
- the owner's recent replies (suffix decoding, Arctic Inference): the answer the desk gave the last customers who
  asked the same. Kept per owner (API key), never across owners: another tenant's replies must not leak through a
  draft, nor through how fast a reply comes. Bounded in tokens, the least recently used owner dropped first.

A draft is only a guess: the batched step verifies it, and only what the model itself would have sampled is kept
(`Scheduler._advance`). Each row's draft length follows its acceptance, a row whose drafts are seldom accepted
stops drafting for the rest of its turn, and a draft is proposed only when its expected acceptance (the row's own,
and that of drafts found by as long a match) is above what a step of this batch size needs for it to pay
(`StepCost.break_even`): at a large batch on a CPU, only drafts that are nearly always taken.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from chatd.engine.step_cost import StepCost

NGRAMS = (8, 4, 2)  # the lengths of tail looked up, longest first (8: the customer's question, and the turn's start)
BOOK_TOKENS = 32_768  # an owner's recent replies, in tokens (with their contexts)
BOOKS_TOKENS = 1_000_000  # every owner's together: beyond it, the least recently used owner's book is dropped
TRIAL_DRAFTS = 4  # drafts a row tries before its acceptance decides whether it drafts on
PAYING_ACCEPTANCE = 0.3  # accepted draft tokens per draft token below which a row stops drafting
PRIOR_TOKENS = 4  # how many draft tokens the acceptance of drafts found by as long a match weighs in a row's estimate
_GAP = -1  # between two replies in a book: no n-gram spans it, no draft runs past it


class NgramIndex:
    """Where each n-gram of a growing token sequence was last followed by a token (for n in `NGRAMS`)."""

    def __init__(self, ids: Sequence[int] = ()):
        self.ids: list[int] = []
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in NGRAMS}
        self.extend(ids)

    def extend(self, ids: Sequence[int]) -> None:
        """Append `ids`; every n-gram that now has a next token is indexed at its end (the latest wins)."""
        old = len(self.ids)
        self.ids.extend(ids)
        for n, ends in self._ends.items():
            for end in range(max(n, old), len(self.ids)):
                gram = tuple(self.ids[end - n:end])
                if _GAP not in gram:
                    ends[gram] = end

    def follow(self, tail: Sequence[int], limit: int, n: int | None = None) -> list[int]:
        """Up to `limit` tokens that followed the last `n` tokens of `tail` where they last occurred (without `n`:
        the longest of `NGRAMS` that occurred)."""
        for length in NGRAMS if n is None else (n,):
            if len(tail) >= length and (end := self._ends[length].get(tuple(tail[-length:]))) is not None:
                follows = self.ids[end:end + limit]
                return follows[:follows.index(_GAP)] if _GAP in follows else follows
        return []


class ReplyBooks:
    """Each owner's recent replies, indexed by n-grams (a reply is kept with the tokens just before it, so that the
    start of a reply is found from the prompt's last tokens). Bounded: `book_tokens` per owner (the oldest replies
    leave first), `total_tokens` for all (the least recently used owner leaves first)."""

    def __init__(self, book_tokens: int = BOOK_TOKENS, total_tokens: int = BOOKS_TOKENS):
        self.book_tokens, self.total_tokens = book_tokens, total_tokens
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
        while self.tokens > self.total_tokens and len(self._books) > 1:
            _, (dropped, _) = self._books.popitem(last=False)
            self.tokens -= sum(map(len, dropped))

    def follow(self, owner: str, tail: Sequence[int], limit: int, n: int | None = None) -> list[int]:
        book = self._books.get(owner)
        if book is None:
            return []
        self._books.move_to_end(owner)
        return book[1].follow(tail, limit, n)


@dataclass
class RowDrafts:
    """One turn's drafting: its own tokens indexed, how long its next draft may be, and how its drafts fared."""

    index: NgramIndex  # over its prompt, then what it generates
    prompt_len: int
    limit: int
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
        self.counters = SpeculationCounters()
        self.cost = StepCost()
        # The recent acceptance of drafts found by each length of match (hopeful at first: tried, then measured).
        self.acceptance = dict.fromkeys(NGRAMS, 1.0)

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    def start(self, ids: Sequence[int]) -> RowDrafts | None:
        """A turn's drafting, over its prompt `ids` (None with speculation off)."""
        return RowDrafts(NgramIndex(ids), len(ids), self.max_tokens) if self.enabled else None

    def propose(self, row: RowDrafts | None, owner: str, generated: Sequence[int], room: int, needed: float = 0.0
                ) -> list[int]:
        """A draft to follow the row's last token (at most `room` tokens: what its reply may still add), when its
        expected acceptance is at least `needed` (what the step's batch size needs for a draft to pay)."""
        if row is None or row.stopped or room <= 0:
            return []
        row.index.extend(generated[len(row.index.ids) - row.prompt_len:])
        limit, tail = min(row.limit, room), row.index.ids
        for n in NGRAMS:  # the longest match, in the conversation first, then in the owner's replies
            if draft := row.index.follow(tail, limit, n) or self.books.follow(owner, tail, limit, n):
                expected = (row.accepted + PRIOR_TOKENS * self.acceptance[n]) / (row.drafted + PRIOR_TOKENS)
                if expected < needed:
                    return []
                row.match = n
                return draft
        return []

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
