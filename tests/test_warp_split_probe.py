"""bench/warp_split_probe.py's prototype partial kernel (warps each keep their own softmax state,
merged once a program) against the float64 reference in the interpreter, merged by the shipped
combine: ragged split ends, splits without keys, 2 and 4 warps, the warps' states merged in
the program or left to the combine as splits of their own."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import warp_split_probe as ws  # noqa: E402


@pytest.mark.parametrize("case", ws.CPU_CASES,
                         ids=lambda c: "G{}-N{}-W{}-KB{}-sp{}-perwarp{}".format(*c))
def test_prototype_matches_float64(case):
    torch.manual_seed(1)
    err, lse_err = ws.check_case(*case)
    assert err < 2e-3 and lse_err < 2e-3, (err, lse_err)
