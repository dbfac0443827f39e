"""`Record`: one row of the tuned DB -- bucket -> winning variant, timings, error, provenance."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from flashtune._keys import as_dict, stable_key
from flashtune.codegen import Variant
from flashtune.problem import Bucket

SOURCES = ("search", "import", "default")
UNITS = ("TFLOP/s", "GB/s")


@dataclass(frozen=True)
class Provenance:
    gpu_name: str             # "NVIDIA H100 80GB HBM3"
    compute_capability: str   # "9.0"
    sm_count: int
    driver: str
    cuda: str
    torch: str
    triton: str
    flashtune: str
    template_hash: str        # codegen.kernel_hash(variant) of the code that was timed (the
    #                           field's name predates per-variant hashes; the DB column keeps it)
    date: str                 # ISO 8601, UTC
    source: str               # how it was found: "search" | "import" | "default"


@dataclass(frozen=True)
class Record:
    gpu: str                  # targets.slug_of(gpu_name): "nvidia-h100-80gb-hbm3"
    bucket: Bucket            # bucket.family is the kernel family
    variant: Variant
    median_ms: float
    throughput: float         # TFLOP/s (FlashAttention convention); GB/s for decode
    unit: str                 # "TFLOP/s" | "GB/s"
    max_err: float            # max abs error vs the float64 reference on the gate's inputs
    provenance: Provenance
    runner_ups: tuple = field(default=())  # ((variant name, median ms), ...) best first

    @property
    def natural_key(self) -> tuple:
        return (self.gpu, self.bucket.family, self.bucket.key)

    @property
    def key(self) -> str:
        return stable_key(self)

    # -- plain-data form: the shipped tables and the DB rows are written from this ------------
    def to_dict(self) -> dict:
        """JSON-ready dict. Keys are sorted when dumped; runner-ups become [name, ms] pairs."""
        return {
            "gpu": self.gpu,
            "bucket": as_dict(self.bucket),
            "variant": self.variant.to_dict(),
            "median_ms": self.median_ms,
            "throughput": self.throughput,
            "unit": self.unit,
            "max_err": self.max_err,
            "runner_ups": [[str(n), float(ms)] for n, ms in self.runner_ups],
            "provenance": dataclasses.asdict(self.provenance),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Record":
        """Inverse of to_dict. Raises ValueError naming what is wrong (unknown fields, a variant
        the generator does not know, a bucket of another family)."""
        if not isinstance(d, dict):
            raise ValueError(f"a record must be a JSON object, got {type(d).__name__}")
        missing = _REQUIRED - set(d)
        unknown = set(d) - _REQUIRED
        if missing or unknown:
            raise ValueError(f"record fields: missing {sorted(missing)}, unknown {sorted(unknown)}")
        try:
            variant = Variant.from_dict(d["variant"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"variant {d['variant']!r} is not one the generator knows: {e}") from None
        try:
            bucket = Bucket(**d["bucket"])
            prov = Provenance(**d["provenance"])
        except TypeError as e:
            raise ValueError(f"bad bucket or provenance: {e}") from None
        rec = cls(gpu=d["gpu"], bucket=bucket, variant=variant, median_ms=float(d["median_ms"]),
                  throughput=float(d["throughput"]), unit=d["unit"], max_err=float(d["max_err"]),
                  provenance=prov,
                  runner_ups=tuple((str(n), float(ms)) for n, ms in d["runner_ups"]))
        rec.check()
        return rec

    def ms_of(self, name: str) -> float | None:
        """The median this record's run measured for variant `name`: its own or a runner-up's
        (a search re-times its top few interleaved for the final pick); None if that run did
        not time it."""
        if name == self.variant.name:
            return self.median_ms
        return next((ms for n, ms in self.runner_ups if n == name), None)

    def check(self) -> "Record":
        """Raise ValueError if the record cannot be stored or served; return it otherwise."""
        if not self.gpu or not isinstance(self.gpu, str):
            raise ValueError(f"record.gpu must be a GPU slug, got {self.gpu!r}")
        if self.variant.family != self.bucket.family:
            raise ValueError(f"variant {self.variant.name} is of family {self.variant.family!r} "
                             f"but the bucket is {self.bucket.family!r}")
        if self.provenance.source not in SOURCES:
            raise ValueError(f"provenance.source must be one of {SOURCES}, "
                             f"got {self.provenance.source!r}")
        if self.unit not in UNITS:
            raise ValueError(f"record.unit must be one of {UNITS}, got {self.unit!r}")
        return self


_REQUIRED = frozenset({"gpu", "bucket", "variant", "median_ms", "throughput", "unit", "max_err",
                       "runner_ups", "provenance"})


def keeps(old: Record, new: Record) -> tuple[bool, str]:
    """Whether a merge (`db import --keep-faster`) leaves `old` in place of `new`, and on what
    evidence. Where new's run also timed old's variant (a re-search measures the table's record
    first), that run's two medians decide; else the records' own medians, each from its own
    run. A GPU's clock and temperature move the same kernel several percent between sessions:
    the cross-run rule kept an H100 record (D=64 causal 1k, 311.0 TFLOP/s in its session) over
    a re-search's pick that had timed it 3% slower in the same run (session 30)."""
    same = new.ms_of(old.variant.name) if old.variant != new.variant else None
    if same is not None:
        return same <= new.median_ms, f"same run: {same:.4g} ms against {new.median_ms:.4g} ms"
    return old.throughput >= new.throughput, "each record's own run"
