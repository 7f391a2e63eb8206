"""What this worker holds, in the full blocks outside KV-aware routers count (vLLM's KV events): every key's blocks
per medium, each block published once however many keys hold it (a shared system prompt's blocks are the parent of
every session that starts with it) and removed once the last holder lets it go.

The tiers tell the ledger what they hold as it changes (`held`, `let_go`); `flush`, after each engine step, turns
what changed since into one batch of events, so that a cache written back (let go, then taken again) costs only its
new blocks. A block's id chains its parent's id, its tokens and, for a key's (or a salt's) conversations, that
scope's public name: the same tokens in two scopes are two blocks, as chatd never shares a cache across keys. The
name is a digest of the owner seeded by a secret of the fleet's (`--kv-scope-secret`), so no client can compute
another key's ids from tokens. Consumers rehash the token ids themselves; the ids link a block to its parent and
name it when it is removed."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import xxhash

from cache_store.tier_events import Medium

if TYPE_CHECKING:
    from cache_store.store import CacheStore



@dataclass(frozen=True)
class BlockStored:
    """Consecutive full blocks newly held in `medium`: `block_ids[0]`'s parent is `parent` (None: the first block)."""

    medium: Medium
    block_ids: list[int]
    parent: int | None
    token_ids: list[int]
    scope: str | None  # its key's (or salt's) scope's public name (`public_scope`), carried by a sequence's first block


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks no key of `medium` holds any more."""

    medium: Medium
    block_ids: list[int]


@dataclass(frozen=True)
class AllBlocksCleared:
    """Everything published before is void (at start, and before the full state after a lost batch)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def public_scope(owner: str | None, secret: str) -> str | None:
    """An owner's (a key's, or a key's salt's) name for outside routers: a digest of it seeded by `secret`, never the
    key nor the salt; None for no owner (a server without keys, unsalted): every such cache is one scope."""
    if owner is None:
        return None
    return "scope-" + xxhash.xxh3_64_hexdigest(owner.encode(), seed=xxhash.xxh3_64_intdigest(secret.encode()))


def block_id(parent: int | None, tokens: Sequence[int], scope: str | None) -> int:
    """The id of a block of `tokens` after `parent`: a chained hash (63 bits, so that signed consumers read it)."""
    digest = xxhash.xxh3_64()
    digest.update((parent if parent is not None else -1).to_bytes(8, "little", signed=True))
    digest.update(b"".join(token.to_bytes(4, "little") for token in tokens))
    if parent is None and scope is not None:
        digest.update(scope.encode())
    return digest.intdigest() & (2**63 - 1)


