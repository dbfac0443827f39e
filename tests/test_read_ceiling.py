"""flashtune/bench/read_ceiling.py: the plain read a decode cell's read ceiling is timed with
reads every element of K and V once (Triton's interpreter on the CPU)."""
import pytest
import torch

from flashtune.bench.read_ceiling import BLOCK, reader, split


@pytest.mark.parametrize("programs", [1, 3, 64])
def test_every_element_is_read_once(programs):
    n = 3 * BLOCK + 517  # not a whole number of blocks
    x = torch.randn(n, dtype=torch.float16)
    y = torch.randn(n, dtype=torch.float16)
    out = reader(x, y, programs)()
    progs, per_prog = split(n, programs)
    assert out.shape == (progs,) and progs <= programs and per_prog % BLOCK == 0
    want = [(x[i:i + per_prog].double() + y[i:i + per_prog].double()).sum().item()
            for i in range(0, n, per_prog)]
    assert out.double().tolist() == pytest.approx(want, rel=1e-5, abs=1e-3)


def test_mismatched_or_strided_inputs_are_refused():
    x = torch.randn(4, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="contiguous"):
        reader(x, torch.randn(4, 9, dtype=torch.float16), 2)
    with pytest.raises(ValueError, match="contiguous"):
        reader(x.t(), x, 2)


def test_the_fastest_grid_is_the_ceiling():
    from flashtune.bench.read_ceiling import PER_SM, fastest
    times = {2 * p: 1.0 + abs(p - 4) for p in PER_SM}  # 4 programs per SM reads fastest
    assert fastest(2, times.__getitem__) == (1.0, 8)
