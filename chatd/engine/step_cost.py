"""What a batched step costs for each token it feeds, measured: whether a draft pays at this batch size."""

from __future__ import annotations

import statistics
from collections import Counter, deque

MIN_STEPS = 16  # steps measured before the fit is trusted (until then every draft is tried: that is how it is measured)
RECENT = 0.1  # the weight of a step in its batch size's running figure of steps without drafts
DRAFT_SAMPLES = 9  # what a draft token added to a batch size's steps: the median of its latest measurements
PROBE_EVERY = 64  # steps at a batch size where drafts do not pay, after which one step drafts again to re-measure


class StepCost:
    """Decode-step seconds fitted online as `fixed + per_token * tokens` (the tokens the step packs: one per row, and
    the drafts), the latest steps weighing most.

    A step of B rows without drafts makes B tokens in `fixed + per_token * B`. Drafting d more tokens, accepted at a
    rate r, makes r * d more for `per_token * d` more: the tokens per second rise when r is above
    `per_token * B / (fixed + per_token * B)`, the share of the step that grows with its tokens (`break_even`). On
    this CPU at batch 1 the fixed part dominates and a draft pays when a quarter of it is accepted; at batch 16 the
    step is mostly per-token work and a draft must be accepted almost whole.

    The line does not see everything a draft costs: a step where some row feeds more than one token may take
    another, slower path than one where every row feeds one, whatever the count. So each batch size also keeps its
    own figures, measured on the machine it runs on: the time of its steps without drafts, and what each draft
    token added to its steps with them (`record` with `batch`). Where both are known, they decide: a draft token
    costs c and a step without drafts t, and a draft pays when its acceptance is above c * B / t (above 1: never).

    A stall (another process, a page fault, a collection) must not turn drafts off for good: c is the median of the
    latest measurements, so one slow step does not move it, and where drafts do not pay, one step in PROBE_EVERY
    drafts anyway, so that c is measured again and a machine that got faster is seen."""

    def __init__(self, decay: float = 0.99):
        self._decay = decay
        self._steps = 0
        self._weight = self._tokens = self._squares = self._seconds = self._products = 0.0
        self._plain: dict[int, float] = {}  # batch size -> seconds of its steps without drafts (recent)
        self._per_draft: dict[int, deque[float]] = {}  # batch size -> seconds each draft token added (latest)
        self._unprobed: Counter[int] = Counter()  # batch size -> steps since its drafts were last measured
        self.probes = 0  # steps that drafted to re-measure where drafts did not pay

    def record(self, tokens: int, seconds: float, batch: int | None = None, drafted: int = 0) -> None:
        """A step of `tokens` packed tokens took `seconds`; with `batch` (a step of decoding rows only), that many
        rows and `drafted` draft tokens among the tokens."""
        if batch is not None:
            self._record_batch(batch, drafted, seconds)
        keep = self._decay
        self._steps += 1
        self._weight = keep * self._weight + 1
        self._tokens = keep * self._tokens + tokens
        self._squares = keep * self._squares + tokens * tokens
        self._seconds = keep * self._seconds + seconds
        self._products = keep * self._products + tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None while the steps measured do not tell them apart."""
        if self._steps < MIN_STEPS:
            return None
        mean_tokens, mean_seconds = self._tokens / self._weight, self._seconds / self._weight
        variance = self._squares / self._weight - mean_tokens ** 2
        if variance < 0.25:  # (every step fed about as many tokens: nothing to fit a slope on)
            return None
        per_token = max(0.0, (self._products / self._weight - mean_tokens * mean_seconds) / variance)
        return max(0.0, mean_seconds - per_token * mean_tokens), per_token

    def break_even(self, batch: int) -> float:
        """The acceptance rate above which drafting pays in a step of `batch` rows: from this batch size's own
        figures where it has them (above 1 where no draft can pay), else from the line (0 before it is measured)."""
        if batch in self._per_draft:
            needed = statistics.median(self._per_draft[batch]) * batch / self._plain[batch]
            if needed < 1:
                return needed
            self._unprobed[batch] += 1
            if self._unprobed[batch] < PROBE_EVERY:
                return needed
            self._unprobed[batch] = 0
            self.probes += 1
            return 0.0  # (a probe: this step's drafts measure what a draft token adds now)
        fitted = self.fit()
        if fitted is None:
            return 0.0
        fixed, per_token = fitted
        total = fixed + per_token * batch
        return per_token * batch / total if total > 0 else 0.0

    def _record_batch(self, batch: int, drafted: int, seconds: float) -> None:
        if not drafted:
            plain = self._plain.get(batch)
            self._plain[batch] = seconds if plain is None else (1 - RECENT) * plain + RECENT * seconds
        elif batch in self._plain:
            added = max(0.0, seconds - self._plain[batch]) / drafted
            self._per_draft.setdefault(batch, deque(maxlen=DRAFT_SAMPLES)).append(added)
