"""`flashtune bench`: the command runs end to end on the CPU (Triton's interpreter, tiny shapes;
peers that need CUDA reported, not crashed on), a failing peer is a reported cell, the report's
ratios and geomeans, the work each case counts, and re-rendering saved results (--from)."""
import importlib.util
import inspect
import json
import math
import os

import pytest
import torch
from click.testing import CliRunner

import flashtune
from flashtune.bench import grid, report, runner
from flashtune.bench.grid import MASKS, Case
from flashtune.bench.peers import Peer, dense_mask
from flashtune.cli import main
from flashtune.problem import Problem

HAS_MPL = importlib.util.find_spec("matplotlib") is not None


def _rows(doc, **match):
    return [r for r in doc["rows"] if all(r.get(k) == v for k, v in match.items())]


def test_bench_quick_runs_on_the_cpu_and_writes_the_report(tmp_path):
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["bench", "--quick", "--device", "cpu", "--out", str(out),
                                    "--progress", "lines"])
    assert res.exit_code == 0, res.output
    doc = json.loads((out / "bench.json").read_text())
    assert doc["env"]["command"].startswith("flashtune bench --quick")
    assert doc["ceilings"]["matmul"]["tflops"] > 0 and doc["ceilings"]["copy"]["gbps"] > 0
    # flashtune ran every dense, decode and varlen case, tuned and with the defaults, and the
    # two agree (the same attention whatever the variant)
    for section in ("dense", "decode", "varlen"):
        for peer in ("flashtune", "flashtune-defaults"):
            rows = _rows(doc, section=section, peer=peer)
            assert rows and all(r["throughput"] > 0 for r in rows), (section, peer, rows[:1])
            for r in rows:
                assert r["throughput"] == pytest.approx(
                    r["work"] / (r["ms"] * 1e-3) / (1e9 if r["unit"] == "GB/s" else 1e12))
        assert all(r["max_abs_diff"] < 2e-2 for r in _rows(doc, section=section,
                                                            peer="flashtune-defaults"))
    # the paged cache gives the contiguous cache's result
    paged = _rows(doc, section="decode", peer="flashtune-paged256")
    assert paged and all(r["max_abs_diff"] < 2e-2 and r["throughput"] > 0 for r in paged)
    # the read ceiling: every decode case timed, nothing to compare (it computes no attention)
    reads = _rows(doc, section="decode", peer="plain-read")
    assert reads and all(r["throughput"] > 0 and "max_abs_diff" not in r and "error" not in r
                         for r in reads)
    # peers that need CUDA are reported with the reason, on every case
    for peer in ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex"):
        rows = _rows(doc, peer=peer)
        assert rows and all("CUDA" in r["skipped"] for r in rows)
    # masks: a note until flashtune.attention takes the argument, then numbers
    params = inspect.signature(flashtune.attention).parameters
    for name, mask in MASKS.items():
        for r in _rows(doc, section="masks", mask=name, peer="flashtune"):
            if mask.argument in params:
                assert "throughput" in r or "error" in r
            else:
                assert r["skipped"].startswith("not available in this flashtune")
    assert not _rows(doc, section="bnhd")  # on request only (--section bnhd)
    md = (out / "bench.md").read_text()
    assert "## Dense forward" in md and "## Decoding" in md and "## Not run" in md
    assert "vs flashtune-defaults" in md and "Reproduce: `flashtune bench --quick" in md
    assert "flashtune" in (out / "bench.csv").read_text().splitlines()[1]
    assert (out / "dense.png").exists() == HAS_MPL and (out / "decode.png").exists() == HAS_MPL
    assert "Dense forward" in res.output and "ETA" in res.output


