"""What a decode step costs for its shape, measured: whether a draft pays in this step.

A step of B rows without drafts makes B tokens in t seconds. Drafting d more tokens, accepted at a rate r, makes
r * d more for c * d more seconds: the tokens per second rise when r is above c * B / t (`break_even`). Both t and
c depend on the step's shape, not on its batch size alone: t on the rows and on the key and value positions the step
reads (each row's own, a shared segment once), c on the rows too (a verification row is padded beside the others in
the attention over the rows' own positions). So every decode step is one sample of

    seconds = fixed + per_row * B + per_position * positions + drafted * (per_draft + per_draft_row * B)

fitted by least squares, the latest steps weighing most. Every step informs it, at any batch size: a crowd's steps
at batch 16, where drafts seldom pay and so are seldom measured, read the draft cost its steps at batch 6 measured
(before, each batch size kept its own figures: a few one-token drafts at batch 16, their cost divided by one token,
set its break-even at about 2 on a crowd whose drafts, all proposed, cost a quarter of that; issue 63).

A stall (another process, a page fault, a collection) must not turn drafts off for good: it is one sample among the
hundred or so the fit weighs, at every batch size, and where drafts do not pay one step in PROBE_EVERY drafts anyway,
so that their cost is measured again and a machine that got faster is seen."""

from __future__ import annotations

import numpy as np

MIN_STEPS = 16  # steps measured before the fit is trusted
MIN_DRAFTED = 4  # steps with drafts measured before their cost is (until then every draft is tried: so it is measured)
PROBE_EVERY = 64  # steps where drafts do not pay, after which one step drafts again to re-measure
ROWS_SCALE = 16.0  # (the features kept near one: rows and positions in these units)
POSITIONS_SCALE = 1000.0


def _features(rows: int, drafted: int, positions: int) -> np.ndarray:
    return np.array([1.0, rows / ROWS_SCALE, positions / POSITIONS_SCALE, float(drafted),
                     drafted * rows / ROWS_SCALE])


class StepCost:
    """Decode-step seconds fitted online on the step's shape (rows, positions read, draft tokens), the latest steps
    weighing most (`decay` a step)."""

    def __init__(self, decay: float = 0.99):
        self._decay = decay
        self._gram = np.zeros((5, 5))
        self._moments = np.zeros(5)
        self._steps = self._drafted_steps = 0
        self._coefficients: np.ndarray | None = None
        self._unprobed = 0  # steps since drafts were last measured where they did not pay
        self.probes = 0  # steps that drafted to re-measure where drafts did not pay

    def record(self, seconds: float, rows: int, drafted: int = 0, positions: int = 0) -> None:
        """A decode step of `rows` rows (no prompt riding), `drafted` draft tokens among its tokens and `positions`
        key and value positions read, took `seconds`."""
        features = _features(rows, drafted, positions)
        self._gram = self._decay * self._gram + np.outer(features, features)
        self._moments = self._decay * self._moments + features * seconds
        self._steps += 1
        self._drafted_steps += bool(drafted)
        if self._steps >= MIN_STEPS:
            ridge = 1e-9 * np.trace(self._gram) * np.eye(5)  # (a feature that has not varied stays near 0)
            self._coefficients = np.linalg.solve(self._gram + ridge, self._moments)

    def draft_cost(self, rows: int) -> float | None:
        """Seconds a draft token adds to a step of `rows` rows (None until measured)."""
        if self._coefficients is None or self._drafted_steps < MIN_DRAFTED:
            return None
        return max(0.0, float(self._coefficients[3] + self._coefficients[4] * rows / ROWS_SCALE))

    def plain_seconds(self, rows: int, positions: int) -> float | None:
        """Seconds of a step of `rows` rows reading `positions` positions without drafts (None until measured)."""
        if self._coefficients is None:
            return None
        return float(_features(rows, 0, positions) @ self._coefficients)

    def break_even(self, rows: int, positions: int = 0) -> float:
        """The acceptance rate above which drafting pays in a step of this shape (above 1 where no draft can pay;
        0 until the cost of a draft is measured, and once in PROBE_EVERY steps where drafts do not pay)."""
        cost, plain = self.draft_cost(rows), self.plain_seconds(rows, positions)
        if cost is None or plain is None or plain <= 0:
            return 0.0
        needed = cost * rows / plain
        if needed < 1:
            self._unprobed = 0
            return needed
        self._unprobed += 1
        if self._unprobed < PROBE_EVERY:
            return needed
        self._unprobed = 0
        self.probes += 1
        return 0.0  # (a probe: this step's drafts measure what a draft token adds now)
