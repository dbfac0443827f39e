"""Environment knobs, declared once. Read them through these functions, never os.environ directly."""
from __future__ import annotations

import functools
import os
from pathlib import Path

KNOBS = {
    "FLASHTUNE_DB": "SQLAlchemy URL of the user's tuned DB (default: SQLite in the cache folder)",
    "FLASHTUNE_CACHE_DIR": "folder for generated kernel sources and the default DB (default: ~/.cache/flashtune)",
    "FLASHTUNE_FORCE_VARIANT": "variant name or JSON that every call uses, for debugging",
    "FLASHTUNE_GPU": "GPU name to assume instead of detecting one (tables, search)",
    "TRITON_INTERPRET": "1 runs the kernels on the CPU in Triton's interpreter (tests; slow)",
}


def cache_dir() -> Path:
    base = os.environ.get("FLASHTUNE_CACHE_DIR")
    if base:
        return Path(base).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "flashtune"


def db_url() -> str | None:
    return os.environ.get("FLASHTUNE_DB") or None


def forced_variant() -> str | None:
    return os.environ.get("FLASHTUNE_FORCE_VARIANT") or None


def gpu_override() -> str | None:
    return os.environ.get("FLASHTUNE_GPU") or None


def timeline() -> bool:
    """FLASHTUNE_TIMELINE=1: a search prints its milestones (timeline.py)."""
    return os.environ.get("FLASHTUNE_TIMELINE", "") not in ("", "0")


def slow_launch() -> bool:
    """FLASHTUNE_SLOW_LAUNCH=1: every kernel launch through Triton's JITFunction (launcher.py)."""
    return os.environ.get("FLASHTUNE_SLOW_LAUNCH", "") not in ("", "0")


def no_pdl() -> bool:
    """FLASHTUNE_PDL=0: no kernel is launched as a programmatic dependent (launch.pdl_ok)."""
    return os.environ.get("FLASHTUNE_PDL", "") == "0"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def triton_interprets() -> bool:
    """Whether Triton itself was imported in interpreter mode. Triton decides when a @triton.jit
    function is defined, its own library included (tl.cdiv, ...), so TRITON_INTERPRET=1 set after
    `import triton` cannot take effect in this process."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(tl.cdiv, InterpretedFunction)
