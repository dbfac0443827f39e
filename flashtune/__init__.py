"""flashtune: autotuned FlashAttention-2 kernels generated in Triton."""
from __future__ import annotations

import importlib

from .reference import reference  # binds the function over its module's name; imports no torch

__version__ = "0.1.0"

# The public names import their modules (and torch, triton) on first use: `flashtune search`
# starts its workers' server before those imports, so that both run at once (isolation.py).
_HOMES = {"attention": "api", "attention_varlen": "api", "BlockMask": "block_mask",
          "explain": "dispatch", "force": "dispatch", "attention_with_kvcache": "kvcache",
          "Bucket": "problem", "Problem": "problem"}
__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "reference", "force",
           "explain", "Problem", "Bucket", "BlockMask", "__version__"]


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'flashtune' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_HOMES))
