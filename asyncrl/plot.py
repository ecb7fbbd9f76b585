"""`asyncrl plot RUN_DIR`: the curves of a run from its metrics.jsonl, as one PNG."""

from __future__ import annotations

from pathlib import Path

from asyncrl.learner.records import read_jsonl


def load_records(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}")
    return read_jsonl(path)


def eval_points(recs: list[dict]) -> list[tuple[float, float, int]]:
    """(time, eval reward, evaluated version) at each record where a new periodic eval arrived."""
    out, seen = [], -1
    for r in recs:
        v = int(r.get("eval_version", -1))
        if v >= 0 and v != seen:
            seen = v
            out.append((r["time"], r["eval_reward_mean"], v))
    return out


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = load_records(run_dir)
    if not recs:
        raise ValueError(f"{run_dir}/metrics.jsonl has no steps yet")
    t = [r["time"] for r in recs]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(t, [r["reward_mean"] for r in recs], marker=".", label="train")
    evals = eval_points(recs)
    if evals:
        axes[0].plot([e[0] for e in evals], [e[1] for e in evals], marker="o", label="eval (held out)")
        axes[0].legend()
    axes[0].set(xlabel="wall time since start (s)", ylabel="mean reward", title="reward")
    axes[1].plot([r["step"] for r in recs], [r["staleness_mean"] for r in recs], label="mean")
    axes[1].plot([r["step"] for r in recs], [r["staleness_max"] for r in recs], label="max")
    axes[1].set(xlabel="learner step", ylabel="V - v_t", title="staleness")
    axes[1].legend()
    axes[2].plot([r["step"] for r in recs], [r["rollout_kl"] for r in recs], label="rollout KL")
    axes[2].plot([r["step"] for r in recs], [r["mismatch_kl"] for r in recs], label="mismatch KL")
    axes[2].set(xlabel="learner step", ylabel="k2 KL (nats)", title="off-policy health")
    axes[2].legend()
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(f"{Path(run_dir).name}: {len(recs)} steps")
    fig.tight_layout()
    out = Path(out) if out else Path(run_dir) / "curve.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
