"""`asyncrl plan` against reality: three real `asyncrl run`s on this machine at max_staleness 0, 1, 4.

Each run is predicted from its own components (asyncrl.plan.calibrate.calibrate_run), because on
this shared 2-core box identical runs differ by up to 30% in engine and learner speed:

* measured from the run's metrics.jsonl: the learner's wall seconds per trained token, per step,
  per publish and per checkpoint (co-location included) and, replayed in step order, each step's
  busy time over that mean (a learner slowed mid-run by another process stays slow there); the
  completion length;
* measured from the actors' timelines (logs/<actor>.timeline.jsonl): the hand-offs (swap pause
  and latency, idle and while decoding; a group's start and write; the admission wake-ups, by a
  publish's hint or by the engine's swap);
* fitted, the one fit: the engine's per-sequence step cost, to the measured mean decode time of a
  group (submission to last token, less swap pauses): a component's latency, not an output;
* from config.yaml: the pipeline's shape (actors, concurrency, G, groups per step, eta, policies).

Predicted, never fitted, at every eta: trained tokens/s and samples/s (which groups are dropped as
too stale, how long workers wait for admission, how learner and engines overlap) and the staleness
of the trained tokens. The earlier scheme (engine cost fitted to the eta=0 run's tok/s, co-location
factors to the eta=4 run's, one model for all three) predicted eta=1 tok/s 18-65% too high on 7 of
12 attempts: the eta=1 run's engine was as slow as the eta=4 run's while the model slowed it only
while the learner worked, and identical runs differ in engine and learner speed by more than 15%.
"""

from __future__ import annotations

import json
import subprocess
import uuid

import pytest

from asyncrl.plan import simulate
from asyncrl.plan.calibrate import calibrate_run, measure
from tests.e2e.procs import ROOT, asyncrl_cmd, marked_env, wait_no_orphans

pytestmark = pytest.mark.slow

#: max_staleness -> learner steps. The steady-state window starts after 10% of the steps.
RUNS = {0: 40, 1: 60, 4: 80}
#: Throughput (tok/s, samples/s), every eta: the issue's 15%. On 16 attempts (48 runs; the lead's
#: README table) the errors were eta=0 +1..+4%, eta=1 -9..+11%, eta=4 -2..+9%, except two runs that
#: shared the box with CPU-heavy simulations (learner 1.5-2x slower in part of the run): +18% (eta=1)
#: and +15% (eta=4). The last four (this test, unchanged, at e3db13a+) all passed.
TOLERANCE = 0.15
#: Staleness passes within this share or STALENESS_ABS versions, not 15%: in a generation-bound run
#: the mean staleness is the share of a batch sampled before the last swap, set by sub-step timing
#: (which of a step's groups made which vLLM step, 5-token completions) that drifts within a run
#: (eta=4: 1.1 over its first quarter, 1.9 over its last) and between identical runs (eta=1
#: 0.57-0.86, eta=4 1.23-1.88 on a quiet box). The simulator is as sensitive to it: over the same
#: attempts its errors reached 0.34 versions (60%) at eta=1 and 0.47 (16%) at eta=4 with throughput
#: within 9%; with the actors' swap wake-up (e3db13a+) its deterministic engine locks into exactly
#: 0.50 at eta=1 where the runs measured 0.59-0.69 (-16..-28%). Per-step decode jitter (cv 0.15-0.3,
#: tried) breaks that lock but moved eta=1 tok/s by up to 14%: not adopted. A wrong regime
#: (learner-bound ~eta vs generation-bound < 1) is still far outside.
STALENESS_TOLERANCE = 0.25
STALENESS_ABS = 0.5


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plan-validation")
    marker = uuid.uuid4().hex
    dirs = {}
    for eta, steps in RUNS.items():
        rdir = tmp / f"s{eta}"
        log = tmp / f"s{eta}.log"
        cmd = asyncrl_cmd("run", "--config", str(ROOT / "configs" / "default.yaml"), f"run.dir={rdir}",
                          f"run.name=plan-s{eta}-{marker[:8]}", f"run.max_steps={steps}", "run.max_wall_s=400",
                          f"buffer.max_staleness={eta}", "run.progress=false")  # fmt: skip
        with log.open("wb") as out:
            rc = subprocess.run(cmd, cwd=tmp, env=marked_env(marker), stdout=out, stderr=subprocess.STDOUT,
                                timeout=600).returncode  # fmt: skip
        assert rc == 0, log.read_text()[-4000:]
        dirs[eta] = rdir
    assert not wait_no_orphans(marker)
    return dirs


def test_simulator_predicts_throughput_and_staleness_of_real_runs(real_runs) -> None:
    rows, inputs = [], {}
    for eta in RUNS:
        m = measure(real_runs[eta])
        assert m.staleness_max <= eta
        p, sources = calibrate_run(real_runs[eta])
        # The hand-offs and the engine come from the actors' timeline: the actor writes it, the planner reads it.
        # (At eta=0 every group waits for its engine's swap: none is admitted at its first try.)
        for key in ("swap_s", "swap_latency_s", "group_overhead_s") + (("group_start_s",) if eta else ()):
            assert sources[key].startswith("measured"), (eta, key, sources[key])
        assert sources["gen_token_s"].startswith("fitted to the measured group decode time"), sources
        r = simulate(p)
        rows.append({"eta": eta, "tok/s": (round(r.tokens_per_s), round(m.tokens_per_s)),
                     "samples/s": (round(r.samples_per_s, 1), round(m.samples_per_s, 1)),
                     "staleness": (round(r.staleness_mean, 3), round(m.staleness_mean, 3)),
                     "learner idle": (round(r.learner_idle_frac, 3), round(m.learner_idle_frac, 3))})  # fmt: skip
        inputs[eta] = {k: getattr(p, k) for k in ("gen_token_s", "learner_token_s", "learner_step_s", "publish_s",
                                                  "swap_s", "swap_running_extra_s", "swap_latency_s",
                                                  "swap_latency_running_extra_s", "group_overhead_s",
                                                  "group_start_s", "admission_wake_s", "swap_wakes_admission")}  # fmt: skip
    report = json.dumps({"rows (predicted, measured)": rows, "inputs": inputs}, indent=1)
    print(report)
    for row in rows:
        for key in ("tok/s", "samples/s"):
            pred, real = row[key]
            assert pred == pytest.approx(real, rel=TOLERANCE), f"eta={row['eta']} {key}: {report}"
        pred, real = row["staleness"]
        if row["eta"] == 0:
            assert pred == real == 0, report  # exactly synchronous, in both
        else:
            assert abs(pred - real) <= max(STALENESS_TOLERANCE * real, STALENESS_ABS), (
                f"eta={row['eta']} staleness: {report}"
            )
