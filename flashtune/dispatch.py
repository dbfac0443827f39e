"""Problem -> Variant: the runtime dispatcher (forced config, then the built-in defaults)."""
from __future__ import annotations

import contextlib
import dataclasses
import threading

from . import env
from .codegen import Variant
from .defaults import default_variant
from .problem import Problem

_forced = threading.local()


@contextlib.contextmanager
def force(variant: Variant | str):
    """Run every call inside the block with `variant` (a Variant, its name or JSON): debugging."""
    v = Variant.parse(variant) if isinstance(variant, str) else variant
    prev = getattr(_forced, "variant", None)
    _forced.variant = v
    try:
        yield v
    finally:
        _forced.variant = prev


def _forced_variant() -> Variant | None:
    v = getattr(_forced, "variant", None)
    if v is None and env.forced_variant():
        v = Variant.parse(env.forced_variant())
    return v


def select(problem: Problem) -> Variant:
    forced = _forced_variant()
    if forced is not None and forced.family == problem.family:
        return forced
    return default_variant(problem.family, problem.head_dim, problem.dtype)


def fit_to_inputs(variant: Variant, descriptors_ok: bool) -> Variant:
    """A descriptor variant on inputs TMA cannot address runs as its pointer twin."""
    if variant.loads == "descriptor" and not descriptors_ok:
        return dataclasses.replace(variant, loads="pointer")
    return variant
