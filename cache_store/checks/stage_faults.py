"""Fault injection at the engine's stages, for tests and chaos drills: make one stage fail for one
session, so that the engine's supervision can be seen to contain it."""

from __future__ import annotations

import threading
from typing import Literal

Stage = Literal["render", "lookup", "prefill", "grammar", "sampling", "decode", "write-back", "offload", "restore"]
STAGES: tuple[str, ...] = Stage.__args__


class InjectedFault(RuntimeError):
    """A failure injected at an engine stage."""


class InjectedFatalFault(InjectedFault):
    """An injected failure after which the engine cannot go on (as after a CUDA error)."""


class FaultPoints:
    """Faults armed at engine stages. One armed for a session fires every time its stage runs for
    that session, until `disarm` (the engine disarms a session when it fails its turn); one armed for
    any session fires once. Armed from the event loop, checked in the engine thread."""

    def __init__(self) -> None:
        self._armed: dict[tuple[str, str | None], bool] = {}  # (stage, session or None) -> fatal
        self._lock = threading.Lock()

    def arm(self, stage: Stage, session_id: str | None = None, fatal: bool = False) -> None:
        if stage not in STAGES:
            raise ValueError(f"unknown engine stage {stage!r}")
        with self._lock:
            self._armed[stage, session_id] = fatal

    def disarm(self, session_id: str) -> None:
        with self._lock:
            for key in [key for key in self._armed if key[1] == session_id]:
                del self._armed[key]

    def check(self, stage: Stage, session_id: str | None) -> None:
        """Raise the fault armed at `stage` for this session (or for any), if there is one."""
        if not self._armed:
            return
        with self._lock:
            if (stage, session_id) in self._armed:
                fatal = self._armed[stage, session_id]
            elif (stage, None) in self._armed:
                fatal = self._armed.pop((stage, None))
            else:
                return
        kind = InjectedFatalFault if fatal else InjectedFault
        raise kind(f"fault injected at the {stage} stage" + (f" of session {session_id}" if session_id else ""))
