"""What a batched step costs for each token it feeds, measured: whether a draft pays at this batch size."""

from __future__ import annotations

MIN_STEPS = 16  # steps measured before the fit is trusted (until then every draft is tried: that is how it is measured)


class StepCost:
    """Decode-step seconds fitted online as `fixed + per_token * tokens` (the tokens the step packs: one per row, and
    the drafts), the latest steps weighing most.

    A step of B rows without drafts makes B tokens in `fixed + per_token * B`. Drafting d more tokens, accepted at a
    rate r, makes r * d more for `per_token * d` more: the tokens per second rise when r is above
    `per_token * B / (fixed + per_token * B)`, the share of the step that grows with its tokens (`break_even`). On
    this CPU at batch 1 the fixed part dominates and a draft pays when a quarter of it is accepted; at batch 16 the
    step is mostly per-token work and a draft must be accepted almost whole."""

    def __init__(self, decay: float = 0.99):
        self._decay = decay
        self._steps = 0
        self._weight = self._tokens = self._squares = self._seconds = self._products = 0.0

    def record(self, tokens: int, seconds: float) -> None:
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
        """The acceptance rate above which drafting pays in a step of `batch` rows (0 before it is measured)."""
        fitted = self.fit()
        if fitted is None:
            return 0.0
        fixed, per_token = fitted
        total = fixed + per_token * batch
        return per_token * batch / total if total > 0 else 0.0
