"""On-disk kernel source cache, keyed by the content hash of the rendered source, and loading."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
from pathlib import Path
from types import ModuleType

from flashtune import env

from .render import render
from .variant import Variant

_lock = threading.Lock()
# keyed by (Variant, interpreting): a frozen dataclass hashes its fields, so the hot path does
# not pay for the sha256 of variant.key; TRITON_INTERPRET is read per call (Triton decides at
# definition time whether a kernel is interpreted), so setting it after the first call works
_modules: dict[tuple, ModuleType] = {}


def kernel_dir() -> Path:
    return env.cache_dir() / "kernels"


def source_path(variant: Variant, interpret: bool = False) -> Path:
    """Write the variant's source under its content hash (once; atomic) and return the path."""
    src = render(variant, interpret)
    digest = hashlib.sha256(src.encode()).hexdigest()[:24]
    path = kernel_dir() / f"{variant.family}_{digest}.py"
    if not path.exists() or path.read_text() != src:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(src)
        os.replace(tmp, path)  # atomic: concurrent writers of the same bytes are harmless
    return path


def load(variant: Variant) -> ModuleType:
    """Import the generated module of `variant` (memoized per variant and interpreter state)."""
    key = (variant, env.interpreting())
    mod = _modules.get(key)
    if mod is not None:
        return mod
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            path = source_path(variant, key[1])
            name = f"flashtune_generated.{path.stem}"
            spec = importlib.util.spec_from_file_location(name, path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod  # triton reads the source back through inspect/linecache
            spec.loader.exec_module(mod)
            _modules[key] = mod
    return mod
