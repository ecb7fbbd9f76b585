"""`asyncrl plot RUN_DIR`: the curves of a run from its metrics.jsonl, as one PNG."""

from __future__ import annotations

from pathlib import Path

from asyncrl.config import ConfigError
from asyncrl.learner.records import read_jsonl


def load_records(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}")
    return read_jsonl(path)


def _num(r: dict, key: str) -> float:
    """A plotted field as a float: metrics.jsonl writes a non-finite value as a string ("nan", "inf"),
    which would turn matplotlib's axis categorical; as a float NaN it leaves a gap in the line."""
    return float(r.get(key, "nan"))


#: Two records whose session start (step_time - time) differs by more than this came from different
#: learner processes (a resume): each restarts ``time`` at 0.
SESSION_GAP_S = 1.0


def running_time(recs: list[dict]) -> list[float]:
    """Seconds the run has been running at each record, summed over its sessions.

    A record's ``time`` counts from its own ``asyncrl run``/``learn`` start, so after a resume it starts
    again near 0 and a curve against it folds back over itself. Each session's times are shifted to
    begin where the previous session's last record ended (the downtime between sessions is left out).
    A session is told by its start, ``step_time - time``; records without ``step_time`` by ``time``
    going backwards.
    """
    out: list[float] = []
    offset, prev_start, prev_t = 0.0, None, None
    for r in recs:
        t = _num(r, "time")
        st = r.get("step_time")
        start = float(st) - t if st is not None else None
        if prev_t is not None:
            new_session = (
                abs(start - prev_start) > SESSION_GAP_S
                if start is not None and prev_start is not None
                else t < prev_t
            )
            if new_session:
                offset = out[-1]
        out.append(offset + t)
        prev_start, prev_t = start, t
    return out


def eval_points(recs: list[dict]) -> list[tuple[float, float, int]]:
    """(running time, eval reward, evaluated version) at each record where a new periodic eval arrived."""
    out, seen = [], -1
    for r, t in zip(recs, running_time(recs), strict=True):
        v = int(r.get("eval_version", -1))
        if v >= 0 and v != seen:
            seen = v
            out.append((t, _num(r, "eval_reward_mean"), v))
    return out


def series(recs: list[dict]) -> dict[str, tuple[list[float], list[float]]]:
    """The (x, y) points of every plotted line, as floats (NaN where a step has no finite value).

    ``mismatch_kl`` leaves out the steps that measured nothing: with no staleness-0 token under the loss
    the learner writes mismatch_kl=0.0, mismatch_tokens=0 (learner/step.py _drift_split), which would
    draw as a (false) zero. Records from before mismatch_tokens existed keep every point.
    """
    t = running_time(recs)
    steps = [_num(r, "step") for r in recs]
    measured = [r for r in recs if float(r.get("mismatch_tokens", 1)) > 0]
    return {
        "reward": (t, [_num(r, "reward_mean") for r in recs]),
        "staleness_mean": (steps, [_num(r, "staleness_mean") for r in recs]),
        "staleness_max": (steps, [_num(r, "staleness_max") for r in recs]),
        "rollout_kl": (steps, [_num(r, "rollout_kl") for r in recs]),
        "mismatch_kl": ([_num(r, "step") for r in measured], [_num(r, "mismatch_kl") for r in measured]),
    }


def _pyplot():
    """pyplot on the file-only Agg backend (chosen before pyplot's first import; no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    plt = _pyplot()
    recs = load_records(run_dir)
    if not recs:  # a user's input (a run that has not trained yet): one error line from the CLI, exit 2
        raise ConfigError(f"{run_dir}/metrics.jsonl has no steps yet")
    fig = figure(recs, Path(run_dir).name)
    out = Path(out) if out else Path(run_dir) / "curve.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def figure(recs: list[dict], name: str):  # -> matplotlib Figure (not imported at module level)
    """The three panels (reward, staleness, KL) of a run's step records."""
    plt = _pyplot()
    s = series(recs)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(*s["reward"], marker=".", label="train")
    evals = eval_points(recs)
    if evals:
        axes[0].plot([e[0] for e in evals], [e[1] for e in evals], marker="o", label="eval (held out)")
        axes[0].legend()
    axes[0].set(xlabel="running time, summed over resumes (s)", ylabel="mean reward", title="reward")
    axes[1].plot(*s["staleness_mean"], label="mean")
    axes[1].plot(*s["staleness_max"], label="max")
    axes[1].set(xlabel="learner step", ylabel="V - v_t", title="staleness")
    axes[1].legend()
    # Both are the k3 estimate e^d - 1 - d (d = log pi - log mu) of KL(mu || pi): rollout_kl against the
    # trained policy (kl_mu_pi_k3), mismatch_kl against the learner at the engine's own version.
    axes[2].plot(*s["rollout_kl"], label="rollout KL(mu || pi_theta)")
    axes[2].plot(*s["mismatch_kl"], marker=".", label="mismatch KL, engine vs learner (s=0)")
    axes[2].set(xlabel="learner step", ylabel="KL(mu || pi), k3 estimate (nats)", title="off-policy health")
    axes[2].legend()
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(f"{name}: {len(recs)} steps")
    fig.tight_layout()
    return fig