def block_chain(token_ids: Sequence[int], block_size: int, scope: str | None) -> list[int]:
    """The ids of the full blocks of `token_ids`, each chained to the one before."""
    ids: list[int] = []
    for start in range(0, len(token_ids) // block_size * block_size, block_size):
        ids.append(block_id(ids[-1] if ids else None, token_ids[start:start + block_size], scope))
    return ids


def held_tokens(store: CacheStore) -> list[tuple[Medium, str | None, list[int]]]:
    """What the device and host tiers hold, read from the tiers themselves (not from a ledger): each cache's medium,
    owner and token ids (copied, so that their blocks can be hashed off the engine thread)."""
    held: list[tuple[Medium, str | None, list[int]]] = []
    for key in store.device:
        if (entry := store.device.peek(key)) is not None:
            held.append(("GPU", store.owner_of(key), list(entry.token_ids)))
    for key in store.host.keys():
        if (copy := store.host.get(key)) is not None:
            held.append(("CPU", store.owner_of(key), list(copy.token_ids)))
    return held


def blocks_of(held: list[tuple[Medium, str | None, list[int]]], block_size: int, secret: str
              ) -> dict[Medium, set[int]]:
    """The ids of the full blocks of what `held_tokens` read: what a worker's published events must add up to."""
    blocks: dict[Medium, set[int]] = {"GPU": set(), "CPU": set()}
    for medium, owner, token_ids in held:
        blocks[medium].update(block_chain(token_ids, block_size, public_scope(owner, secret)))
    return blocks


@dataclass
class _Holding:
    """One key's blocks in one medium, as last published."""

    block_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # the tokens of those blocks
    scope: str | None = None


class BlockLedger:
    """The blocks each medium holds, by key, and the events that say so. The engine thread's alone."""

    def __init__(self, block_size: int, send: Callable[[list[KVEvent]], bool],
                 scope_of: Callable[[str], str | None] = lambda key: None):
        self.block_size = block_size
        self._send = send  # False when the batch was not taken (a full queue): the next carries the full state
        self._scope_of = scope_of  # a key's public scope (`public_scope` of its owner)
        self._holdings: dict[tuple[Medium, str], _Holding] = {}
        self._refs: dict[Medium, Counter[int]] = {"GPU": Counter(), "CPU": Counter()}
        self._pending: dict[tuple[Medium, str], list[int] | None] = {}  # changed since the last flush (None: let go)
        self._lost = False
        self.batches_dropped = 0
        self._deliver([AllBlocksCleared()])

    def held(self, medium: Medium, key: str, token_ids: Sequence[int]) -> None:
        self._pending[(medium, key)] = list(token_ids[:len(token_ids) // self.block_size * self.block_size])

    def let_go(self, medium: Medium, key: str) -> None:
        self._pending[(medium, key)] = None

    def flush(self) -> None:
        """Publish what changed since the last flush: blocks no key holds any more, then blocks newly held."""
        if not self._pending and not self._lost:
            return
        pending, self._pending = self._pending, {}
        removed: dict[Medium, list[int]] = {"GPU": [], "CPU": []}
        stored: list[KVEvent] = []
        for (medium, key), token_ids in pending.items():
            removed[medium] += self._update(medium, key, token_ids or [], stored)
        if self._lost:
            self._deliver([AllBlocksCleared(), *self.full_state()])
            return
        events: list[KVEvent] = [BlockRemoved(medium, ids) for medium, ids in removed.items() if ids]
        if events or stored:
            self._deliver(events + stored)

    def full_state(self) -> Iterator[BlockStored]:
        """Every block held, per medium, as runs that each start where its parent is already stated."""
        seen: dict[Medium, set[int]] = {"GPU": set(), "CPU": set()}
        for (medium, _), holding in self._holdings.items():
            first = next((i for i, block in enumerate(holding.block_ids) if block not in seen[medium]), None)
            if first is None:
                continue
            seen[medium].update(holding.block_ids[first:])
            yield self._run(medium, holding, first, len(holding.block_ids))

    def blocks(self, medium: Medium) -> set[int]:
        """The ids of the blocks `medium` holds (for tests and checks)."""
        return {block for block, count in self._refs[medium].items() if count}

    def _update(self, medium: Medium, key: str, token_ids: list[int], stored: list[KVEvent]) -> list[int]:
        """Make `key`'s holding in `medium` cover `token_ids` (none: let go); the blocks no key holds any more.
        Blocks it newly holds that no other key held are appended to `stored`."""
        holding = self._holdings.get((medium, key)) or _Holding(scope=self._scope_of(key))
        size, old = self.block_size, holding.block_ids
        same = len(old) if token_ids[:len(holding.token_ids)] == holding.token_ids else next(
            (i for i in range(min(len(old), len(token_ids) // size))
             if holding.token_ids[i * size:(i + 1) * size] != token_ids[i * size:(i + 1) * size]),
            min(len(old), len(token_ids) // size))
        same = min(same, len(token_ids) // size)
        refs, gone = self._refs[medium], []
        for block in old[same:]:
            refs[block] -= 1
            if refs[block] == 0:
                del refs[block]
                gone.append(block)
        ids = old[:same]
        for index in range(same, len(token_ids) // size):
            ids.append(block_id(ids[-1] if ids else None, token_ids[index * size:(index + 1) * size], holding.scope))
        holding.block_ids, holding.token_ids = ids, token_ids
        new_from = None
        for index in range(same, len(ids)):
            refs[ids[index]] += 1
            fresh = refs[ids[index]] == 1
            if fresh and new_from is None:
                new_from = index
            elif not fresh and new_from is not None:
                stored.append(self._run(medium, holding, new_from, index))
                new_from = None
        if new_from is not None:
            stored.append(self._run(medium, holding, new_from, len(ids)))
        if ids:
            self._holdings[(medium, key)] = holding
        else:
            self._holdings.pop((medium, key), None)
        return gone

    def _run(self, medium: Medium, holding: _Holding, start: int, end: int) -> BlockStored:
        size = self.block_size
        return BlockStored(medium, holding.block_ids[start:end], holding.block_ids[start - 1] if start else None,
                           holding.token_ids[start * size:end * size], holding.scope)

    def _deliver(self, events: list[KVEvent]) -> None:
        if self._send(events):
            self._lost = False
        else:
            self.batches_dropped += 1
            self._lost = True
