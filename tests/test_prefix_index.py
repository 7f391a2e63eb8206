"""The index that finds which sessions' conversations share the longest prefix with a request."""

from sessions.prefix_index import BLOCK, MAX_CANDIDATES, PrefixIndex, block_hashes

SYSTEM = list(range(1000, 1000 + 3 * BLOCK))  # a system prompt three blocks long


def test_deepest_shared_prefix_first_and_only_full_blocks():
    index = PrefixIndex()
    index.add("key-a", "short", SYSTEM + [1] * BLOCK)
    index.add("key-a", "long", SYSTEM + [1] * BLOCK + [2] * BLOCK)
    index.add("key-a", "other", SYSTEM + [3] * BLOCK)
    assert index.candidates("key-a", SYSTEM + [1] * BLOCK + [2] * BLOCK + [4] * 5)[0] == "long"
    assert set(index.candidates("key-a", SYSTEM + [1] * BLOCK)[:2]) == {"short", "long"}
    assert index.candidates("key-a", SYSTEM + [3] * BLOCK)[0] == "other"
    assert index.candidates("key-a", [7] * (BLOCK - 1)) == []  # less than a block: nothing to match
    assert len(block_hashes("key-a", list(range(BLOCK * 2 + 5)))) == 2


def test_another_owner_never_matches():
    index = PrefixIndex()
    index.add("key-a", "mine", SYSTEM + [1] * BLOCK)
    assert index.candidates("key-b", SYSTEM + [1] * BLOCK) == []
    assert index.candidates(None, SYSTEM + [1] * BLOCK) == []
    assert index.candidates("key-a", SYSTEM + [1] * BLOCK) == ["mine"]


def test_reindex_and_remove_leave_no_trace():
    index = PrefixIndex()
    index.add("key-a", "s", SYSTEM)
    index.add("key-a", "s", SYSTEM + [5] * BLOCK)  # its next turn: re-indexed, not added twice
    assert len(index) == 1 and index.candidates("key-a", SYSTEM + [5] * BLOCK) == ["s"]
    index.remove("s")
    assert len(index) == 0 and index.candidates("key-a", SYSTEM) == [] and not index._sessions


def test_a_system_prompt_shared_by_many_sessions_yields_a_bounded_list():
    index = PrefixIndex()
    for number in range(2000):
        index.add("key-a", f"s{number}", SYSTEM + [number % 50_000 + 1] * BLOCK)
    found = index.candidates("key-a", SYSTEM + [7] * BLOCK)
    assert found[0] == "s6" and len(found) == MAX_CANDIDATES


def test_the_index_is_bounded_in_sessions_and_time():
    """At most `max_sessions`, the least recently indexed forgotten first; and nothing older than the TTL."""
    now = [0.0]
    index = PrefixIndex(max_sessions=3, ttl_s=100, clock=lambda: now[0])
    for number in range(4):
        now[0] += 1
        index.add("key-a", f"s{number}", SYSTEM + [number + 1] * BLOCK)
    assert len(index) == 3 and index.forgotten == 1
    assert index.candidates("key-a", SYSTEM + [1] * BLOCK)[0] != "s0", "the least recently indexed went first"
    now[0] = 10.0
    index.add("key-a", "s1", SYSTEM + [2] * BLOCK + [9] * BLOCK)  # re-indexed: now the most recent
    now[0] = 105.0
    assert index.candidates("key-a", SYSTEM + [2] * BLOCK)[0] == "s1"
    assert set(index._hashes) == {"s1"} and index.forgotten == 3, "the others were indexed over 100 s ago"
    now[0] = 111.0
    assert index.candidates("key-a", SYSTEM) == [] and len(index) == 0 and not index._sessions
