"""Every region of the KV arena, every host copy and every shared segment a scenario takes is given back: after
turns that share a policy, drafts, deep checks, evictions to the host tier (exact and int8) and restores, a
branch, a cancel and a failed turn, closing every session and dropping the segments leaves the arena, the host tier
and the device tier empty, with the garbage collector off (a reference cycle that held a region or a copy would
show here), and no cache was collected with its region unreleased."""

import gc

import pytest

from cache_store.device.segments import is_segment
from sessions import Session
from tests.support import kv_budget_mb, run_together, run_turn, running_engine
from tests.test_shared_prefix import POLICY, QUESTIONS


def close_everything(store, arena) -> dict[str, int]:
    """Forget every session, then drop the segments (in the engine thread); what is still held."""
    for key in [key for key in [*store.device, *store.host.keys()] if not is_segment(key)]:
        store.forget(key)
    for key in [key for key in [*store.device, *store.host.keys()] if is_segment(key)]:
        store.drop(key)
    return {"device_entries": len(list(store.device)), "host_entries": len(store.host),
            "host_bytes_held": store.host.used_bytes() - store.host.pool.free_bytes,
            "segments": store.segments.stats()["segments"], "arena_regions": len(arena._regions),
            "arena_units_taken": arena.allocator.units - arena.allocator.free_units(),
            "arena_leaked_regions": arena.stats()["arena_leaked_regions"]}


@pytest.mark.parametrize("kv_dtype", ["same", "int8"])
def test_every_region_copy_and_segment_comes_back_after_the_scenarios(tiny, kv_dtype):
    gc.collect()
    gc.disable()
    try:
        with running_engine(tiny, max_batch=4, shared_prompt_min_tokens=16, host_kv_dtype=kv_dtype,
                            device_cache_mb=kv_budget_mb(tiny, 600), verify_sample_rate=0.5) as engine:
            sessions = [Session(f"s{i}", system=POLICY) for i in range(6)]
            for round_index in range(2):  # six sessions on a budget for about four: evictions and restores
                run_together(engine, sessions[:4], [QUESTIONS[(i + round_index) % 8] for i in range(4)], [8] * 4)
                run_together(engine, sessions[4:], [QUESTIONS[round_index], QUESTIONS[3]], [8, 8])
            engine.offload_idle()
            again, _ = run_turn(engine, sessions[0], QUESTIONS[5], max_new_tokens=8)  # restored from the host
            engine.fork_session("s0", "branch", again.conversation_ids)
            run_turn(engine, Session("branch", system=POLICY), QUESTIONS[6], max_new_tokens=8)
            cancelled, _ = run_turn(engine, sessions[1], QUESTIONS[7], max_new_tokens=64,
                                    on_text=lambda turn, text: turn.cancel())
            engine.faults.arm("decode", "s2", False)
            failed, _ = run_turn(engine, sessions[2], QUESTIONS[2], max_new_tokens=8)
            held = engine.call(lambda store: close_everything(store, engine.arena)).result()
    finally:
        gc.enable()
    assert again.cache_source == "host" and cancelled.finish_reason == "cancelled" and failed.code == "internal"
    assert held == {"device_entries": 0, "host_entries": 0, "host_bytes_held": 0, "segments": 0,
                    "arena_regions": 0, "arena_units_taken": 0, "arena_leaked_regions": 0}
