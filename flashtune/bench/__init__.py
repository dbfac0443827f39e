"""`flashtune bench`: the benchmark of record. grid.py (what is measured, in which unit),
peers.py (flashtune and the implementations beside it; each says why it cannot run a case),
timing.py (CUDA events with L2 flushed, CUDA graphs, ceilings, peak memory), runner.py (cases x
peers -> rows, with progress), report.py (markdown / CSV / JSON), plots.py (PNG).
The command itself is flashtune/cli_bench.py."""
