"""Search spaces: data files (one JSON per kernel family) and the reader for them.

Format 1 (see docs/search.md): {"format": 1, "family": ..., "params": {field: [values]},
"when": {field: expr}, "target_features": {field: {value: feature}}, "constraints": [expr]}.
Every param is a `Variant` field. flashtune/search_space.py turns a file into the space of one
target and problem; flashtune/feasibility.py prunes it.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

_DIR = Path(__file__).parent
FORMAT = 1
_KEYS = {"format", "family", "doc", "params", "when", "target_features", "constraints"}


def families() -> list[str]:
    """The families that have a search space file."""
    return sorted(p.stem for p in _DIR.glob("*.json"))


@lru_cache(maxsize=None)
def load_space(family: str) -> dict:
    path = _DIR / f"{family}.json"
    if not path.exists():
        raise KeyError(f"no search space for kernel family {family!r} ({path} missing)")
    space = json.loads(path.read_text())
    _check(space, path)
    return space


def _check(space: dict, path: Path) -> None:
    unknown = set(space) - _KEYS
    if unknown:
        raise ValueError(f"{path.name}: unknown key(s) {sorted(unknown)}; known: {sorted(_KEYS)}")
    if space.get("format", FORMAT) != FORMAT:
        raise ValueError(f"{path.name}: format {space['format']} (this flashtune reads {FORMAT})")
    params = space.get("params")
    if not isinstance(params, dict) or not params:
        raise ValueError(f"{path.name}: 'params' must map Variant fields to lists of values")
    for name, values in params.items():
        if not isinstance(values, list) or not values:
            raise ValueError(f"{path.name}: params.{name} must be a non-empty list")
    for key in ("when", "target_features"):
        extra = set(space.get(key, {})) - set(params)
        if extra:
            raise ValueError(f"{path.name}: {key} names {sorted(extra)}, which are not params")


def describe_family(family: str) -> dict:
    """What `flashtune kernels list` prints: the family's choices and an example variant name."""
    from flashtune.codegen import Variant, template_name

    space = load_space(family)
    p = space["params"]
    # the family's own fields that have a rule (dq, loader_regs, ...) take their first value
    own = {f: p[f][0] for f in p if f in ("dq", "loader_regs")}
    example = Variant(family, block_m=p["block_m"][-2], block_n=p["block_n"][-2],
                      num_warps=p["num_warps"][1], num_stages=p["num_stages"][2], **own)
    return {"family": family, "template": template_name(family), "choices": p, "example": example.name}
