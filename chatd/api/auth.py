"""API keys: who a connection is, so that each session is used only by the key that created it."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping


def key_id(key: str) -> str:
    """A stable name for a key that reveals nothing about it: sessions store this, logs show this."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


class KeyRing:
    """The server's API keys, compared in constant time, known by their ids."""

    def __init__(self, keys: list[str]):
        self._keys = [(key.encode(), key_id(key)) for key in dict.fromkeys(keys)]

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def identify(self, token: str) -> str | None:
        """The id of the key `token` is, or None. Every key is compared, each in constant time, so the
        time taken says nothing about which key (or how much of one) matched."""
        found = None
        presented = token.encode()
        for key, name in self._keys:
            if hmac.compare_digest(presented, key):
                found = name
        return found

    def bearer(self, headers: Mapping[str, str]) -> tuple[bool, str | None]:
        """(whether an Authorization header was sent, the id of its key or None)."""
        header = headers.get("Authorization")
        if header is None:
            return False, None
        scheme, _, token = header.partition(" ")
        return True, self.identify(token.strip()) if scheme.lower() == "bearer" else None
