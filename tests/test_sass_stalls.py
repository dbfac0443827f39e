"""bench/sass_stalls.py on a source page shaped like ncu's (--page source --csv --print-source
sass): the idle warps of a warp-specialized kernel are told apart from the working warps, whose
samples are sorted by where they wait; the per-instruction table and the opcode sums add up."""
import importlib.util
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)",
          "Warp Stall Sampling (Not-issued Samples)", "Instructions Executed", "stall_barrier",
          "stall_long_sb", "stall_wait", "stall_selected"]


def _script():
    spec = importlib.util.spec_from_file_location("_sass_stalls", ROOT / "bench" / "sass_stalls.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _page(tmp_path, kernels):
    """A source page: per kernel its title line and header, then (source, samples by reason)."""
    lines = []
    for name, rows in kernels:
        lines += [f'"Kernel Name","{name}"', ",".join(f'"{h}"' for h in HEADER)]
        for i, (src, why) in enumerate(rows):
            total = sum(why.values())
            vals = [f"0x{16 * i:x}", src, total, total, 100] + [
                why.get(h[6:], 0) for h in HEADER[5:]]
            lines.append(",".join(f'"{v}"' for v in vals))
        lines.append("")
    path = tmp_path / "page.csv"
    path.write_text("\n".join(lines))
    return str(path)


def test_idle_warps_are_left_out_and_the_work_is_sorted_by_where_it_waits(tmp_path):
    rnd = random.Random()
    idle, mbar, wgmma, issue, other = (rnd.randint(100, 1000) for _ in range(5))
    rows = [("BAR.SYNC.DEFER_BLOCKING 0x1", {}),
            ("NOP", {"barrier": idle}),                              # the parked warps
            ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x30110], R3", {}),
            ("@!P0  BRA 0x7f00", {"long_sb": mbar}),                 # an mbarrier's try-wait loop
            ("HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24", {"wait": issue}),
            ("WARPGROUP.DEPBAR.LE gsb0, 0x0", {"barrier": wgmma}),   # waiting on the tensor cores
            ("MUFU.EX2 R5, R6", {"selected": other})]
    mod = _script()
    (title, header, got), = mod.tables(_page(tmp_path, [("attn_fwd_hopper", rows)]))
    assert title.endswith("attn_fwd_hopper") and len(got) == len(rows)
    line = mod.work_summary(header, got)
    work = mbar + wgmma + issue + other
    assert line.startswith(f"idle warps {100 * idle / (idle + work):.0f}% of samples")
    for kind, v in (("mbarrier wait", mbar), ("wgmma wait", wgmma), ("wgmma issue", issue),
                    ("other", other)):
        assert f"{kind} {100 * v / work:.0f}%" in line, (kind, line)
    # the barrier stall reason counts the tensor-core wait, not the idle NOP
    assert f"barrier {100 * wgmma / work:.0f}%" in line


def test_the_report_names_each_kernel_and_its_top_instructions(tmp_path, capsys):
    rows = [("NOP", {"barrier": 5}), ("@P1  BRA 0x10", {"long_sb": 80}),
            ("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24", {"wait": 15})]
    page = _page(tmp_path, [("attn_fwd_hopper", rows), ("cudnn_sm90_flash_fprop", rows[1:])])
    assert _script().main([page, "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("## Kernel Name") == 2 and "cudnn_sm90_flash_fprop" in out
    first = out.split("## Kernel Name")[1]
    assert "100 samples" in first and "80.0%  @P1  BRA 0x10" in first
    assert "by opcode: BRA 80.0%, HGMMA.64x128x16.F32.BF16 15.0%, NOP 5.0%" in first
