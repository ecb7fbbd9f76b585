"""`asyncrl run`: the embedded default, all roles on one machine.

Starts an embedded redis-server inside the run dir (unless redis.url is set), builds or resolves the
model, starts the learner as its own OS process (`asyncrl learn`), runs the actor pool on a local Ray
in this process, shows a live progress line, and tears everything down on completion, on the wall
budget, or on Ctrl-C/SIGTERM.

Invariant: whatever happens, the finally-block stops the pool (engines + Ray), the learner process
and the embedded Redis in that order, so no redis-server, Ray or vLLM process outlives the command.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from asyncrl.config import Config, run_dir, to_yaml
from asyncrl.learner.records import read_jsonl  # stdlib only: a torn last line is skipped


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_learner_process(cfg_path: Path, redis_url: str, start_time: float, resume: bool = False,
                          log_path: Path | None = None, threads: int = 0) -> subprocess.Popen:  # fmt: skip
    """The learner as its own process group (so Ctrl-C reaches it only through us, in order)."""
    env = dict(os.environ)
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), ASYNCRL_START_TIME=repr(start_time))  # fmt: skip
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "asyncrl.cli", "learn", "--config", str(cfg_path), f"redis.url={redis_url}"]
    if resume:
        cmd.insert(4, "--resume")
    out = open(log_path, "ab") if log_path else None  # noqa: SIM115 - handed to the child
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                            start_new_session=True)  # fmt: skip


def learner_threads(cfg: Config) -> int:
    """Threads for a learner co-located with the actors: on a CPU-only machine the vLLM engines already
    use the cores, and a multi-threaded learner fighting them ran 10x slower than a single thread."""
    if cfg.learner.torch_threads:
        return cfg.learner.torch_threads
    if "OMP_NUM_THREADS" in os.environ or shutil.which("nvidia-smi"):
        return 0  # the user's choice, or a GPU learner: leave torch's default
    return 1


def stop_process(proc: subprocess.Popen, grace_s: float = 60.0) -> int:
    """SIGTERM (the learner finishes its step and checkpoints), then SIGKILL after ``grace_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return proc.returncode


class Progress:
    """A live one-line view: step, version, reward, staleness, tokens/s (a plain line when not a tty)."""

    def __init__(self, enabled: bool, max_steps: int):
        self.enabled = enabled
        self.max_steps = max_steps
        self.tty = sys.stdout.isatty()
        self.last_print = 0.0

    def update(self, records: list[dict], elapsed: float) -> None:
        if not self.enabled:
            return
        if records:
            r = records[-1]
            toks = sum(x.get("tokens", 0) for x in records)
            line = (f"step {r['step']}/{self.max_steps or '-'}  v{r['version']}  reward {r['reward_mean']:.3f}  "
                    f"staleness {r['staleness_mean']:.2f}/{r['staleness_max']}  "
                    f"{toks / max(elapsed, 1e-9):.0f} tok/s  {elapsed:.0f}s")  # fmt: skip
        else:
            line = f"waiting for the first step ...  {elapsed:.0f}s"
        if self.tty:
            sys.stdout.write("\r\033[K" + line)
            sys.stdout.flush()
        elif time.time() - self.last_print > 10:
            print(line, flush=True)
            self.last_print = time.time()

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stdout.write("\n")


def write_targets(rdir: Path, run: str, learner_status: dict, actors: dict) -> list[dict]:
    """Prometheus ``file_sd_configs`` targets of the endpoints this run started (atomic rewrite)."""
    groups = []
    if learner_status.get("metrics_addr"):
        groups.append(
            {"targets": [learner_status["metrics_addr"]], "labels": {"run": run, "role": "learner"}}
        )
    addrs = sorted(a["metrics_addr"] for a in actors.values() if a.get("metrics_addr"))
    if addrs:
        groups.append({"targets": addrs, "labels": {"run": run, "role": "actor"}})
    tmp = rdir / "prometheus_targets.json.tmp"
    tmp.write_text(json.dumps(groups, indent=2))
    os.replace(tmp, rdir / "prometheus_targets.json")
    return groups


