"""`flashtune search`: --dry-run on any machine, clear --gpu errors, argument checks."""
import json

from click.testing import CliRunner

from flashtune.cli import main


def _run(*args):
    return CliRunner().invoke(main, ["search", *args])


def test_dry_run_a100_shows_buckets_sizes_and_no_tma():
    r = _run("--dry-run", "--gpu", "A100", "--head-dim", "64,128", "--seqlen", "1024",
             "--seqlen", "4096")
    assert r.exit_code == 0, r.output
    assert "dry run: A100" in r.output and "features: none" in r.output
    for label in ("fwd-bf16-d64-full-q1024", "fwd-bf16-d128-causal-q4096"):
        assert label in r.output
    assert "loads=descriptor (needs tma)" in r.output
    assert "feasible" in r.output and "constr." in r.output


def test_dry_run_spaces_differ_between_a100_and_h100():
    def sizes(gpu):
        r = _run("--dry-run", "--gpu", gpu, "--family", "fwd", "--head-dim", "128", "--seqlen",
                 "4096", "--causal", "true", "--format", "json")
        assert r.exit_code == 0, r.output
        (b,) = json.loads(r.output)["buckets"]
        return b
    a, h = sizes("A100"), sizes("H100")
    assert "loads" not in a["params"] and h["params"]["loads"] == ["pointer", "descriptor"]
    assert a["sizes"]["feasible"] < h["sizes"]["feasible"]
    assert a["sizes"]["file"] == h["sizes"]["file"] > a["sizes"]["target"]
    assert a["study"] != h["study"]


def test_gpu_a100_without_that_gpu_is_a_clear_error():
    r = _run("--gpu", "A100", "--seqlen", "1024")
    assert r.exit_code != 0
    assert "--gpu" in r.output and "no CUDA GPU found" in r.output


def test_gpu_must_match_the_recording(tmp_path):
    from flashtune import targets
    from flashtune.sampler_eval import synthesize
    from flashtune.search_plan import standard_problem
    rec = tmp_path / "h100.jsonl"
    synthesize(rec, targets.get("H100"), [standard_problem("fwd", "bfloat16", 64, False, 512)])
    r = _run("--gpu", "A100", "--replay", str(rec))
    assert r.exit_code != 0 and "does not match" in r.output and "H100" in r.output


def test_bad_arguments_name_the_option():
    r = _run("--dry-run", "--gpu", "H100", "--head-dim", "sixty-four")
    assert r.exit_code == 2 and "--head-dim" in r.output
    r = _run("--dry-run", "--gpu", "H100", "--family", "decode")
    assert r.exit_code == 2 and "--family" in r.output and "fwd" in r.output
    r = _run("--dry-run", "--gpu", "B300")
    assert r.exit_code == 2 and "--gpu" in r.output and "H100" in r.output
    r = _run("--dry-run", "--gpu", "H100", "--time-budget", "soon")
    assert r.exit_code == 2 and "--time-budget" in r.output


def test_gpu_auto_without_a_gpu_suggests_dry_run(monkeypatch):
    from flashtune import targets
    monkeypatch.setattr(targets, "detect", lambda *a, **k: None)  # also on a machine with a GPU
    monkeypatch.delenv("FLASHTUNE_GPU", raising=False)
    r = _run("--gpu", "auto", "--seqlen", "1024")
    assert r.exit_code == 2 and "no CUDA GPU found" in r.output
    assert "--dry-run" in r.output and "--gpu H100 --dry-run" in r.output


def test_dtype_and_head_dim_use_the_shared_names_and_bounds():
    def dtypes(*args):
        r = _run("--dry-run", "--gpu", "H100", "--family", "fwd", "--head-dim", "64", "--seqlen",
                 "1024", "--causal", "false", "--format", "json", *args)
        assert r.exit_code == 0, r.output
        return [b["problem"]["dtype"] for b in json.loads(r.output)["buckets"]]
    assert dtypes("--dtype", "bf16,FP16", "--dtype", "float32", "--dtype", "bfloat16") == [
        "bfloat16", "float16", "float32"]
    r = _run("--dry-run", "--gpu", "H100", "--dtype", "fp8")
    assert r.exit_code == 2 and "--dtype" in r.output and "bf16" in r.output
    r = _run("--dry-run", "--gpu", "H100", "--head-dim", "64,300")
    assert r.exit_code == 2 and "head_dim 300 is not supported: expected 16..256" in r.output


