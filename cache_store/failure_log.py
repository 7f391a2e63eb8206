"""Failures logged with their traceback as text. A record that a log handler keeps (a buffer, a test's capture, an
error reporter) then holds no frame of the failed call, so no frame's locals keep a cache, its arena region or its
host copy alive: they go back the moment their owner lets go (tests/test_ownership.py)."""

from __future__ import annotations

import logging
import traceback


def log_failure(log: logging.Logger, error: BaseException, message: str, *args: object,
                level: int = logging.ERROR) -> None:
    """Log `message % args` at `level`, followed by `error`'s traceback as text."""
    log.log(level, message + "\n%s", *args, "".join(traceback.format_exception(error)).rstrip())