def test_bnhd_section_times_the_dense_grid_in_that_layout(tmp_path):
    """--section bnhd: the dense grid with q, k, v and dO in (B, N, H, D) memory; flashtune
    computes it there (the output keeps the layout), as the tuned and the default variants."""
    from flashtune.bench import grid
    from flashtune.bench.peers import make_inputs
    case = grid.bnhd(grid.Shapes.tiny())[0]
    q, k, v = make_inputs(case, "cpu").tensors
    assert q.shape == (case.batch, case.heads, case.seqlen_q, case.head_dim)
    assert q.stride(1) == case.head_dim and q.stride(2) == case.heads * case.head_dim
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["bench", "--device", "cpu", "--section", "bnhd", "--peer",
                                    "flashtune,flashtune-defaults", "--out", str(out),
                                    "--progress", "none", "--no-plots"])
    assert res.exit_code == 0, res.output
    doc = json.loads((out / "bench.json").read_text())
    rows = _rows(doc, section="bnhd")
    assert len(rows) == 2 * len(grid.bnhd(grid.Shapes.tiny())) and not _rows(doc, section="dense")
    assert all(r["throughput"] > 0 for r in rows), rows[:1]
    assert all(r["max_abs_diff"] < 2e-2 for r in _rows(doc, section="bnhd",
                                                        peer="flashtune-defaults"))
    assert "## Dense backward, q/k/v in (B, N, H, D) memory" in (out / "bench.md").read_text()


class _Ref(Peer):
    """A stand-in for flashtune that runs everywhere: SDPA's math on the CPU."""
    name = "flashtune"
    doc = "reference"

    def prepare(self, case, inp):
        return lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=case.causal)


class _Raises(Peer):
    name = "broken"
    doc = "raises"

    def prepare(self, case, inp):
        raise RuntimeError("kernel exploded")


class _Wrong(Peer):
    """Fast and wrong (cuDNN's varlen output in torch 2.11 on the H100): no time to count."""
    name = "wrong"
    doc = "garbage"

    def prepare(self, case, inp):
        return lambda q, k, v: (q + k + v) * 1e23


class _Absent(Peer):
    name = "absent"
    doc = "never here"

    def why_not(self, case, device):
        return "not installed"


def test_a_failing_peer_is_a_reported_cell_not_a_crash(capsys, tmp_path):
    shapes = grid.Shapes(head_dims=(16,), seqlens=(32,), tokens=64, hidden=32,
                         modes=("fwd", "fwd+bwd"), causals=(True,))
    doc = runner.run(shapes, ("dense",), [_Ref(), _Raises(), _Absent(), _Wrong()], "cpu",
                     progress="lines", checkpoint=tmp_path / "partial.json")
    # what a run cut short would leave: every finished case, marked partial
    saved = json.loads((tmp_path / "partial.json").read_text())
    assert saved["partial"] is True and saved["rows"] == doc["rows"]
    assert [r["peer"] for r in doc["rows"]] == ["flashtune", "broken", "absent", "wrong"] * 2
    assert all(r["throughput"] > 0 for r in _rows(doc, peer="flashtune"))
    assert all(r["error"] == "RuntimeError: kernel exploded" for r in _rows(doc, peer="broken"))
    assert all(r["skipped"] == "not installed" for r in _rows(doc, peer="absent"))
    wrong = _rows(doc, peer="wrong")
    assert all(r["error"].startswith("wrong result") and "throughput" not in r
               and r["wrong_ms"] > 0 for r in wrong)
    # fwd+bwd: its gradients are wrong too
    assert {r["mode"] for r in wrong} == {"fwd", "fwd+bwd"}
    md = report.markdown(doc)
    assert "broken **failed**: `RuntimeError: kernel exploded` (2 cells" in md
    assert "absent: not installed (2 cells)" in md
    assert "ETA" in capsys.readouterr().err


def _doc(device="H100", rows=()):
    return {"env": {"device": device, "torch": "2.9", "triton": "3.6", "date": "2026-11-23",
                    "command": "flashtune bench --section dense"},
            "ceilings": {"matmul": {"tflops": 400.0, "what": "mm"},
                         "copy": {"gbps": 3000.0, "what": "copy"}},
            "peers": {"flashtune": "", "sdpa-flash": "", "flex": ""}, "masks": {},
            "rows": list(rows)}


