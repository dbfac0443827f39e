"""The search's studies open in optuna-dashboard: serve a search's storage and read it back
through the dashboard's own HTTP API (localhost only, bounded wait)."""
import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from flashtune.search import run_search
from flashtune.search_progress import NoProgress

from test_search_replay import MemDB, _cfg, _recording

pytest.importorskip("optuna_dashboard")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_studies_open_in_optuna_dashboard(tmp_path):
    cfg = _cfg(tmp_path, _recording(tmp_path), trials=6, top_k=2)
    (bucket,) = run_search(cfg, db=MemDB(), progress=NoProgress()).buckets
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", "from optuna_dashboard._cli import main; main()",
         cfg.storage, "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        studies, deadline = None, time.monotonic() + 60
        while studies is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=5) as r:
                    studies = json.load(r)["study_summaries"]
            except OSError:
                time.sleep(0.5)
        assert studies is not None, "optuna-dashboard did not answer within 60 s"
        (s,) = [s for s in studies if s["study_name"] == bucket.study]
        with urllib.request.urlopen(
                f"http://127.0.0.1:{port}/api/studies/{s['study_id']}", timeout=10) as r:
            detail = json.load(r)
        trials = detail["trials"]
        assert len([t for t in trials if t["state"] == "Complete"]) >= 6
        assert all("variant" in {a["key"] for a in t["user_attrs"]} for t in trials)
    finally:
        server.terminate()
        server.wait(timeout=10)
