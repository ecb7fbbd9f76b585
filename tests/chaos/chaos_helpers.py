"""Helpers of the chaos suite: drive a real `asyncrl run`, find its processes, check its invariants."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest

from asyncrl.buffer import EmbeddedRedis, ReplayBuffer
from tests.e2e.procs import ROOT, asyncrl_cmd, marked_env, read_jsonl, wait_no_orphans


class ChaosRun:
    """One `asyncrl run` as a real OS process tree, with handles on its parts for fault injection."""

    def __init__(self, tmp: Path, steps: int, *overrides: str, name: str = "", log: str = "run.log") -> None:
        self.tmp = tmp
        self.dir = tmp / "run"
        self.marker = uuid.uuid4().hex
        self.name = name or f"chaos-{self.marker[:8]}"  # the same name (and dir) again = a resume
        self.steps = steps
        self.overrides = overrides
        self.log = tmp / log
        cmd = asyncrl_cmd("run", "--config", str(ROOT / "configs" / "default.yaml"), f"run.dir={self.dir}",
                          f"run.name={self.name}", f"run.max_steps={steps}", "run.max_wall_s=900",
                          "run.progress=false", *overrides)  # fmt: skip
        self.proc = subprocess.Popen(cmd, cwd=tmp, env=marked_env(self.marker), stdout=self.log.open("wb"),
                                     stderr=subprocess.STDOUT)  # fmt: skip
        self._buf: ReplayBuffer | None = None

    # ------------------------------------------------------------------ observing

    def step(self) -> int:
        recs = read_jsonl(self.dir / "metrics.jsonl")
        return int(recs[-1]["step"]) if recs else 0

    def tail(self, n: int = 4000) -> str:
        out = self.log.read_text(errors="replace")[-n:]
        lg = self.dir / "learner.log"
        return out + ("\n--- learner.log ---\n" + lg.read_text(errors="replace")[-n:] if lg.exists() else "")

    def wait(self, pred, timeout: float, what: str) -> Any:
        deadline = time.time() + timeout
        while time.time() < deadline:
            v = pred()
            if v:
                return v
            if self.proc.poll() is not None:
                pytest.fail(
                    f"`asyncrl run` exited ({self.proc.returncode}) while waiting for {what}\n{self.tail()}"
                )
            time.sleep(0.2)
        pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{self.tail()}")

    def wait_progress(self, steps: int, timeout: float, what: str) -> int:
        """Wait until the learner trained ``steps`` more steps than now; returns the step reached."""
        s0 = self.step()
        return self.wait(lambda: self.step() >= s0 + steps and self.step(), timeout, what)

    def buffer(self) -> ReplayBuffer:
        if self._buf is None:
            url = self.wait(lambda: (self.dir / "redis.url").exists() and (self.dir / "redis.url").read_text(),
                            300, "the embedded Redis")  # fmt: skip
            self._buf = ReplayBuffer.connect(url.strip(), self.name, socket_timeout=5.0)
        return self._buf

    def heartbeats(self) -> dict[str, dict]:
        try:
            return self.buffer().actors()
        except Exception:  # Redis away: nothing to report now
            return {}

    # ------------------------------------------------------------------ processes

    def learner_pid(self) -> int | None:
        for p in psutil.Process(self.proc.pid).children():
            try:
                if "learn" in p.cmdline():
                    return p.pid
            except psutil.NoSuchProcess:
                continue
        return None

    def redis_password(self) -> str:
        conf = (self.dir / "redis" / "redis.conf").read_text()
        return next(line.split(None, 1)[1].strip().strip('"') for line in conf.splitlines()
                    if line.startswith("requirepass"))  # fmt: skip

    def redis_pid(self) -> int | None:
        """The embedded redis-server's pid; None while it is being restarted (pid file not yet written)."""
        try:
            return int((self.dir / "redis" / "redis.pid").read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    def actor_pid(self, index: int = 0) -> int | None:
        for hb in self.heartbeats().values():
            if hb.get("index") == index and hb.get("state") == "running":
                return int(hb["pid"])
        return None

    def again(self) -> ChaosRun:
        """The same command once more (same run name and dir): it must resume the run."""
        return ChaosRun(self.tmp, self.steps, *self.overrides, name=self.name, log="run2.log")

    # ------------------------------------------------------------------ end

    def finish(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"`asyncrl run` did not reach its step target within {timeout:.0f}s\n{self.tail()}")

    def close(self) -> None:
        if self._buf is not None:
            self._buf.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def corrupt_newest_checkpoint(run_dir: Path) -> str:
    """Truncate every DeepSpeed file of the checkpoint ``latest.json`` names; returns its tag."""
    tag = json.loads((run_dir / "checkpoints" / "latest.json").read_text())["tag"]
    files = list((run_dir / "checkpoints" / tag).glob("*.pt"))
    assert files, f"no DeepSpeed files in {tag}"
    for f in files:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return tag


def check_invariants(run: ChaosRun, injected_records: int = 0) -> dict[str, Any]:
    """After the run: step target, exactly-once ledger, admission balance, nothing left behind.

    The embedded Redis is stopped with the run; it is started again on its data dir (AOF) to read the
    final buffer. Balance: every admitted group is trained (once, trained.jsonl), credited back
    (dropped, aborted, reclaimed, dead-lettered, lost with a corrupt checkpoint; less a fork's debit),
    still in the stream, or in flight; records a test put into the stream without admission add to the left side.
    """
    summary = json.loads((run.dir / "summary.json").read_text())
    assert summary["finished"] is True and summary["status"] == "finished", summary
    recs = read_jsonl(run.dir / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(1, run.steps + 1))
    trained = [gid for line in read_jsonl(run.dir / "trained.jsonl") for gid in line["group_ids"]]
    dupes = {g for g in trained if trained.count(g) > 1}
    assert not dupes, f"groups trained twice: {sorted(dupes)[:10]}"
    assert len(trained) == run.steps * 4  # default.yaml: groups_per_step 4
    left = wait_no_orphans(run.marker)
    assert not left, "processes left behind:\n" + "\n".join(left)
    with EmbeddedRedis(run.dir / "redis") as srv:
        buf = ReplayBuffer(srv.client(socket_timeout=10.0), run.name)
        st = buf.stats()
        inflight = sum(int(v) for v in buf.client.hvals(buf.keys.inflight))
        dead = buf.dead_letters(10_000)
        buf.close()
    assert st["pending"] == 0, st
    # A learner fork debits credits by its jump in versions times the groups per version (admission.py,
    # "Forks"; no chaos test changes publish_every, so that is groups_per_step 4).
    forked = st["version_skew"] * 4
    assert st["admitted"] + injected_records == st["credits"] + forked + inflight + st["depth"] + len(trained), (
        st, inflight, len(trained), injected_records)  # fmt: skip
    return {"summary": summary, "stats": st, "dead": dead, "trained": trained}


def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    os.kill(pid, sig)
