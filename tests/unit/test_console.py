"""The run console: warning/error lines found in the roles' log files, the displayed numbers, plain mode."""

from __future__ import annotations

from pathlib import Path

from asyncrl.config import Config
from asyncrl.console import LogTail, make_console, status_fields


def test_log_tail_reports_new_alerts_once_and_waits_for_whole_lines(tmp_path):
    a, b = tmp_path / "actor-0.log", tmp_path / "learner.log"
    tail = LogTail([a, b], keep=2)
    assert tail.poll() == []  # files not there yet
    a.write_text("INFO 11-23 [core.py:1] engine up\nWARNING 11-23 [x.py:2] something odd\n"
                 "(Worker pid=1) WARNING 11-23 [cpu_worker.py:114] libiomp is not found in LD_PRELOAD.\n"
                 "(Worker pid=1) ERROR 11-23 [cpu_worker.py:1] Triton exploded\n")  # fmt: skip
    b.write_text(
        "2026 asyncrl.learner.loop ERROR boom\nTraceback (most recent call last)\n  File x\npartial ERR"
    )
    got = tail.poll()
    assert got == ["[actor-0] WARNING 11-23 [x.py:2] something odd",  # the benign start-up notice is not shown
                   "[actor-0] (Worker pid=1) ERROR 11-23 [cpu_worker.py:1] Triton exploded",  # errors always are
                   "[learner] 2026 asyncrl.learner.loop ERROR boom", "[learner] Traceback (most recent call last)"]  # fmt: skip
    assert tail.poll() == []  # nothing new; the unterminated line is not read yet
    with open(b, "a") as f:
        f.write("OR late\n")
    assert tail.poll() == ["[learner] partial ERROR late"]
    assert tail.count == 5 and len(tail.recent) == 2


def test_status_fields_from_records():
    recs = [{"step": s, "time": 10.0 + s, "version": s, "reward_mean": 0.1 * s, "staleness_mean": 0.5,
             "staleness_max": 1.0, "tokens": 100, "step_s": 1.0, "wait_s": 0.25, "eval_version": -1}
            for s in range(1, 11)]  # fmt: skip
    f = status_fields(recs, 30.0, 100, 450.0, 2)
    assert f["step"] == "10/100" and f["steps/s"] == "1.00" and f["trained tok/s"] == "100"
    assert f["learner wait"] == "25%" and f["reward"] == "1.000" and f["eval"] == "-"
    assert f["gen tok/s"] == "450" and f["dead letters"] == "2" and f["version"] == "v10"
    recs[-1].update(eval_version=8, eval_reward_mean=0.625, eval_pass_at_k=0.5)
    assert status_fields(recs, 30.0, 100, None, None)["eval"] == "0.625 (pass@k 0.50, v8)"
    assert status_fields([], 3.0, 0, None, None)["state"].startswith("waiting for the first step")


def test_status_fields_after_a_resume_take_the_rate_from_wall_clock_stamps():
    """A resumed learner's "time" starts again at 0 while the restored records' run to the old process's
    end: a window by "time" mixed both histories (79 steps/s shown for ~12). step_time is wall clock."""
    base = {"tokens": 100, "reward_mean": 0.1, "version": 1, "staleness_mean": 0.5, "staleness_max": 1.0,
            "step_s": 0.08, "wait_s": 0.0, "eval_version": -1}  # fmt: skip
    old = [{**base, "step": s, "time": 5.0 + s / 12, "step_time": 1000.0 + s / 12} for s in range(1, 301)]
    new = [{**base, "step": s, "time": 20.0 + (s - 200) / 12, "step_time": 2000.0 + (s - 200) / 12}
           for s in range(201, 213)]  # fmt: skip
    restored = [r for r in old if r["step"] <= 200]  # truncated at the checkpoint, then redone
    f = status_fields(restored + new, 60.0, 1000, None, None)
    assert f["steps/s"] == "12.00" and f["trained tok/s"] == "1200", f


def test_status_fields_show_a_dash_for_nan_values_read_back_from_metrics_jsonl():
    """An eval that scored no prompt has reward_mean / pass_at_k NaN (asyncrl.evaluate); metrics.jsonl
    writes them as the string "nan", and formatting that with :.3f raised inside the run's display,
    which failed the whole `asyncrl run`."""
    import json
    import math

    from asyncrl.learner.records import StepRecord

    rec = StepRecord(step=5, version=5, time=12.0, reward_mean=0.4, eval_version=4, eval_reward_mean=math.nan,
                     eval_pass_at_k=math.nan, staleness_mean=math.inf)  # fmt: skip
    r = json.loads(json.dumps(rec.to_dict()))  # as MetricsWriter writes it and JsonlTail reads it
    assert r["eval_reward_mean"] == "nan"
    f = status_fields([r], 12.0, 10, None, 0)
    assert f["eval"] == "- (pass@k -, v4)" and f["reward"] == "0.400" and f["staleness"].startswith("- ")


def test_plain_console_prints_numbers_and_alerts(tmp_path, capsys):
    cfg = Config()
    cfg.console.mode, cfg.console.plain_every_s = "plain", 0.01
    con = make_console(cfg, tmp_path)
    assert cfg.console.log_dir == str(tmp_path / "logs")  # the actors will write there
    Path(cfg.console.log_dir).mkdir()
    (Path(cfg.console.log_dir) / "actor-0.log").write_text("INFO noise\nERROR [engine] request failed\n")
    con.update([{"step": 1, "time": 5.0, "version": 1, "reward_mean": 0.2, "staleness_mean": 0.0,
                 "staleness_max": 0.0, "tokens": 10, "step_s": 1.0, "wait_s": 0.5}], 6.0)  # fmt: skip
    con.close()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"asyncrl run demo: {tmp_path}") and "logs/actor-*.log" in out[0]
    assert out[1] == "[actor-0] ERROR [engine] request failed"
    assert out[2].startswith("step 1/60  steps/s 0.00  reward 0.200") and "INFO" not in "".join(out)


def test_verbose_keeps_output_on_the_console(tmp_path):
    cfg = Config()
    cfg.console.verbose, cfg.console.mode = True, "off"
    make_console(cfg, tmp_path).close()
    assert cfg.console.log_dir == ""


def test_live_panel_shows_every_number_alerts_and_log_files(tmp_path):
    from rich.console import Console as RichConsole

    cfg = Config()
    cfg.console.mode = "off"  # build the panel without starting a Live on the test's stdout
    con = make_console(cfg, tmp_path)
    con.tail.recent.append("[actor-0] WARNING slow reward")
    con.tail.count = 1
    fields = status_fields([{"step": 3, "time": 5.0, "version": 3, "reward_mean": 0.5, "staleness_mean": 1.0,
                             "staleness_max": 1.0, "tokens": 10, "step_s": 1.0, "wait_s": 0.5,
                             "eval_version": 2, "eval_reward_mean": 0.4, "eval_pass_at_k": 0.25}], 9.0, 60, 123.0, 0)  # fmt: skip
    rc = RichConsole(record=True, width=160, file=open(tmp_path / "panel.txt", "w"))  # noqa: SIM115
    rc.print(con._panel(fields))
    text = rc.export_text()
    for label in ("step", "3/60", "steps/s", "reward", "eval", "0.400 (pass@k 0.25, v2)", "staleness", "version",
                  "gen tok/s", "123", "trained tok/s", "learner wait", "50%", "dead letters", "warnings/errors (1)",
                  "[actor-0] WARNING slow reward", "logs/actor-*.log", "learner.log"):  # fmt: skip
        assert label in text, (label, text)
