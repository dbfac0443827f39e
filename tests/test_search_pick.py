"""The final pick: fastest after interleaved re-timing, simpler configs only within noise."""
from flashtune.codegen import Variant
from flashtune.search import MAX_NOISE, pick, simplicity

SIMPLE = Variant.parse("fwd-m64-n64-w4-s2")
COMPLEX = Variant.parse("fwd-m128-n64-w8-s4-loads=descriptor")


def test_simpler_config_wins_within_noise():
    assert simplicity(SIMPLE) < simplicity(COMPLEX)
    win = pick([(COMPLEX, 1.000, 0.0), (SIMPLE, 1.005, 0.0)], noise=0.01)
    assert win[0] == SIMPLE


def test_a_real_slowdown_never_wins_however_noisy_the_retime():
    # spread 10% would make a 6% slower config "within noise": the band is capped
    win = pick([(COMPLEX, 1.000, 0.10), (SIMPLE, 1.06, 0.10)], noise=0.01)
    assert win[0] == COMPLEX
    win = pick([(COMPLEX, 1.000, 0.10), (SIMPLE, 1.0 + MAX_NOISE / 2, 0.10)], noise=0.01)
    assert win[0] == SIMPLE


def test_the_default_wins_every_tie_within_noise():
    # a simpler record 1.8% slower than the default is within noise of it, but tuning must
    # never ship something measured slower than what runs untuned
    win = pick([(COMPLEX, 1.000, 0.0), (SIMPLE, 1.018, 0.0)], noise=0.02, default=COMPLEX)
    assert win[0] == COMPLEX
    win = pick([(COMPLEX, 1.000, 0.0), (SIMPLE, 1.018, 0.0)], noise=0.02)
    assert win[0] == SIMPLE
    # the default out of the band loses to what beat it beyond noise
    win = pick([(COMPLEX, 1.05, 0.0), (SIMPLE, 1.000, 0.0)], noise=0.02, default=COMPLEX)
    assert win[0] == SIMPLE


def test_failed_retimes_are_skipped():
    assert pick([(COMPLEX, None, None), (SIMPLE, 2.0, 0.0)], noise=0.01)[0] == SIMPLE
    assert pick([(COMPLEX, None, None)], noise=0.01) is None


def test_head_dims_sharing_a_bucket_plan_the_same_measurement():
    # D=96 pads to the D=128 bucket: a search asked for 96 must measure (and overwrite) with
    # exactly the problem a search for 128 measures, never with D=96 inputs
    from flashtune import targets
    from flashtune.search_plan import plan
    h100 = targets.get("H100")
    a = plan(h100, ("fwd",), ("bfloat16",), (96,), (False,), (1024,))
    b = plan(h100, ("fwd",), ("bfloat16",), (128,), (False,), (1024,))
    assert a[0].bucket == b[0].bucket and a[0].problem == b[0].problem
    assert a[0].problem.head_dim == 128
