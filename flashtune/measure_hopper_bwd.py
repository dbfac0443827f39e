"""How the search measures the hopper_bwd family: the bwd family's inputs, gate and reference
(the same problem, masks included, computed by another kernel), launched through
launch_hopper_bwd."""
from __future__ import annotations

from . import launch_hopper_bwd
from .masks import representative
from .measure_bwd import BwdOps
from .problem import Problem


class HopperBwdOps(BwdOps):
    family = "hopper_bwd"

    def compile_ahead(self, variant, p: Problem) -> int:
        """Compile for sm_90 without launching (codegen.aot, as `kernels check`); returns the
        kernel's shared memory (the timing worker's JIT compiles its own binary: Gluon kernels
        take TMA descriptors, which meta tensors cannot stand in for)."""
        from .families.hopper_bwd import compile_check
        r = compile_check(variant, p.head_dim, p.dtype, p.causal, p.group > 1, 90, False)
        return int(r["bwd"]["smem"]) if r else 0

    def run(self, variant, p: Problem, inputs):
        q, k, v, o, lse, do = inputs  # a masked problem: its representative window / softcap
        return launch_hopper_bwd.backward(do, q, k, v, o, lse, p.causal, None, variant,
                                          representative(p, q.device.type))


OPS = HopperBwdOps()
