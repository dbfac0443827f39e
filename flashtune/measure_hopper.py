"""How the search measures the hopper_fwd family: the fwd family's inputs, gate and reference
(the same problem, masks included, computed by another kernel), launched through launch_hopper."""
from __future__ import annotations

from . import launch_hopper
from .masks import representative
from .measure_fwd import FwdOps
from .problem import Problem


class HopperFwdOps(FwdOps):
    family = "hopper_fwd"

    def compile_ahead(self, variant, p: Problem) -> int:
        """Compile for sm_90 without launching (codegen.aot, as `kernels check`); returns the
        kernel's shared memory. The timing worker's JIT compiles its own binary again (Gluon
        kernels take TMA descriptors, which the warmup path of the generic families cannot
        stand in for on meta tensors)."""
        from .families.hopper_fwd import compile_check
        r = compile_check(variant, p.head_dim, p.dtype, p.causal, p.group > 1, 90, False)
        return int(r["fwd"]["smem"]) if r else 0

    def run(self, variant, p: Problem, inputs):
        q, k, v = inputs  # a masked problem: its representative window / softcap / block mask
        return launch_hopper.forward(q, k, v, p.causal, None, variant,
                                     representative(p, q.device.type))[0]


OPS = HopperFwdOps()
