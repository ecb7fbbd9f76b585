"""asyncrl.learner.records.JsonlTail: the run's live display follows metrics.jsonl without re-reading it.

The writer is the learner's own MetricsWriter (appends; a resume rewrites the file with os.replace), so
the cases below are the file states a run really produces.
"""

from __future__ import annotations

import json

from asyncrl.learner.records import METRICS_FILE, JsonlTail, MetricsWriter, StepRecord, read_jsonl


def _write(w: MetricsWriter, steps: range, dt: float = 1.0) -> None:
    for s in steps:
        w.write(StepRecord(step=s, version=s, time=s * dt))


def test_each_poll_parses_only_what_was_appended_and_matches_a_full_read(tmp_path) -> None:
    w = MetricsWriter(tmp_path, "s1")
    tail = JsonlTail(tmp_path / METRICS_FILE, window_s=1e9)
    assert tail.poll() == [] and list(tail.recent) == []  # no file yet
    _write(w, range(1, 4))
    assert [r["step"] for r in tail.poll()] == [1, 2, 3]
    size = (tmp_path / METRICS_FILE).stat().st_size
    assert tail.bytes_read == size and tail.poll() == []  # nothing appended: nothing read
    _write(w, range(4, 6))
    assert [r["step"] for r in tail.poll()] == [4, 5]
    assert list(tail.recent) == read_jsonl(tmp_path / METRICS_FILE)


def test_a_line_still_being_written_waits_for_its_newline(tmp_path) -> None:
    path = tmp_path / METRICS_FILE
    line = json.dumps({"step": 1, "time": 0.0}) + "\n"
    tail = JsonlTail(path)
    path.write_text(line[:10])  # the writer's line is half out
    assert tail.poll() == []
    with open(path, "a") as f:
        f.write(line[10:] + '{"step": 2, "ti')
    assert [r["step"] for r in tail.poll()] == [1]
    with open(path, "a") as f:
        f.write('me": 1.0}\nnot json\n{"step": 3, "time": 2.0}\n')
    assert [r["step"] for r in tail.poll()] == [2, 3]  # the garbage line is skipped, as read_jsonl does


def test_a_file_rewritten_by_a_resume_is_read_again_from_its_start(tmp_path) -> None:
    w = MetricsWriter(tmp_path, "s1")
    _write(w, range(1, 9))
    tail = JsonlTail(tmp_path / METRICS_FILE, window_s=1e9)
    assert len(tail.poll()) == 8
    w.truncate_after(5)  # the resume redoes steps 6.. (os.replace of a shorter file)
    _write(w, range(6, 8))
    assert [r["step"] for r in tail.poll()] == [1, 2, 3, 4, 5, 6, 7]
    assert [r["step"] for r in tail.recent] == [1, 2, 3, 4, 5, 6, 7]  # the discarded history is gone


def test_a_file_truncated_in_place_is_read_again(tmp_path) -> None:
    path = tmp_path / METRICS_FILE
    path.write_text("".join(json.dumps({"step": s, "time": s}) + "\n" for s in range(1, 6)))
    tail = JsonlTail(path)
    tail.poll()
    path.write_text(json.dumps({"step": 1, "time": 1}) + "\n")  # same inode, shorter
    assert [r["step"] for r in tail.poll()] == [1] and [r["step"] for r in tail.recent] == [1]


def test_recent_keeps_the_window_by_record_time_and_always_the_last_record(tmp_path) -> None:
    w = MetricsWriter(tmp_path, "s1")
    tail = JsonlTail(tmp_path / METRICS_FILE, window_s=10.0, max_records=1000)
    _write(w, range(0, 100))  # time = step seconds
    tail.poll()
    assert [r["step"] for r in tail.recent] == list(range(89, 100))  # time >= 99 - 10
    _write(w, range(500, 501))  # a long gap: only the newest record is inside its window
    tail.poll()
    assert [r["step"] for r in tail.recent] == [500]
    capped = JsonlTail(tmp_path / METRICS_FILE, window_s=1e9, max_records=7)
    capped.poll()
    assert [r["step"] for r in capped.recent] == [94, 95, 96, 97, 98, 99, 500]
