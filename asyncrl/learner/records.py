"""The learner's per-step record: the ONE definition of every field it reports.

One :class:`StepRecord` per learner step is appended as a JSON line to ``<run_dir>/metrics.jsonl``,
handed to every ``on_step`` callback of :func:`asyncrl.learner.loop.learn` (the Prometheus exporter
mirrors it; its keys are the snapshot keys of ``asyncrl.metrics.LEARNER_METRICS``), and its
``step``/``version``/``time`` go to the learner status hash in Redis.

Conventions: per-step values describe the step just taken; fields ending in ``_total`` and
``skipped_nonfinite`` are cumulative since the run started (they survive a resume, restored from
the checkpoint). Means over tokens are over the loss-mask tokens trained in the step.

A second file ``<run_dir>/trained.jsonl`` (the ledger) lists the group and entry ids each step
trained, with the process session id: the history of the weights, each group at most once. A resume
from the checkpoint of step ``s`` moves the lines of steps after ``s`` (work the restore discarded, to
be redone) to ``trained.discarded.jsonl``, so delivery (nothing lost, nothing twice) can be audited
across restarts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "StepRecord", "MetricsWriter", "LEDGER_FILE", "DISCARDED_FILE", "METRICS_FILE", "read_jsonl", "JsonlTail",
    "lines_from_end", "last_record",
    "CHECKPOINT_DIR", "POINTER", "committed_step",
]  # fmt: skip

#: StepRecord fields copied as is from the trainer's step metrics (asyncrl.learner.step).
OBJECTIVE_FIELDS = ("staleness_kl", "log_ppl_gap", "kl_mu_pi_k1", "kl_mu_pi_k2", "kl_mu_pi_k3", "kl_pi_mu_is",
                    "dppo_masked_frac_low", "dppo_masked_frac_high", "m2po_masked_frac", "clip_frac",
                    "clip_frac_low", "clip_frac_high", "dual_clip_frac", "is_trunc_frac", "is_masked_frac",
                    "is_chi2", "is_chi2_seq")  # fmt: skip
METRICS_FILE = "metrics.jsonl"
#: The learner's checkpoints (asyncrl.learner.checkpoint) and the pointer to the committed one; here so
#: that torch-free readers (the run supervisor) find them.
CHECKPOINT_DIR = "checkpoints"
POINTER = "latest.json"
LEDGER_FILE = "trained.jsonl"
DISCARDED_FILE = "trained.discarded.jsonl"


@dataclass
class StepRecord:
    """Everything the learner reports about one step (see the module docstring for conventions)."""

    step: int = 0  # learner steps completed (1-based after the first step)
    version: int = 0  # policy version after this step (bumped when the step published)
    time: float = 0.0  # seconds since the run's start_time
    step_time: float = 0.0  # unix time at the end of the step
    step_s: float = 0.0  # wall seconds of the step (wait + train + publish + checkpoint)
    wait_s: float = 0.0  # seconds blocked on the buffer for this step's groups
    train_s: float = 0.0  # seconds of forward/backward/optimizer work
    publish_s: float = 0.0  # seconds to gather and publish weights (0 when not published)
    # data
    groups: int = 0  # groups trained this step
    sequences: int = 0  # completions trained this step
    tokens: int = 0  # completion tokens in the loss this step
    reward_mean: float = 0.0  # mean completion reward of the trained groups
    reward_std: float = 0.0
    dropped_stale: int = 0  # groups dropped this step as staler than max_staleness (credited)
    dropped_filtered: int = 0  # groups dropped by dynamic sampling (zero reward variance, credited)
    overlong_masked: int = 0  # completions masked because they ended by length
    staleness_mean: float = 0.0  # token staleness V - v_t, mean over trained tokens
    staleness_max: float = 0.0
    staleness_hist: dict[str, int] = field(default_factory=dict)  # staleness value -> trained tokens
    # objective
    loss: float = 0.0  # total loss (sum of the terms below), mean over optimizer steps
    loss_policy: float = 0.0  # policy-gradient term (DPPO / PPO) without the rollout KL
    loss_rollout_kl: float = 0.0  # beta_rollout_kl * rollout-KL term
    loss_entropy: float = 0.0  # -entropy_coef * entropy term
    loss_ref_kl: float = 0.0  # ref_kl_coef * reference-KL term
    ratio_mean: float = 0.0  # the gradient-carrying ratio (dppo/m2po: pi_theta / pi_prox) on loss tokens
    # KL metrics are named KL(direction)_estimator, over tokens y ~ mu with d = log pi - log mu:
    mismatch_kl: float = 0.0  # KL(mu || pi_prox) (e^d - 1 - d) on staleness-0 tokens: engine vs learner
    mismatch_tokens: int = 0  # tokens mismatch_kl was measured on (0 when the weights are past V)
    staleness_kl: float = 0.0  # the same at staleness >= 1 (mismatch + staleness drift), step-start weights
    drift_kl: dict[str, float] = field(default_factory=dict)  # staleness -> KL(mu || pi_prox) at step start
    drift_tokens: int = 0  # tokens the drift split was measured on
    log_ppl_gap: float = 0.0  # train minus rollout log-perplexity (mean log mu - log pi_prox), same tokens
    rollout_kl: float = 0.0  # = kl_mu_pi_k3: unbiased KL(mu || pi_theta) on loss tokens
    kl_mu_pi_k1: float = 0.0  # mean -d: unbiased KL(mu || pi_theta), high variance
    kl_mu_pi_k2: float = 0.0  # mean d^2 / 2: second-order approximation (biased)
    kl_mu_pi_k3: float = 0.0  # mean e^d - 1 - d: unbiased KL(mu || pi_theta), >= 0
    kl_pi_mu_is: float = 0.0  # mean d e^d - (e^d - 1): unbiased KL(pi_theta || mu), >= 0
    ref_kl: float = 0.0  # mean ref-KL estimate (ref_kl_kind) on loss tokens; 0 without a reference
    dppo_masked_frac: float = 0.0  # fraction of loss tokens the DPPO trust region dropped
    dppo_masked_frac_low: float = 0.0  # ... on the A < 0 side (pi_theta fell too far below the anchor)
    dppo_masked_frac_high: float = 0.0  # ... on the A > 0 side
    m2po_masked_frac: float = 0.0  # fraction dropped by the M2PO second-moment mask
    clip_frac: float = 0.0  # ratio-clip losses: fraction of tokens whose clip is active
    clip_frac_low: float = 0.0  # ... with A < 0 (ratio below 1 - eps)
    clip_frac_high: float = 0.0  # ... with A > 0 (ratio above 1 + eps)
    dual_clip_frac: float = 0.0  # fraction of A < 0 tokens held by the ratio cap (dual_clip)
    is_weight_mean: float = 0.0  # mean importance weight (pi_prox / mu, truncated)
    is_weight_max: float = 0.0
    ess: float = 0.0  # normalised effective sample size of the IS weights, in (0, 1]
    is_trunc_frac: float = 0.0  # fraction of tokens whose IS weight was truncated
    is_masked_frac: float = 0.0  # fraction whose IS weight is 0 (icepop window, veto)
    is_chi2: float = 0.0  # chi^2(pi_prox || mu) = mean rho^2 - 1, token ratios (untruncated)
    is_chi2_seq: float = 0.0  # the same with sequence ratios, mean over sequences
    empty_mini_batches: int = 0  # mini-batches without loss tokens (no optimizer call)
    entropy: float = 0.0  # mean token entropy (nats) of the temperature-scaled policy
    grad_norm: float = 0.0  # pre-clip global gradient norm, mean over optimizer steps (inf if non-finite)
    lr: float = 0.0
    optimizer_steps: int = 0  # optimizer steps applied this step (mini_batches * epochs when none skipped)
    micro_batches: int = 0  # micro-batches run by each rank, summed over optimizer steps (incl. padding)
    padding_micro_batches: int = 0  # padding micro-batches run, summed over ranks (DP balancing)
    skipped: int = 0  # optimizer steps skipped this step for a non-finite loss or gradient
    skipped_nonfinite: int = 0  # cumulative skipped optimizer steps
    # failed attempts this step to remove stored weights (file transport: each is logged and retried after
    # the next publish, so a path that stays undeletable counts again each time; the disk fills meanwhile)
    weights_delete_failures: int = 0
    weights_delete_failures_total: int = 0  # cumulative (restored on resume)
    published: bool = False  # this step published weights (version bumped)
    checkpointed: bool = False  # a checkpoint including this step was written (and its groups acked)
    trained_group_ids: int = 0  # number of group ids trained this step (ids are in trained.jsonl)
    max_staleness: int = 0  # configured eta
    # cumulative counters (restored on resume)
    groups_total: int = 0
    tokens_total: int = 0
    wait_s_total: float = 0.0
    dropped_stale_total: int = 0
    dropped_filtered_total: int = 0
    # newest periodic eval (asyncrl.evaluate) known at this step; eval_version -1 = none yet
    eval_version: int = -1  # policy version the eval scored
    eval_reward_mean: float = 0.0  # mean reward on the eval split
    eval_pass_at_k: float = 0.0  # share of eval prompts with a completion >= eval.pass_threshold
    eval_length_mean: float = 0.0  # mean eval completion length, tokens

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict: non-finite floats become strings ("nan", "inf"), which JSON lacks."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                v = str(v)
            out[f.name] = v
        return out

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


class MetricsWriter:
    """Appends records to metrics.jsonl and the trained-groups ledger (rank 0 only)."""

    def __init__(self, run_dir: str | os.PathLike[str], session: str) -> None:
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.session = session

    def write(self, record: StepRecord) -> None:
        with open(self.dir / METRICS_FILE, "a") as f:
            f.write(json.dumps(record.to_dict(), sort_keys=True) + "\n")

    def ledger(self, step: int, version: int, group_ids: list[str], entry_ids: list[str]) -> None:
        line = {"step": step, "version": version, "session": self.session,
                "group_ids": group_ids, "entry_ids": entry_ids}  # fmt: skip
        with open(self.dir / LEDGER_FILE, "a") as f:
            f.write(json.dumps(line) + "\n")

    def truncate_after(self, step: int) -> None:
        """Drop the metrics records and ledger lines of steps > ``step`` (steps a resume discarded).

        After a crash the steps after the restored checkpoint are redone; keeping their old records
        would show two histories in one file. Discarded ledger lines are appended to
        ``trained.discarded.jsonl`` first (the audit trail, fsynced), then each file is replaced by its
        bytes up to its last line of a step <= ``step`` (copied, not parsed). Both files are appended in
        step order, so only their tails are parsed: parsing both whole held them in memory (~11 KB a
        step: 2.3 GB to resume a 200,000-step run) on every resume and learner restart. A torn last line
        (a kill mid-write) is cut too, so the next record does not start on it.
        """
        ledger = self.dir / LEDGER_FILE
        cut = _cut_after(ledger, step)
        if cut is not None:
            with open(ledger, "rb") as f:
                f.seek(cut)
                dropped = [ln for ln in f.read().split(b"\n") if _step_of(ln) is not None]
            if dropped:
                with open(self.dir / DISCARDED_FILE, "ab") as f:
                    f.write(b"".join(ln + b"\n" for ln in dropped))
                    f.flush()
                    os.fsync(f.fileno())
            _keep_head(ledger, cut)
        truncate_jsonl(self.dir / METRICS_FILE, step)

    def ledger_entries(self, after: int, upto: int) -> list[tuple[str, str]]:
        """(group id, stream entry id) pairs the ledger lists for steps ``after < step <= upto``, each once
        (read from the end back to the first line of a step <= ``after``)."""
        rows = []
        for _, line in lines_from_end(self.dir / LEDGER_FILE):
            s = _step_of(line)
            if s is not None and s <= after:
                break
            if s is not None and s <= upto:
                rows.append(json.loads(line))
        pairs = (
            p
            for r in reversed(rows)
            for p in zip(r.get("group_ids", []), r.get("entry_ids", []), strict=False)
        )
        return list(dict.fromkeys(pairs))


def lines_from_end(path: str | os.PathLike[str], block: int = 1 << 16) -> Iterator[tuple[int, bytes]]:
    """``(offset, line)`` of every line of ``path`` (without its newline), the last first, reading
    ``block`` bytes at a time from the end: a reader that wants the tail reads only the tail. A file
    ending with a newline yields an empty last line; a missing file yields nothing."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return
    with f:
        pos = f.seek(0, os.SEEK_END)
        rest = b""  # the start of a line that began in an earlier block
        while pos > 0:
            n = min(block, pos)
            pos -= n
            f.seek(pos)
            parts = (f.read(n) + rest).split(b"\n")
            rest = parts[0]
            starts, off = [], pos + len(rest) + 1
            for part in parts[1:]:
                starts.append(off)
                off += len(part) + 1
            yield from reversed(list(zip(starts, parts[1:], strict=True)))
        yield 0, rest


