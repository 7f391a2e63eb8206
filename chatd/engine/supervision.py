"""Which failures the engine can go on from, and what a caller is told once it cannot."""

from __future__ import annotations

import torch

from cache_store import InjectedFatalFault

_CUDA_FAILURES = ("CUDA error", "device-side assert", "illegal memory access", "CUBLAS_STATUS", "cuDNN error")


def is_fatal(error: BaseException) -> bool:
    """Whether the engine cannot go on after `error`: anything but an ordinary exception, an error of
    the accelerator (its context is poisoned; out of memory is not), or an injected fatal fault."""
    if not isinstance(error, Exception) or isinstance(error, InjectedFatalFault):
        return True
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return False
    return isinstance(error, torch.AcceleratorError) or (
        isinstance(error, RuntimeError) and any(text in str(error) for text in _CUDA_FAILURES))


class EngineUnavailable(RuntimeError):
    """The engine has stopped serving (see `Engine.failure`)."""
