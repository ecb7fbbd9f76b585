"""`asyncrl status`: a one-screen summary of a run, read from its Redis while it is up; once it has
ended (its embedded Redis gone with it), from the ``summary.json`` that `asyncrl run` (or, split roles,
`asyncrl learn`) left in its run dir."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from asyncrl.buffer.registry import LEARNER_HEARTBEAT_S, LEARNER_SILENT_S
from asyncrl.config import Config, ConfigError

#: A status is a glance: a run whose Redis is gone (crashed, stopped) must say so in seconds, not after
#: the roles' patient defaults (a learner rides out a Redis restart for redis.retry_budget_s).
STATUS_SOCKET_TIMEOUT_S = 5.0
STATUS_RETRY_BUDGET_S = 2.0


def groups_per_version(cfg: Config) -> int:
    """Groups admission lets in per policy version: the learner consumes ``groups_per_step`` groups per
    step and bumps the version every ``publish_every`` steps (ReplayBuffer.from_config sizes admission
    this way; the status test checks the two agree)."""
    return cfg.buffer.groups_per_step * cfg.learner.publish_every


class RunNotUp(ConfigError):
    """No Redis answers at the run's URL (refused, unreachable): the run is not up."""


def restart_advice(embedded: bool) -> str:
    """How to start a run that is not up again: `asyncrl run` for its embedded Redis (the URL came from the
    run dir's redis.url); with a Redis of the user's own, the command that ran it, split roles included
    (before: always `asyncrl run`, the wrong advice for `asyncrl learn` + `serve-actors`)."""
    if embedded:
        return ("A run that crashed or was killed leaves its <run dir>/redis.url behind; start it again "
                "(asyncrl run) to see its status")  # fmt: skip
    return ("Start that Redis again (it holds the run's buffer), then resume the run with the command that "
            "ran it and the same config and redis.url: asyncrl run, or for split roles asyncrl learn --resume "
            "and asyncrl serve-actors")  # fmt: skip


def collect_status(cfg: Config, url: str, embedded: bool = False) -> dict:
    """The run's buffer, actors and learner from its Redis; ConfigError if that Redis does not answer
    (:class:`RunNotUp` if none is there; ``embedded``: the URL is the run's own redis.url file)."""
    import redis

    from asyncrl.buffer import ReplayBuffer

    try:
        buf = ReplayBuffer.from_config(
            cfg, url, socket_timeout=STATUS_SOCKET_TIMEOUT_S, retry_budget_s=STATUS_RETRY_BUDGET_S
        )
        try:
            stats = buf.stats()
            # The bound of the buffer built from the config, i.e. the one admission enforces (per-version
            # group count and adaptive staleness bound included), not one recomputed from groups_per_step.
            stats["bound"] = buf.admission_bound()
            return {"buffer": stats, "actors": buf.actors(), "learner": buf.learner_status()}
        finally:
            buf.close()
    except redis.TimeoutError as e:
        from asyncrl.launch import redact_url  # the URL may carry the Redis password

        # Connected, then no reply: a server that exists but is frozen (SIGSTOP) or overloaded. The run's
        # roles may well be alive and riding it out: starting the run again is the wrong advice here.
        raise ConfigError(
            f"Redis at {redact_url(url)} accepted the connection but did not answer within "
            f"{STATUS_SOCKET_TIMEOUT_S:g} s ({e}): it is frozen or overloaded, and run {cfg.run.name}'s roles may "
            f"still be running and retrying; check the redis-server process (a stopped one: kill -CONT) before "
            f"starting anything again"
        ) from None
    except redis.ConnectionError as e:
        from asyncrl.launch import redact_url  # the URL may carry the Redis password

        raise RunNotUp(
            f"no Redis answers at {redact_url(url)} ({e}): run {cfg.run.name} is not up. {restart_advice(embedded)}"
        ) from None