def test_default_families_follow_the_target_arch():
    r = _run("--dry-run", "--gpu", "A100", "--head-dim", "128", "--causal", "false",
             "--format", "json")
    assert r.exit_code == 0, r.output
    assert {b["problem"]["family"] for b in json.loads(r.output)["buckets"]} == {
        "fwd", "bwd", "splitkv"}


def test_by_default_every_family_is_tuned_on_its_own_grid():
    r = _run("--dry-run", "--gpu", "H100", "--head-dim", "128", "--causal", "false",
             "--format", "json")
    assert r.exit_code == 0, r.output
    problems = [b["problem"] for b in json.loads(r.output)["buckets"]]
    fams = {p["family"] for p in problems}
    # hopper_fwd, hopper_bwd: sm_90 targets only
    assert fams == {"fwd", "bwd", "splitkv", "hopper_fwd", "hopper_bwd"}
    for fam in ("fwd", "hopper_fwd"):
        dense = [p for p in problems if p["family"] == fam]
        assert sorted({p["seqlen_q"] for p in dense}) == [512, 1024, 2048, 4096, 8192, 16384]
    decode = [p for p in problems if p["family"] == "splitkv"]
    assert {p["seqlen_q"] for p in decode} == {1}  # one query token per sequence
    assert {p["seqlen_k"] for p in decode} == {2048, 8192, 32768, 131072}
    assert {p["batch"] for p in decode} == {1, 8, 32, 64}
    assert {(p["heads"], p["heads"] // p["group"]) for p in decode} == {(32, 8), (8, 1)}
    # --family narrows it
    r = _run("--dry-run", "--gpu", "H100", "--family", "splitkv", "--head-dim", "128",
             "--seqlen", "32768", "--batch", "1", "--format", "json")
    assert {b["problem"]["family"] for b in json.loads(r.output)["buckets"]} == {"splitkv"}


def test_group_adds_gqa_buckets_of_the_dense_grid():
    """--group 1,4: each dense bucket also as Llama-style GQA (its own bucket, heads a multiple
    of the group, K/V heads = heads / group); the decode grid keeps its own heads; 0 is an
    error naming the option."""
    r = _run("--dry-run", "--gpu", "H100", "--family", "hopper_bwd,fwd", "--head-dim", "128,256",
             "--seqlen", "2048", "--causal", "true", "--group", "1,4", "--format", "json")
    assert r.exit_code == 0, r.output
    buckets = json.loads(r.output)["buckets"]
    assert len(buckets) == 8 and sum("-gqa-" in b["bucket"] for b in buckets) == 4
    for b in buckets:
        p = b["problem"]
        assert p["group"] == (4 if "-gqa-" in b["bucket"] else 1)
        assert p["heads"] % p["group"] == 0 and p["heads"] == 2048 // p["head_dim"]
    r = _run("--dry-run", "--gpu", "H100", "--family", "splitkv", "--head-dim", "128",
             "--seqlen", "8192", "--group", "4", "--format", "json")
    assert r.exit_code == 0, r.output
    assert {b["problem"]["group"] for b in json.loads(r.output)["buckets"]} == {4, 8}
    r = _run("--dry-run", "--gpu", "H100", "--group", "0")
    assert r.exit_code != 0 and "--group" in r.output and ">= 1" in r.output


def test_with_group_rounds_heads_to_whole_groups():
    from flashtune.search_plan import standard_problem, with_group
    p = standard_problem("fwd", "bfloat16", 256, True, 1024)   # H = 8
    assert (with_group(p, 4).heads, with_group(p, 4).group) == (8, 4)
    assert (with_group(p, 3).heads, with_group(p, 16).heads) == (6, 16)
    assert with_group(p, 1) == p
