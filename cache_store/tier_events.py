"""What the device and host tiers tell an observer of what they hold (KV events for outside routers): each key's
token ids as a tier takes it, and that it let it go. The tiers call these on the engine thread, as they change."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

Medium = Literal["GPU", "CPU"]  # vLLM's names: the device tier's caches, the host tier's


class TierEvents(Protocol):
    """An observer of what the tiers hold (`BlockLedger`); the tiers' default tells no one (`NO_EVENTS`)."""

    def held(self, medium: Medium, key: str, token_ids: Sequence[int]) -> None:
        """`medium` now holds `key`'s cache over `token_ids` (taken, written back, or cropped)."""

    def let_go(self, medium: Medium, key: str) -> None:
        """`medium` no longer holds `key`'s cache."""


class _NoEvents:
    def held(self, medium: Medium, key: str, token_ids: Sequence[int]) -> None:
        pass

    def let_go(self, medium: Medium, key: str) -> None:
        pass


NO_EVENTS: TierEvents = _NoEvents()
