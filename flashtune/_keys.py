"""Stable keys for the frozen dataclasses (Problem, Bucket, Variant, Record)."""
from __future__ import annotations

import dataclasses
import hashlib
import json


def as_json(obj) -> str:
    """Sorted, compact JSON of a dataclass: the canonical text its key is hashed from."""
    return json.dumps(dataclasses.asdict(obj), sort_keys=True, separators=(",", ":"))


def stable_key(obj) -> str:
    """sha256 of the sorted JSON: identical across processes, machines and Python versions."""
    return hashlib.sha256(as_json(obj).encode()).hexdigest()
