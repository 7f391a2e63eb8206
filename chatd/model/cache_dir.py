"""Where chatd keeps what it makes of bundled models (a module of its own: the settings name it without loading
torch)."""

from pathlib import Path


def default_cache_dir() -> Path:
    """Where converted checkpoints of bundled models are kept between runs."""
    return Path.home() / ".cache" / "chatd"
