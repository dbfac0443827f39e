"""timeline.mark: a search's milestones on stderr with FLASHTUNE_TIMELINE=1, nothing without."""
import time

from flashtune import timeline


def test_marks_only_when_asked_and_once_when_told(monkeypatch, capsys):
    monkeypatch.delenv("FLASHTUNE_TIMELINE", raising=False)
    timeline.mark("quiet")
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("FLASHTUNE_TIMELINE", "1")
    monkeypatch.setattr(timeline, "_once", set())
    before = time.time()
    timeline.mark("storage open")
    timeline.mark("first trial told", once=True)
    timeline.mark("first trial told", once=True)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0].endswith(": storage open")
    assert lines[1].endswith(": first trial told")
    wall = float(lines[0].split(" at ")[1].split(":")[0])
    assert before - 1 <= wall <= time.time() + 1
    since = float(lines[0].split(" +")[1].split("s ")[0])
    assert 0 < since < time.monotonic()  # this process started after the machine


def test_since_start_counts_from_the_process_start():
    # this test process imported torch and ran others before: clearly more than 0 s ago, and
    # it grows with the clock
    a = timeline.since_start()
    time.sleep(0.05)
    b = timeline.since_start()
    assert 0 < a < b
