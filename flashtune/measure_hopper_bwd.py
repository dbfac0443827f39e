"""How the search measures the hopper_bwd family: the bwd family's inputs, gate, reference and
compile-ahead (the JIT's warm-up on meta tensors: launch_hopper_bwd lets them through), launched
through launch_hopper_bwd."""
from __future__ import annotations

from . import launch_bwd, launch_hopper_bwd
from .masks import representative
from .measure_bwd import BwdOps


class HopperBwdOps(BwdOps):
    family = "hopper_bwd"
    launcher = launch_hopper_bwd
    also_launches = (launch_bwd,)  # dq="separate": the generic bwd's dQ plan

    def plan(self, variant, p, inputs):
        q, k, v = inputs[:3]
        return launch_hopper_bwd.HopperBwdPlan(q, k, v, p.causal, None, variant,
                                               representative(p, q.device.type))


OPS = HopperBwdOps()