def format_status(cfg: Config, st: dict, now: float | None = None) -> str:
    now = now or time.time()
    b = st["buffer"]
    eta = b.get("staleness_bound")
    adaptive = f", adaptive bound {eta}" if eta is not None and eta < cfg.buffer.max_staleness else ""
    per_version = (
        f"{groups_per_version(cfg)} groups per version = groups_per_step {cfg.buffer.groups_per_step}"
        f" x publish_every {cfg.learner.publish_every}"
    )
    lines = [
        f"run {cfg.run.name}   policy version v{b.get('version', 0)}",
        f"buffer   depth {b.get('depth', 0)}   pending {b.get('pending', 0)}   dead letters {b.get('dead', 0)}",
        f"admission admitted {b.get('admitted', 0)} / bound {b.get('bound', 0)}   credits {b.get('credits', 0)}"
        f"   (max_staleness {cfg.buffer.max_staleness}{adaptive}; {per_version})",
    ]
    ln = st["learner"] or {}
    if ln:
        # "updated" is the registry's unix stamp; the learner's own "time" counts from its start.
        # Last seen: its newest write, a state change ("updated") or its heartbeat thread's "alive".
        stamps = [float(ln[k]) for k in ("updated", "alive") if k in ln]
        seen = f"{now - max(stamps):.0f}s ago" if stamps else "?"
        silent = ""
        if stamps and ln.get("state") != "stopped" and now - max(stamps) > LEARNER_SILENT_S:
            silent = (
                f"   SILENT: no heartbeat for {now - max(stamps):.0f}s (a live learner beats every"
                f" {LEARNER_HEARTBEAT_S:.0f}s): killed, or its process frozen"
            )
        lines.append(
            f"learner  step {ln.get('step', '?')}   version v{ln.get('version', '?')}{learner_state(ln, now)}"
            f"   last seen {seen}{silent}"
        )
    else:
        lines.append("learner  not seen")
    actors = st["actors"] or {}
    notes = {aid: actor_liveness(cfg, info, now) for aid, info in actors.items()}
    gone = sum(1 for n in notes.values() if n)
    count = f"{len(actors)}" if not gone else f"{len(actors)} seen, {len(actors) - gone} live"
    lines.append(f"actors   {count}")
    for aid, info in sorted(actors.items()):
        age = now - float(info.get("time", now))
        lines.append(
            f"  {aid:<12} v{info.get('version', '?')}  groups {info.get('groups', info.get('groups_written', '?'))}"
            f"  in flight {info.get('in_flight', '?')}  last seen {age:.0f}s ago{notes[aid]}"
        )
    return "\n".join(lines)


def actor_liveness(cfg: Config, info: dict, now: float) -> str:
    """Nothing ("") for a live actor; else why it is not counted as one. A registry entry outlives its actor (a
    kill -9 leaves it): one whose heartbeat is older than ``actors.heartbeat_timeout_s``, the age at which
    a supervisor replaces it and publishing stops waiting for it (ReplayBuffer.lagging_actors), is DEAD;
    one silent for 3 heartbeat periods (``actors.heartbeat_s``), as the learner's SILENT mark, is not
    counted either: killed, frozen, or blocked. Before, such an actor was counted live for ever."""
    if "error" in info:
        return f"   UNREADABLE: {info['error']}"
    if info.get("state") == "stopped":
        return "   stopped"
    age = now - float(info.get("time", now))
    timeout = cfg.actors.heartbeat_timeout_s
    if age > timeout:
        return (f"   DEAD: no heartbeat for {age:.0f}s > actors.heartbeat_timeout_s={timeout:g}"
                " (killed or frozen; a supervisor, asyncrl run or serve-actors, replaces it)")  # fmt: skip
    if age > 3 * cfg.actors.heartbeat_s:
        return (
            f"   SILENT: no heartbeat for {age:.0f}s (a live actor beats every {cfg.actors.heartbeat_s:g}s)"
        )
    return ""


def learner_state(ln: dict, now: float) -> str:
    """What the learner does, as it wrote it when that began: waiting for data, training a step, or
    stopped, and for how long. "last seen" alone made a live learner that waits for data look like a
    frozen one (its heartbeat thread's "alive" stamp now tells a gone one from both)."""
    state = ln.get("state")
    since = ln.get("since", ln.get("updated"))
    age = f" for {now - float(since):.0f}s" if since is not None else ""
    if state == "waiting":
        return f"   waiting for data{age}"
    if state == "training":
        step = ln.get("step")
        return f"   training step {step + 1 if isinstance(step, int) else '?'}{age}"
    if state == "stepped":
        return "   stepping"
    if state == "stopped":
        return f"   stopped{age.replace(' for ', ' ')} ago" if age else "   stopped"
    return ""


