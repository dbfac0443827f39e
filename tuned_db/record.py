"""`Record`: one row of the tuned DB -- bucket -> winning variant, timings, error, provenance."""
from __future__ import annotations

from dataclasses import dataclass, field

from flashtune._keys import stable_key
from flashtune.codegen import Variant
from flashtune.problem import Bucket

SOURCES = ("search", "import", "default")


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
    template_hash: str        # codegen.template_hash(family) when measured
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
