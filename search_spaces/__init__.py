"""Search spaces: data files (one JSON per kernel family) and the reader for them."""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

_DIR = Path(__file__).parent


@lru_cache(maxsize=None)
def load_space(family: str) -> dict:
    path = _DIR / f"{family}.json"
    if not path.exists():
        raise KeyError(f"no search space for kernel family {family!r} ({path} missing)")
    return json.loads(path.read_text())


def describe_family(family: str) -> dict:
    """What `flashtune kernels list` prints: the family's choices and an example variant name."""
    from flashtune.codegen import TEMPLATES, Variant

    space = load_space(family)
    p = space["params"]
    example = Variant(family, block_m=p["block_m"][-2], block_n=p["block_n"][-2],
                      num_warps=p["num_warps"][1], num_stages=p["num_stages"][2],
                      **({"dq": p["dq"][0]} if "dq" in p else {}))
    return {"family": family, "template": TEMPLATES[family], "choices": p, "example": example.name}
