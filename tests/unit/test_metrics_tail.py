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


def _history(path, rng, steps: int) -> list[dict]:
    """A learner's file: records in step order, garbage lines and an occasional torn line between them
    (a kill mid-write, then the next record appended after it), and maybe a torn last line."""
    recs, out = [], []
    for s in range(1, steps + 1):
        rec = {"step": s, "time": float(s), "pad": "x" * int(rng.integers(0, 300))}
        line = json.dumps(rec)
        r = rng.random()
        if r < 0.05:
            out.append("not json\n")
        elif r < 0.08:
            out.append(line[: int(rng.integers(1, len(line)))] + "\n")  # a torn line, newline later
        recs.append(rec)
        out.append(line + "\n")
    if rng.random() < 0.5:
        out.append(json.dumps({"step": steps + 1})[:7])  # killed mid-write: a torn last line
    path.write_text("".join(out))
    return recs


def test_truncate_after_reads_only_the_tail_and_matches_the_full_read(tmp_path, monkeypatch) -> None:
    """A resume cut metrics.jsonl and trained.jsonl by parsing both whole (~11 KB of memory per step:
    2.3 GB for 200,000 steps). Now only the tails are parsed; the records kept and discarded are those
    of the full read (random histories with garbage and torn lines), and a torn last line is cut so
    the next record does not start on it."""
    import numpy as np

    from asyncrl.learner import records
    from asyncrl.learner.records import DISCARDED_FILE, LEDGER_FILE, last_record, lines_from_end

    rng = np.random.default_rng(3)
    for trial in range(40):
        d = tmp_path / f"t{trial}"
        d.mkdir()
        n = int(rng.integers(0, 60))
        metrics = _history(d / METRICS_FILE, rng, n)
        ledger = _history(d / LEDGER_FILE, rng, n)
        cut = int(rng.integers(0, n + 2))
        assert [json.loads(x) for _, x in lines_from_end(d / METRICS_FILE, block=int(rng.integers(1, 64)))
                if records._step_of(x) is not None] == metrics[::-1]  # fmt: skip
        with monkeypatch.context() as m:
            m.setattr(records, "read_jsonl", None)  # not used: it parses the whole file
            MetricsWriter(d, "s").truncate_after(cut)
        assert read_jsonl(d / METRICS_FILE) == [r for r in metrics if r["step"] <= cut]
        assert read_jsonl(d / LEDGER_FILE) == [r for r in ledger if r["step"] <= cut]
        assert read_jsonl(d / DISCARDED_FILE) == [r for r in ledger if r["step"] > cut]
        want_last = [r for r in metrics if r["step"] <= cut][-1:] or [None]
        assert last_record(d / METRICS_FILE) == want_last[0]
        # The next record starts a line of its own (no torn line left to glue it to).
        MetricsWriter(d, "s").write(StepRecord(step=cut + 1, version=0, time=0.0))
        assert read_jsonl(d / METRICS_FILE)[-1]["step"] == cut + 1


def test_a_tail_follows_a_resume_that_regrows_the_file_before_its_next_poll(tmp_path) -> None:
    """The resume replaces the file (new inode): a tail that polls only after the redone steps grew it
    past its old size still reads it again from the start instead of from its old offset."""
    w = MetricsWriter(tmp_path, "s1")
    _write(w, range(1, 9))
    tail = JsonlTail(tmp_path / METRICS_FILE, window_s=1e9)
    assert len(tail.poll()) == 8
    w.truncate_after(5)
    _write(w, range(6, 12))
    assert [r["step"] for r in tail.poll()] == list(range(1, 12))


def test_records_after_and_iter_jsonl_match_the_full_read(tmp_path, monkeypatch) -> None:
    """The run end's summary and the adaptive controller's resume parsed metrics.jsonl whole (~5 KB of
    memory a step). ``iter_jsonl`` streams it and ``records_after`` reads only the tail after a step;
    both give what the full read gives on random histories with garbage and torn lines."""
    import numpy as np

    from asyncrl.learner import records
    from asyncrl.learner.records import iter_jsonl, records_after

    rng = np.random.default_rng(5)
    for trial in range(40):
        path = tmp_path / f"m{trial}.jsonl"
        recs = _history(path, rng, int(rng.integers(0, 60)))
        full = read_jsonl(path)
        assert full == recs
        assert list(iter_jsonl(path)) == full
        after = int(rng.integers(-1, len(recs) + 2))
        with monkeypatch.context() as m:
            m.setattr(records, "read_jsonl", None)  # not used: it parses the whole file
            got = records_after(path, after)
        assert got == [r for r in recs if r["step"] > after], (trial, after)
    assert list(iter_jsonl(tmp_path / "missing.jsonl")) == [] and records_after(tmp_path / "missing", 0) == []


