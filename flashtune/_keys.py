"""Stable keys for the frozen dataclasses (Problem, Bucket, Variant, Record)."""
from __future__ import annotations

import dataclasses
import hashlib
import json


# a field declared with this metadata is left out of the dict, JSON and key at its default: a
# field added later (the masks of Problem and Bucket) changes no existing key or shipped table
OMIT_DEFAULT = {"omit_default": True}


def as_dict(obj) -> dict:
    """dataclasses.asdict, without the OMIT_DEFAULT fields that hold their default."""
    d = dataclasses.asdict(obj)
    for f in dataclasses.fields(obj):
        if f.metadata.get("omit_default") and d.get(f.name) == f.default:
            del d[f.name]
    return d


def as_json(obj) -> str:
    """Sorted, compact JSON of a dataclass: the canonical text its key is hashed from."""
    return json.dumps(as_dict(obj), sort_keys=True, separators=(",", ":"))


def stable_key(obj) -> str:
    """sha256 of the sorted JSON: identical across processes, machines and Python versions."""
    return hashlib.sha256(as_json(obj).encode()).hexdigest()
