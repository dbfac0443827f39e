"""Problem -> Bucket: log-scale rounding, head-dim padding, batch*heads clamping, log distance."""
import math

import pytest

from flashtune.problem import Bucket, Problem


def prob(nq=1024, nk=None, b=1, h=16, d=128, causal=True, group=1, dtype="float16", family="fwd"):
    return Problem(family, dtype, d, causal, group, b, h, nq, nk or nq)


@pytest.mark.parametrize("n,bucket", [(1, 1), (2, 2), (3, 4), (5, 4), (6, 8), (17, 16), (23, 32),
                                      (1000, 1024), (1024, 1024), (1448, 1024), (1449, 2048),
                                      (16384, 16384), (20000, 16384), (24000, 32768)])
def test_seqlen_rounds_to_nearest_power_of_two_on_log_scale(n, bucket):
    b = Bucket.of(prob(nq=n, nk=n, h=1))
    assert (b.seqlen_q, b.seqlen_k) == (bucket, bucket)
    # the boundary is the geometric midpoint: n sits no further than half an octave away
    assert abs(math.log2(n) - math.log2(bucket)) <= 0.5 + 1e-9


@pytest.mark.parametrize("d,padded", [(16, 16), (17, 32), (48, 64), (64, 64), (80, 128),
                                      (96, 128), (128, 128), (160, 256), (256, 256)])
def test_head_dim_pads_to_block_d(d, padded):
    assert Bucket.of(prob(d=d)).head_dim == padded


def test_batch_heads_bucketed_while_the_grid_is_small_and_clamped_once_it_saturates():
    assert Bucket.of(prob(nq=128, b=3, h=8)).batch_heads == 32      # 24 -> 32
    assert Bucket.of(prob(nq=128, b=1, h=5)).batch_heads == 4
    # past 2**18 query rows batch*heads no longer matters: one bucket
    big = {Bucket.of(prob(nq=16384, b=b, h=h)).batch_heads for b, h in [(1, 16), (1, 32), (4, 32)]}
    assert big == {16}
    assert Bucket.of(prob(nq=512, b=32, h=16)) == Bucket.of(prob(nq=512, b=64, h=16))


def test_standard_grid_buckets_are_distinct():
    # FA2 grid: B*N = 16k tokens, H=16 at D=128; each N is its own bucket
    grid = [Bucket.of(prob(nq=n, b=16384 // n, h=16, causal=c)) for n in
            (512, 1024, 2048, 4096, 8192, 16384) for c in (False, True)]
    assert len(set(grid)) == len(grid)


def test_bucket_fields_and_key_are_stable():
    b = Bucket.of(prob(nq=1000, nk=2500, b=2, h=8, d=96, group=4))
    assert b == Bucket("fwd", "float16", 128, True, True, 1024, 2048, 16)
    assert b.key == Bucket("fwd", "float16", 128, True, True, 1024, 2048, 16).key
    assert len(b.key) == 64


def test_log_distance():
    a = Bucket("fwd", "float16", 128, True, False, 1024, 1024, 16)
    assert a.log_distance(a) == 0
    assert a.log_distance(Bucket("fwd", "float16", 128, True, False, 4096, 1024, 16)) == 2
    assert a.log_distance(Bucket("fwd", "float16", 128, True, False, 2048, 2048, 8)) == 3
    assert a.log_distance(Bucket("fwd", "float16", 128, True, True, 1024, 1024, 16)) == 0.5
    for other in (Bucket("fwd", "bfloat16", 128, True, False, 1024, 1024, 16),
                  Bucket("fwd", "float16", 64, True, False, 1024, 1024, 16),
                  Bucket("fwd", "float16", 128, False, False, 1024, 1024, 16),
                  Bucket("bwd", "float16", 128, True, False, 1024, 1024, 16)):
        assert a.log_distance(other) == math.inf and not a.same_kernel_class(other)
