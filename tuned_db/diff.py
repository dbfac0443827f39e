"""What changed between two sets of tuned records, and by how much (`flashtune db diff`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flashtune._keys import as_dict

from .record import Record


@dataclass(frozen=True)
class Change:
    kind: str                  # "added" | "removed" | "changed" | "same"
    gpu: str
    bucket: object             # Bucket
    old: Record | None
    new: Record | None

    @property
    def time_ratio(self) -> float | None:
        """new median / old median (0.8: 20% faster), None unless both sides exist."""
        if self.old is None or self.new is None or not self.old.median_ms:
            return None
        return self.new.median_ms / self.old.median_ms

    def what(self) -> list[str]:
        """The fields that differ, in words."""
        if self.old is None or self.new is None:
            return []
        o, n, out = self.old, self.new, []
        if o.variant != n.variant:
            out.append(f"variant {o.variant.name} -> {n.variant.name}")
        if o.median_ms != n.median_ms:
            out.append(f"median {o.median_ms:.4g} -> {n.median_ms:.4g} ms "
                       f"({(self.time_ratio - 1) * 100:+.1f}%)")
        if o.throughput != n.throughput:
            pct = (n.throughput / o.throughput - 1) * 100 if o.throughput else float("inf")
            out.append(f"throughput {o.throughput:.4g} -> {n.throughput:.4g} {n.unit} ({pct:+.1f}%)")
        if o.max_err != n.max_err:
            out.append(f"max_err {o.max_err:.3g} -> {n.max_err:.3g}")
        if o.runner_ups != n.runner_ups:
            out.append("runner-ups changed")
        if o.provenance != n.provenance:
            fields = [f.name for f in dataclasses.fields(o.provenance)
                      if getattr(o.provenance, f.name) != getattr(n.provenance, f.name)]
            out.append(f"provenance: {', '.join(fields)}")
        return out

    def to_dict(self) -> dict:
        return {"kind": self.kind, "gpu": self.gpu, "bucket": as_dict(self.bucket),
                "old": None if self.old is None else self.old.to_dict(),
                "new": None if self.new is None else self.new.to_dict(),
                "time_ratio": self.time_ratio, "what": self.what()}


def diff(old, new, *, include_same: bool = False) -> list[Change]:
    """Changes from `old` to `new` (iterables of Record), matched on the natural key, in bucket
    order."""
    from .io import bucket_order
    a = {r.natural_key: r for r in old}
    b = {r.natural_key: r for r in new}
    out = []
    for key in set(a) | set(b):
        o, n = a.get(key), b.get(key)
        kind = ("added" if o is None else "removed" if n is None
                else "same" if o == n else "changed")
        if kind != "same" or include_same:
            r = n or o
            out.append(Change(kind, r.gpu, r.bucket, o, n))
    return sorted(out, key=lambda c: bucket_order(c.new or c.old))
