"""How the search measures the hopper_fwd family: the fwd family's inputs, gate, reference and
compile-ahead (the JIT's warm-up on meta tensors: launch_hopper lets them through), launched
through launch_hopper."""
from __future__ import annotations

from . import launch_hopper
from .masks import representative
from .measure_fwd import FwdOps


class HopperFwdOps(FwdOps):
    family = "hopper_fwd"
    launcher = launch_hopper

    def plan(self, variant, p, inputs):
        q, k, v = inputs
        return launch_hopper.HopperFwdPlan(q, k, v, p.causal, None, variant,
                                           representative(p, q.device.type))


OPS = HopperFwdOps()