def write_summary(rdir: Path, records: list[dict], start: float, end: float, extra: dict) -> dict:
    k = min(3, len(records))
    summary = {
        "steps": records[-1]["step"] if records else 0,
        "final_version": records[-1]["version"] if records else 0,
        "start_reward": sum(r["reward_mean"] for r in records[:k]) / k if k else None,
        "end_reward": sum(r["reward_mean"] for r in records[-k:]) / k if k else None,
        "wall_s": end - start,
        "trained_tokens": sum(r.get("tokens", 0) for r in records),
        "trained_tokens_per_s": sum(r.get("tokens", 0) for r in records) / max(end - start, 1e-9),
        "staleness_max": max((r["staleness_max"] for r in records), default=0),
        **extra,
    }
    (rdir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def run_all(cfg: Config, config_path: str | None = None) -> int:
    from asyncrl.buffer import ReplayBuffer
    from asyncrl.buffer.embedded import EmbeddedRedis
    from asyncrl.tinymodel import resolve_model_path

    start = time.time()
    rdir = run_dir(cfg).resolve()
    if (rdir / "summary.json").exists():
        from asyncrl.config import ConfigError

        raise ConfigError(
            f"run dir {rdir} holds a finished run (summary.json); choose another run.name=... or remove the dir "
            "(an interrupted run, without summary.json, is resumed from its last checkpoint instead)"
        )
    rdir.mkdir(parents=True, exist_ok=True)
    resume = (rdir / "checkpoints").exists() and any((rdir / "checkpoints").iterdir())
    cfg_path = rdir / "config.yaml"
    cfg_path.write_text(to_yaml(cfg))
    resolve_model_path(cfg, rdir)  # build once here, before two roles race to build it
    stop = threading.Event()
    prev_handlers = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    redis_srv = None
    learner = None
    pool = None
    progress = Progress(cfg.run.progress, cfg.run.max_steps)
    extra: dict = {}
    try:
        if cfg.redis.url:
            url = cfg.redis.url
        else:
            redis_srv = EmbeddedRedis(rdir / "redis", password=cfg.redis.password or None,
                                      appendfsync=cfg.redis.appendfsync).start()  # fmt: skip
            url = redis_srv.url
            (rdir / "redis.url").write_text(url)
        cfg.redis.url = url
        learner = start_learner_process(cfg_path, url, start, resume=resume, log_path=rdir / "learner.log",
                                        threads=learner_threads(cfg))  # fmt: skip
        from asyncrl.actors.pool import ActorPool

        pool = ActorPool(cfg, rdir, redis_url=url)
        pool.start()
        buf = ReplayBuffer.from_config(cfg, url)
        metrics_path = rdir / "metrics.jsonl"
        while not stop.is_set():
            if learner.poll() is not None:
                break
            if cfg.run.max_wall_s and time.time() - start > cfg.run.max_wall_s:
                break
            progress.update(read_jsonl(metrics_path), time.time() - start)
            write_targets(rdir, cfg.run.name, buf.learner_status(), buf.actors())
            stop.wait(1.0)
        extra["actors"] = {k: {kk: vv for kk, vv in v.items() if isinstance(vv, int | float | str)}
                           for k, v in buf.actors().items()}  # fmt: skip
        extra["buffer"] = buf.stats()
        buf.close()
    finally:
        progress.close()
        if pool is not None:
            pool.stop()
        rc = stop_process(learner) if learner is not None else 0
        if redis_srv is not None:
            redis_srv.stop()
            (rdir / "redis.url").unlink(missing_ok=True)
        for s, h in prev_handlers.items():
            signal.signal(s, h)
    end = time.time()
    records = read_jsonl(rdir / "metrics.jsonl")
    extra["learner_exit_code"] = rc
    summary = write_summary(rdir, records, start, end, extra)
    print(f"run dir: {rdir}\nsteps {summary['steps']}  reward {summary['start_reward']} -> {summary['end_reward']}  "
          f"wall {summary['wall_s']:.0f}s")  # fmt: skip
    if rc not in (0, -signal.SIGTERM):
        print(f"learner exited with code {rc}; see {rdir / 'learner.log'}", file=sys.stderr)
        return 1
    return 0