def test_records_after_reads_back_only_to_the_step(tmp_path, monkeypatch) -> None:
    """On a long file the tail reader stops at the first record of a step <= ``after``: it reads a few
    block from the end, not the file (counted by how far back the lines it parsed reach)."""
    from asyncrl.learner import records

    path = tmp_path / METRICS_FILE
    with open(path, "w") as f:
        for s in range(1, 20_001):
            f.write(json.dumps({"step": s, "pad": "x" * 200}) + "\n")
    read = 0
    real = records.lines_from_end

    def counted(p, block=1 << 16):
        nonlocal read
        for off, line in real(p, block):
            read = path.stat().st_size - off
            yield off, line

    monkeypatch.setattr(records, "lines_from_end", counted)
    got = records.records_after(path, 19_990)
    assert [r["step"] for r in got] == list(range(19_991, 20_001))
    assert read < 10_000 and path.stat().st_size > 4_000_000  # ~11 lines of ~220 bytes, of 4.4 MB


def test_the_run_summary_streams_the_records_and_matches_the_full_read(tmp_path) -> None:
    """summary.json from the streamed records equals the old whole-list computation (random histories,
    resumes at random times)."""
    import numpy as np

    from asyncrl.learner.records import iter_jsonl
    from asyncrl.orchestrator import write_summary

    rng = np.random.default_rng(7)
    for trial in range(30):
        n = int(rng.integers(0, 40))
        recs = [{"step": s, "version": s + 1, "step_time": float(s), "tokens": int(rng.integers(0, 500)),
                 "reward_mean": float(rng.normal()), "staleness_max": int(rng.integers(0, 5))}
                for s in range(1, n + 1)]  # fmt: skip
        path = tmp_path / f"m{trial}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
        start, end = float(rng.uniform(0, n + 1)), float(n + 2)
        got = write_summary(tmp_path, iter_jsonl(path), start, end, {})
        k = min(3, n)
        this = [r for r in recs if r["step_time"] >= start]
        want = {
            "steps": recs[-1]["step"] if recs else 0,
            "final_version": recs[-1]["version"] if recs else 0,
            "start_reward": sum(r["reward_mean"] for r in recs[:k]) / k if k else None,
            "end_reward": sum(r["reward_mean"] for r in recs[-k:]) / k if k else None,
            "wall_s": end - start,
            "trained_tokens": sum(r["tokens"] for r in recs),
            "trained_tokens_per_s": sum(r["tokens"] for r in this) / max(end - start, 1e-9),
            "staleness_max": max((r["staleness_max"] for r in recs), default=0),
        }
        assert got.keys() == want.keys()
        for key, value in want.items():
            if isinstance(value, float):
                assert abs(got[key] - value) <= 1e-12 * max(1.0, abs(value)), (trial, key)
            else:
                assert got[key] == value, (trial, key)


def test_the_run_summary_is_replaced_atomically(tmp_path) -> None:
    """Readers (asyncrl status, a re-run, the sweeps) never see a torn summary.json while it is rewritten
    (the Ray-loss path writes it twice): a torn file read as {} made a finished run look unfinished."""
    import threading

    from asyncrl.run_summary import read_summary, write_summary

    pad = {"pad": "x" * 4_000_000, "finished": True}  # a slow write: a wide window for a torn read
    write_summary(tmp_path, [], 0.0, 1.0, pad)
    torn: list[int] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            if not read_summary(tmp_path).get("finished"):
                torn.append(1)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(15):
            write_summary(tmp_path, [], 0.0, 1.0, pad)
    finally:
        done.set()
        reader.join()
    assert not torn
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temporary file left