def _row(n, peer, tp=None, **kw):
    r = {**Case("dense", "fwd", 16384 // n, 16, 16, n, n, 128, False).to_dict(), "peer": peer}
    if tp is not None:
        r.update(throughput=tp, ms=1.0)
    r.update(kw)
    return r


def test_report_ratios_geomeans_and_ceiling_shares():
    doc = _doc(rows=[_row(1024, "flashtune", 200.0), _row(1024, "sdpa-flash", 100.0),
                     _row(1024, "flex", skipped="no flex"),
                     _row(4096, "flashtune", 300.0), _row(4096, "sdpa-flash", 100.0),
                     _row(4096, "flex", error="RuntimeError: boom")])
    t = report.table(doc, "dense", "fwd")
    assert "| flashtune | sdpa-flash | vs sdpa-flash | % matmul |" in t  # flex never ran
    assert "| 128 | no | 1024 | 16x16 | 200 | 100 | 2.00x | 50% |" in t
    assert "| 128 | no | 4096 | 4x16 | 300 | 100 | 3.00x | 75% |" in t
    assert f"**{math.sqrt(6):.2f}x**" in t
    assert report.geomean([2.0, 8.0, None, 0]) == pytest.approx(4.0)
    assert report.geomean([]) is None


def test_a_time_whose_samples_spread_widely_is_marked():
    """A cell whose samples spread more than report.SPREAD_MARK (p80 / p20 - 1, from its timing
    note) carries a mark, and the caveats say what it means and how many cells per peer."""
    doc = _doc(rows=[_row(1024, "flashtune", 200.0, timing="4 rounds; spread 0.354"),
                     _row(1024, "sdpa-flash", 100.0, timing="4 rounds; spread 0.011"),
                     _row(4096, "flashtune", 300.0, timing="4 rounds; spread 0.050"),
                     _row(4096, "sdpa-flash", 100.0, timing="cuda graph; spread 4.409")])
    t = report.table(doc, "dense", "fwd")
    assert f"| 128 | no | 1024 | 16x16 | 200{report.MARK} | 100 | 2.00x | 50% |" in t
    assert f"| 128 | no | 4096 | 4x16 | 300 | 100{report.MARK} | 3.00x | 75% |" in t
    caveats = report.not_run(doc)
    assert report.MARK in caveats and "flashtune: 1 cells, sdpa-flash: 1 cells" in caveats
    assert report.spread({"timing": "no spread noted"}) is None
    assert report.not_run(_doc(rows=[_row(1024, "flashtune", 200.0)])) == ""


def test_from_renders_and_merges_saved_runs(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    report.write_json(_doc(rows=[_row(1024, "flashtune", 200.0),
                                 _row(1024, "sdpa-flash", 100.0)]), a)
    later = _doc(rows=[_row(4096, "flashtune", 300.0), _row(4096, "sdpa-flash", 150.0)])
    later["env"]["command"] = "flashtune bench --seqlen 4096"
    report.write_json(later, b)
    out = tmp_path / "docs"
    res = CliRunner().invoke(main, ["bench", "--from", str(a), "--from", str(b), "--out", str(out)])
    assert res.exit_code == 0, res.output
    md = (out / "bench.md").read_text()
    assert "| 1024 |" in md and "| 4096 |" in md and "**2.00x**" in md
    assert "`flashtune bench --section dense; flashtune bench --seqlen 4096`" in md
    # a merged report merged again with a re-run of one of its commands keeps each command once
    again = tmp_path / "again"
    res = CliRunner().invoke(main, ["bench", "--from", str(out / "bench.json"), "--from", str(b),
                                    "--out", str(again)])
    assert res.exit_code == 0, res.output
    assert json.loads((again / "bench.json").read_text())["env"]["command"] == (
        "flashtune bench --section dense; flashtune bench --seqlen 4096")
    assert len(json.loads((out / "bench.json").read_text())["rows"]) == 4
    assert (out / "dense.png").exists() == HAS_MPL
    if HAS_MPL:
        assert "![dense](dense.png)" in md
    # --whole-cases: a case re-run by a later file keeps only that file's peers (a peer the
    # later run did not time no longer stands beside it), other cases keep every row
    c = tmp_path / "c.json"
    report.write_json(_doc(rows=[_row(1024, "flashtune", 250.0)]), c)
    for whole, rows in ((False, 4), (True, 3)):
        res = CliRunner().invoke(main, ["bench", "--from", str(a), "--from", str(b), "--from",
                                        str(c), "--out", str(out), "--no-plots"]
                                 + (["--whole-cases"] if whole else []))
        assert res.exit_code == 0, res.output
        got = json.loads((out / "bench.json").read_text())["rows"]
        assert len(got) == rows
        assert {r["peer"] for r in got if r["seqlen_q"] == 1024} == (
            {"flashtune"} if whole else {"flashtune", "sdpa-flash"})
        assert {r["throughput"] for r in got if r["seqlen_q"] == 4096} == {300.0, 150.0}
        assert got[0]["seqlen_q"] == 1024  # the re-run case keeps its place, above 4096's
    res = CliRunner().invoke(main, ["bench", "--whole-cases"])
    assert res.exit_code != 0 and "--from" in res.output
    other = tmp_path / "c.json"
    report.write_json(_doc(device="H200"), other)
    res = CliRunner().invoke(main, ["bench", "--from", str(a), "--from", str(other)])
    assert res.exit_code != 0 and "different devices" in res.output
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    res = CliRunner().invoke(main, ["bench", "--from", str(bad)])
    assert res.exit_code != 0 and "not a `flashtune bench` result" in res.output


def test_work_follows_the_families_conventions():
    c = Case("dense", "fwd", 4, 16, 16, 4096, 4096, 128, True)
    fwd = Problem("fwd", "bfloat16", 128, True, 1, 4, 16, 4096, 4096).flops()
    assert c.work() == fwd
    assert Case("dense", "bwd", 4, 16, 16, 4096, 4096, 128, True).work() == 2.5 * fwd
    assert Case("dense", "fwd+bwd", 4, 16, 16, 4096, 4096, 128, True).work() == 3.5 * fwd
    d = Case("decode", "fwd", 8, 32, 8, 1, 32768, 128, False)
    assert d.work() == 2 * 8 * 8 * 32768 * 128 * 2 and d.unit == "GB/s"
    v = Case("varlen", "fwd", 2, 4, 4, 300, 300, 64, False, lengths=(100, 300))
    assert v.work() == 4.0 * 4 * 64 * (100 ** 2 + 300 ** 2)


@pytest.mark.parametrize("name", ["window", "block_mask"])
@pytest.mark.parametrize("n", [300, 1024])
def test_mask_work_counts_the_pairs_the_mask_keeps(name, n):
    c = Case("masks", "fwd", 2, 4, 4, n, n, 64, name != "block_mask", mask=name)
    kept = int(dense_mask(c, "cpu").sum())
    assert MASKS[name].kept(c) == kept
    assert c.work() == 4.0 * 4 * 64 * 2 * kept


def test_bench_help_and_bad_options():
    out = CliRunner().invoke(main, ["bench", "--help"], terminal_width=100).output
    assert "--from" in out and "--quick" in out
    from flashtune.bench.peers import default_peers
    assert all(p.name in " ".join(out.split()) for p in default_peers())
    res = CliRunner().invoke(main, ["bench", "--peer", "nope", "--device", "cpu"])
    assert res.exit_code != 0 and "unknown peer" in res.output
    res = CliRunner().invoke(main, ["bench", "--section", "nope"])
    assert res.exit_code != 0 and "dense" in res.output


def _masked_reference(q, k, v, keep, score=None):
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if score is not None:
        s = score(s)
    s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, -1) @ v.double()


def _expected(case, inp):
    """The case's attention in float64, written out independently of the peers."""
    q, k, v = inp.tensors
    if case.section == "decode":
        return flashtune.reference(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    if case.section == "varlen":
        cu = inp.extra["cu_seqlens"].tolist()
        parts = [flashtune.reference(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)),
                                     causal=case.causal)[0].transpose(0, 1)
                 for a, b in zip(cu, cu[1:])]
        return torch.cat(parts)
    i = torch.arange(case.seqlen_q)[:, None]
    j = torch.arange(case.seqlen_k)[None, :]
    if case.mask == "window":
        return _masked_reference(q, k, v, (j <= i) & (i - j < MASKS["window"].left))
    if case.mask == "block_mask":
        m = MASKS["block_mask"]
        return _masked_reference(q, k, v, (i // m.block == j // m.block) |
                                 ((j // m.block) % m.stride == 0))
    if case.mask == "softcap":
        cap = MASKS["softcap"].cap
        return _masked_reference(q, k, v, j <= i, lambda s: cap * torch.tanh(s / cap))
    return flashtune.reference(q, k, v, causal=case.causal)


_LAYOUT_CASES = [
    Case("dense", "fwd", 2, 4, 4, 48, 48, 16, False, "float32"),
    Case("dense", "fwd", 2, 4, 4, 48, 48, 16, True, "float32"),
    Case("bnhd", "fwd", 2, 4, 4, 48, 48, 16, True, "float32"),
    Case("decode", "fwd", 3, 8, 2, 1, 80, 16, False, "float32"),
    Case("varlen", "fwd", 3, 4, 4, 50, 50, 16, True, "float32", lengths=(20, 50, 7)),
    Case("varlen", "fwd", 3, 4, 4, 50, 50, 16, False, "float32", lengths=(20, 50, 7)),
    Case("masks", "fwd", 1, 2, 2, 600, 600, 16, True, "float32", mask="window"),
    Case("masks", "fwd", 1, 2, 2, 600, 600, 16, False, "float32", mask="block_mask"),
    Case("masks", "fwd", 1, 2, 2, 96, 96, 16, True, "float32", mask="softcap"),
]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("case", _LAYOUT_CASES, ids=lambda c: c.label)
@pytest.mark.parametrize("peer", ["sdpa", "flex", "flashtune"])
def test_peers_compute_the_case_in_its_layout(case, peer, monkeypatch):
    """What the GPU run times is the case's attention, in the case's layout: SDPA (the CPU's
    default backend) and FlexAttention (eager) checked on the CPU against float64."""
    from flashtune.bench import peers
    from flashtune.bench.peers import Flex, Sdpa, Unavailable, make_inputs
    inp = make_inputs(case, "cpu")
    if peer == "flashtune":  # the interpreter: what the GPU run hands flashtune
        from flashtune.bench.peers import Flashtune
        if not os.environ.get("TRITON_INTERPRET"):
            pytest.skip("flashtune on the CPU needs TRITON_INTERPRET=1")
        p = Flashtune(True)
    elif peer == "flex":
        from torch.nn.attention.flex_attention import flex_attention
        monkeypatch.setattr(peers, "compiled_flex", lambda dynamic=False: flex_attention)
        p = Flex()
    else:
        p = Sdpa("efficient")
        if p.why_not(case, "cuda"):  # what the peer says it cannot do on a GPU either
            pytest.skip(p.why_not(case, "cuda"))
    try:
        fn = p.prepare(case, inp)
        out = fn(*inp.tensors)
    except (Unavailable, NotImplementedError, RuntimeError) as e:
        if peer == "sdpa" and case.section == "varlen":
            pytest.skip(f"nested-tensor SDPA on the CPU: {e}")
        raise
    want = _expected(case, inp)
    assert out.shape == want.shape
    assert (out.double() - want).abs().max().item() < 1e-4


def test_progress_bar_on_a_terminal_and_lines_elsewhere():
    import io

    from flashtune.bench.progress import Progress

    class Tty(io.StringIO):
        def isatty(self):
            return True
    tty, log = Tty(), io.StringIO()
    for stream in (tty, log):
        p = Progress(4, "auto", stream)
        for i in range(4):
            p.step(f"case {i}")
            p.line(f"case {i} done")
        p.close()
    assert "\r" in tty.getvalue() and "[########################] 4/4" in tty.getvalue()
    assert "\r" not in log.getvalue()
    assert log.getvalue().splitlines()[0].startswith("[1/4  25% ETA ")
    assert log.getvalue().splitlines()[-1] == "[4/4 100% ETA 0m00s] case 3 done"


def test_resume_keeps_finished_cells_and_reruns_failed_ones():
    shapes = grid.Shapes(head_dims=(16,), seqlens=(32, 64), tokens=64, hidden=32,
                         modes=("fwd",), causals=(False,))
    calls = []

    class Counting(_Ref):
        def prepare(self, case, inp):
            calls.append(case.seqlen_q)
            return super().prepare(case, inp)

    first = runner.run(shapes, ("dense",), [Counting(), _Raises()], "cpu", progress="none")
    first["rows"] = first["rows"][:2]  # cut short after the first case
    calls.clear()
    again = runner.run(shapes, ("dense",), [Counting(), _Raises()], "cpu", progress="none",
                       resume=first)
    assert calls == [64]  # the finished cell was kept, not measured again
    assert again["rows"][0] == first["rows"][0]
    assert [r["peer"] for r in again["rows"]] == ["flashtune", "broken"] * 2
    assert all("error" in r for r in _rows(again, peer="broken"))  # failures run again
    other = {**first, "env": {**first["env"], "device": "NVIDIA H100"}}
    with pytest.raises(runner.ResumeMismatch, match="cannot resume"):
        runner.run(shapes, ("dense",), [Counting()], "cpu", progress="none", resume=other)


def test_decode_cells_time_a_step_of_layers_per_layer():
    # each layer its own cache (same shapes, distinct memory), the time per layer; the output
    # compared between peers is layer 1's, so the peers are still checked on the same data
    from flashtune.bench import grid, runner
    from flashtune.bench.peers import by_names
    shapes = grid.Shapes.tiny()
    names = ["flashtune", "flashtune-defaults", "flashtune-paged256"]
    doc = runner.run(shapes, ("decode",), by_names(names), "cpu", progress="none",
                     decode_layers=3)
    assert doc["env"]["decode_layers"] == 3
    rows = [r for r in doc["rows"] if "throughput" in r]
    assert {r["peer"] for r in rows} == set(names)
    assert all(r["layers"] == 3 and r["ms"] > 0 for r in rows)
    assert all(r["max_abs_diff"] < 2e-2 for r in rows if r["peer"] != "flashtune")
    # a cap on the caches' bytes gives fewer layers
    few = runner.run(shapes, ("decode",), by_names(["flashtune-defaults"]), "cpu",
                     progress="none", decode_layers=3, decode_max_gib=1e-9)
    assert few["rows"] and all("layers" not in r and r["ms"] > 0 for r in few["rows"])


def test_decode_layers_share_one_lengths_tensor_and_one_block_table():
    # a server's step: each layer its own q and caches, one lengths tensor and (paged) one block
    # table for all of them -- the layout the paged render is slower in (session 47)
    from flashtune.bench import grid, runner
    from flashtune.bench.peers import Paged, make_inputs
    case = grid.Case("decode", "fwd", 2, 4, 2, 1, 64, 64, False, "float16")
    inp = make_inputs(case, "cpu")
    more = runner._layers(case, inp, "cpu", 3, 1e12)
    assert len(more) == 2
    for m in more:
        assert m.extra["cache_seqlens"] is inp.extra["cache_seqlens"]
        assert all(a.data_ptr() != b.data_ptr() for a, b in zip(m.tensors, inp.tensors))
    peer = Paged()
    first = peer.prepare(case, inp)
    table = peer._tables[case]
    assert sorted(table.flatten().tolist()) == list(range(table.numel()))  # every page once
    rest = [peer.prepare(case, m) for m in more]
    assert peer._tables[case] is table
    # every layer's paged step gives its own contiguous result (float64 reference)
    from flashtune.reference import reference
    for m, fn in zip((inp,) + more, [first] + rest):
        q, kc, vc = m.tensors
        want = reference(q.transpose(1, 2).double(), kc.transpose(1, 2).double(),
                         vc.transpose(1, 2).double()).transpose(1, 2)
        assert (fn(q, kc, vc).double() - want).abs().max().item() < 2e-3