def _step_of(line: bytes) -> int | None:
    """The ``step`` of a complete record line (None: empty, torn or not a record)."""
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    step = rec.get("step") if isinstance(rec, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _cut_after(path: Path, step: int) -> int | None:
    """Where ``path`` (lines in step order) should end to keep only lines of steps <= ``step``: just
    past the last such line (0: none). None when nothing would be cut (or no file)."""
    size = path.stat().st_size if path.exists() else 0
    cut = 0
    for start, line in lines_from_end(path):
        s = _step_of(line)
        if s is not None and s <= step:
            cut = start + len(line) + 1
            break
    if cut > size:  # a complete record without its newline (killed between the two): keep it whole
        with open(path, "ab") as f:
            f.write(b"\n")
        return None
    return cut if cut < size else None


def _keep_head(path: Path, size: int) -> None:
    """Atomically replace ``path`` by its first ``size`` bytes (a byte copy in blocks). A replacement,
    not an in-place truncate: a reader tailing the file (JsonlTail) tells it by its new inode even
    when the redone steps have grown it past its old size by its next poll."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        left = size
        while left:
            chunk = src.read(min(left, 1 << 20))
            if not chunk:
                break
            dst.write(chunk)
            left -= len(chunk)
    os.replace(tmp, path)


def last_record(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The last complete record of a JSON-lines file (read from its end; None: none)."""
    for _, line in lines_from_end(path):
        if _step_of(line) is not None:
            return json.loads(line)
    return None


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All complete JSON lines of ``path`` (a torn last line from a kill is skipped). Holds the whole
    file: for a run's growing files (metrics.jsonl, ~5 KB a step) use :func:`iter_jsonl` or
    :func:`records_after`."""
    return list(iter_jsonl(path))


def iter_jsonl(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The complete JSON lines of ``path`` one at a time, in file order (a torn line is skipped; a
    missing file yields nothing): one line in memory at a time, whatever the run's length."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return
    with f:
        for line in f:
            try:
                yield json.loads(line)
            except ValueError:
                continue


def records_after(path: str | os.PathLike[str], step: int) -> list[dict[str, Any]]:
    """The records of steps > ``step`` of a JSON-lines file in step order (metrics.jsonl), in file
    order, read back from its end to the first record of a step <= ``step``: a resume that needs the
    last few steps reads those, not the run's whole history. Lines without a step are skipped."""
    rows = []
    for _, line in lines_from_end(path):
        s = _step_of(line)
        if s is None:
            continue
        if s <= step:
            break
        rows.append(json.loads(line))
    rows.reverse()
    return rows


def truncate_jsonl(path: str | os.PathLike[str], step: int) -> None:
    """Keep only the lines of steps <= ``step`` of a JSON-lines file in step order, and cut a torn last
    line; reads only the tail and leaves the file untouched when nothing is cut (see
    :meth:`MetricsWriter.truncate_after`)."""
    cut = _cut_after(Path(path), step)
    if cut is not None:
        _keep_head(Path(path), cut)


class JsonlTail:
    """The recent records of a JSON-lines file another process appends to, read incrementally.

    Each :meth:`poll` reads only the bytes appended since the previous one. A run's supervision loop
    polls metrics.jsonl every second for the live display; it used to re-read and re-parse the whole
    file each time, which grows ~1.7 KB per step: 6.9 MB after 4,000 demo steps (and the run process's
    RSS grew ~2 MB a minute with it), hundreds of MB in a run of days, i.e. more than a second of
    parsing per one-second pass. Invariants: a line is parsed once, when its newline has arrived (a line
    still being written waits for the next poll; an unparsable one is skipped, as :func:`read_jsonl`
    skips a torn line); a file that was replaced (``MetricsWriter.truncate_after`` on a resume) or
    shortened is read again from its start, and the records before it are dropped. ``recent`` keeps
    the records of the last ``window_s`` seconds of their ``time`` field (at least the last one, at
    most ``max_records``).
    """

    def __init__(
        self, path: str | os.PathLike[str], window_s: float = 60.0, max_records: int = 10_000
    ) -> None:
        self.path = Path(path)
        self.window_s = window_s
        self.recent: deque[dict[str, Any]] = deque(maxlen=max_records)
        self.bytes_read = 0  # since the file was (re)opened at its start
        self._file: tuple[int, int] | None = None  # (st_dev, st_ino) being followed
        self._partial = b""

    def poll(self) -> list[dict[str, Any]]:
        """The records appended since the last poll (all of them on the first poll)."""
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return []
        with f:
            st = os.fstat(f.fileno())
            if self._file != (st.st_dev, st.st_ino) or st.st_size < self.bytes_read:
                self._file, self.bytes_read, self._partial = (st.st_dev, st.st_ino), 0, b""
                self.recent.clear()
            f.seek(self.bytes_read)
            data = f.read()
        self.bytes_read += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        new = []
        for line in lines:
            try:
                new.append(json.loads(line))
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
        self.recent.extend(new)
        if self.recent:
            end = self.recent[-1].get("time", 0.0)
            while len(self.recent) > 1 and self.recent[0].get("time", end) < end - self.window_s:
                self.recent.popleft()
        return new


def committed_step(run_dir: str | os.PathLike[str]) -> int:
    """The step of ``run_dir``'s committed checkpoint (its pointer), 0 if none or unreadable.

    The learner commits a step's checkpoint before it appends the step's record, so a kill between
    the two leaves metrics.jsonl a step behind what a restart resumes from (and will not redo)."""
    try:
        return int(json.loads((Path(run_dir) / CHECKPOINT_DIR / POINTER).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0
