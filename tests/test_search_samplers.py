"""Search efficiency: samplers replayed over a recorded (here: synthetic) exhaustive sweep."""
import pytest

from flashtune import targets
from flashtune.sampler_eval import compare, synthesize, table, trials_to_best
from flashtune.search_plan import standard_problem


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    path = tmp_path_factory.mktemp("sweep") / "synthetic.jsonl"
    p = standard_problem("fwd", "bfloat16", 128, True, 4096)
    synthesize(path, targets.get("H100"), [p])
    return str(path), p


def test_tpe_gets_within_2_percent_in_a_fifth_of_the_exhaustive_count(recording):
    path, p = recording
    rows = compare(path, [p], samplers=("tpe", "random"), seeds=range(3))
    tpe = next(r for r in rows if r["sampler"] == "tpe")
    assert tpe["exhaustive"] > 100
    assert tpe["median_frac"] <= 0.2, table(rows)
    assert "| tpe |" in table(rows)


def test_trace_is_reproducible_and_bounded(recording):
    path, p = recording
    a = trials_to_best(path, p, "random", seed=3)
    b = trials_to_best(path, p, "random", seed=3)
    assert a == b and 1 <= a.trials <= a.exhaustive
    grid = trials_to_best(path, p, "grid", seed=1)
    assert grid.trials <= grid.exhaustive


@pytest.mark.parametrize("family", ["fwd", "bwd", "splitkv"])
def test_space_contains_exactly_its_variants(family):
    """Space.contains answers what membership in variants() would, without listing them."""
    import dataclasses

    from flashtune import targets
    from flashtune.search_plan import plan
    from flashtune.search_space import Space
    t = targets.get("H100")
    for pb in plan(t, (family,), ("bfloat16",), (64, 128), (False, True), seqlens=(1024,)):
        space: Space = pb.space
        listed = space.variants()
        sample = listed[:: max(1, len(listed) // 300)]
        assert all(space.contains(v) for v in sample)
        known = set(listed)
        off = 0
        for v in sample[:40]:  # one field off its values (or its default): not in the space
            for f, bad in (("num_warps", 32), ("num_stages", 7), ("block_n", 1024),
                           ("block_m", 512)):
                try:
                    w = dataclasses.replace(v, **{f: bad})
                except ValueError:  # not even a Variant
                    continue
                assert not space.contains(w) and w not in known
                off += 1
        assert off


def test_a_sampler_that_only_repeats_itself_still_fills_the_budget(recording):
    """search_bucket draws the next proposal from the feasible variants nobody measured once
    the sampler's proposals keep coming back known: every variant measured is distinct, the
    budget is met in few asks; with the draw off the bucket stops at what the sampler found."""
    import optuna

    from flashtune.pipeline import Pipeline
    from flashtune.replay import ReplayBackend
    from flashtune.search import search_bucket
    from flashtune.search_progress import NoProgress
    from flashtune.search_space import Space
    from flashtune.search_study import BucketStudy

    path, p = recording
    space = Space.build(p.family, targets.get("H100"), p)
    first = space.optuna_params(space.feasible[0])

    class Stuck(optuna.samplers.BaseSampler):  # proposes the same point every time
        def infer_relative_search_space(self, study, trial):
            return {}

        def sample_relative(self, study, trial, search_space):
            return {}

        def sample_independent(self, study, trial, name, distribution):
            return first.get(name, distribution.to_external_repr(0)
                             if not hasattr(distribution, "choices") else distribution.choices[0])

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for draw_after, want in ((6, 12), (None, 1)):
        bs = BucketStudy(optuna.create_study(direction="maximize", sampler=Stuck()), space, p)
        search_bucket(bs, Pipeline(ReplayBackend(path), inline=True), 12, None, NoProgress(),
                      draw_after=draw_after)
        measured = [t for t in bs.study.get_trials() if (t.user_attrs.get("result") or {})
                    .get("measured")]
        names = [t.user_attrs["variant"] for t in measured]
        assert len(names) == len(set(names)) == want, (draw_after, names)
        if draw_after:
            assert len(bs.study.trials) <= 12 * (draw_after + 1) + 1