def read_summary(rdir: Path) -> dict | None:
    """The run dir's summary.json (`asyncrl run` writes it when it stops), None if there is none."""
    try:
        summary = json.loads((rdir / "summary.json").read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{rdir / 'summary.json'} cannot be read ({e})") from None
    if not isinstance(summary, dict):
        raise ConfigError(f"{rdir / 'summary.json'} holds no summary (a JSON object)")
    return summary


def _run_config(cfg: Config, rdir: Path) -> Config:
    """The run's own config.yaml (its name and run.max_steps; the command line may have set run.dir only)."""
    from asyncrl.config import load_config

    try:
        return load_config(rdir / "config.yaml", validate=False)
    except Exception:  # none, an old or a hand-edited one: the command line's config then
        return cfg


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def _num(x: object, spec: str) -> str:
    return format(x, spec) if isinstance(x, int | float) else "-"


def format_summary(cfg: Config, rdir: Path, summary: dict, now: float | None = None) -> str:
    """An ended run's summary.json as the status screen: how it ended, its steps, its last checkpoint,
    its running time, and what to do next."""
    from asyncrl.learner.records import CHECKPOINT_DIR, POINTER  # stdlib only

    now = now or time.time()
    status = summary.get("status") or ("finished" if summary.get("finished") else "?")
    ended = (rdir / "summary.json").stat().st_mtime
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ended))
    run = _run_config(cfg, rdir).run
    of = f" / {run.max_steps} (run.max_steps)" if run.max_steps else ""
    lines = [
        f"run {run.name}   {status}: not running, ended {when} ({_ago(max(now - ended, 0))} ago)"
        f"   (from {rdir / 'summary.json'})",
        f"steps    {summary.get('steps', '?')}{of}   policy version v{summary.get('final_version', '?')}",
        f"reward   {_num(summary.get('start_reward'), '.3f')} -> {_num(summary.get('end_reward'), '.3f')}"
        f"   (mean of the first and the last 3 steps)",
        f"running  {_num(summary.get('wall_s'), '.0f')} s (its last start)   trained tokens "
        f"{summary.get('trained_tokens', '?')} ({_num(summary.get('trained_tokens_per_s'), '.0f')}/s)"
        f"   staleness max {_num(summary.get('staleness_max'), 'g')}",
    ]
    try:
        latest = json.loads((rdir / CHECKPOINT_DIR / POINTER).read_text())
        lines.append(
            f"checkpoint  step {latest['step']} (v{latest['version']})   {rdir / CHECKPOINT_DIR / latest['tag']}"
        )
    except (OSError, ValueError, KeyError, TypeError):
        lines.append("checkpoint  none")
    b = summary.get("buffer")
    if isinstance(b, dict):
        lines.append(
            f"buffer   depth {b.get('depth', 0)}   pending {b.get('pending', 0)}   "
            f"dead letters {b.get('dead', 0)} (at the end)"
        )
    r = summary.get("restarts")
    if isinstance(r, dict) and (r.get("redis") or r.get("learner") or any(r.get("actors") or [])):
        lines.append(
            f"restarts redis {r.get('redis', 0)}   learner {r.get('learner', 0)}   "
            f"actors {sum(r.get('actors') or [])}"
        )
    if summary.get("error"):
        lines.append(f"error    {summary['error']}")
    if summary.get("finished"):
        lines.append(f"next     asyncrl export {rdir} OUT_DIR   or   asyncrl eval {rdir}")
    elif summary.get("started_by") == "asyncrl learn":  # split roles (asyncrl.learn_role)
        lines.append(
            "next     start `asyncrl learn --resume` (and `asyncrl serve-actors`, if stopped) with the same "
            "config and redis.url to resume it from its last checkpoint"
        )
    else:
        lines.append(
            "next     run the same `asyncrl run` command again to resume it from its last checkpoint"
        )
    return "\n".join(lines)


def ended_status(cfg: Config, rdir: Path) -> int:
    """`asyncrl status` of a run that is not up (no Redis URL to reach it): its summary.json, exit code
    as `asyncrl run` returned (0, 1 for a failed run); a ConfigError saying why there is nothing to show."""
    if not rdir.is_dir():
        raise ConfigError(
            f"no run dir {rdir}: name the run with run.name=NAME (its dir runs/NAME) or run.dir=ITS_DIR, "
            "or -c its config"
        )
    summary = read_summary(rdir)
    if summary is None:
        raise ConfigError(
            f"the run in {rdir} is not up ({rdir / 'redis.url'} missing) and has left no summary.json "
            "there: it is starting, it was killed before it could write one, or its roles run on their "
            "own (asyncrl learn / serve-actors): pass their redis.url=... to see its status"
        )
    print(format_summary(cfg, rdir, summary))
    return 1 if summary.get("status") == "failed" else 0


def _summary_of_the_last_start(rdir: Path) -> bool:
    """Does the run dir's summary.json tell how its last start ended? Not when a redis.url newer than it
    is left: a later start (a resume) was killed before writing its own, and the summary is the one
    before it (showing it read as a clean end with the old step count; the crash advice is the truth)."""
    summary, url = rdir / "summary.json", rdir / "redis.url"
    if not summary.exists():
        return False
    return not url.exists() or summary.stat().st_mtime_ns >= url.stat().st_mtime_ns


def print_status(cfg: Config, url: str | None, rdir: Path | None = None, embedded: bool = False) -> int:
    """The live status from the run's Redis at ``url``; with no URL (the run is not up), its summary.
    A run whose Redis does not answer is shown from the summary.json it left, if any (a finished split
    run's, written by `asyncrl learn`), with a line saying its Redis is not up."""
    if url is None:
        assert rdir is not None
        return ended_status(cfg, rdir)
    try:
        st = collect_status(cfg, url, embedded)
    except RunNotUp:
        if rdir is None or not _summary_of_the_last_start(rdir):
            raise
        from asyncrl.launch import redact_url  # the URL may carry the Redis password

        print(f"asyncrl status: no Redis answers at {redact_url(url)}: run {_run_config(cfg, rdir).run.name} "
              "is not up; its summary.json:", file=sys.stderr)  # fmt: skip
        return ended_status(cfg, rdir)
    print(format_status(cfg, st))
    return 0
