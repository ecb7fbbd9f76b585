"""The learner step's fast paths equal the slow, obvious computations they replaced (issue 14).

Each fast path (batched metric reduction, one host transfer per micro-batch, foreach gradient norm
and clip, numpy collate, stacked group advantages) is checked against a plain loop on random inputs,
in float64 where the metric math is concerned, including masked garbage (-inf / NaN) and empty masks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from asyncrl.learner.batching import LOSS_MASK, Sample, collate
from asyncrl.learner.engine import GuardedAdamW, grad_norms
from asyncrl.learner.objectives import SIDE_METRICS, group_advantages
from asyncrl.learner.objectives.diagnostics import policy_metrics
from asyncrl.learner.step import MicroBatchResult, advantage_lists, loss_tokens

VERSION = 7


def _loop_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    vals = [float(v) for v, m in zip(x.flatten(), mask.flatten(), strict=True) if m]
    return sum(vals) / max(len(vals), 1)


def _loop_max(x: torch.Tensor, mask: torch.Tensor) -> float:
    vals = [float(v) for v, m in zip(x.flatten(), mask.flatten(), strict=True) if m]
    return max(vals) if vals else 0.0


def _reference_metrics(logp, behav, prox, ratio, w, w_raw, sides, loss_mask, in_mask, versions) -> dict:
    """One scalar at a time, from the definitions in policy_metrics' (old) per-metric code."""
    ref: dict[str, float] = {}
    b, t = loss_mask.shape
    d = [[max(-20.0, min(20.0, float(logp[i, j]) - float(behav[i, j]))) for j in range(t)] for i in range(b)]
    lr = [[max(-20.0, min(20.0, float(prox[i, j]) - float(behav[i, j]))) for j in range(t)] for i in range(b)]
    toks = [(i, j) for i in range(b) for j in range(t) if loss_mask[i, j]]
    n = len(toks)

    def mean(f) -> float:
        return sum(f(i, j) for i, j in toks) / max(n, 1)

    ref["ratio_mean"] = mean(lambda i, j: float(ratio[i, j]))
    ref["is_weight_mean"] = mean(lambda i, j: float(w[i, j]))
    ref["is_weight_sq_mean"] = mean(lambda i, j: float(w[i, j]) ** 2)
    ref["is_weight_max"] = _loop_max(w, loss_mask)
    m, m2 = ref["is_weight_mean"], ref["is_weight_sq_mean"]
    ref["ess"] = m * m / m2 if m2 > 0 else 0.0
    ref["is_trunc_frac"] = mean(lambda i, j: float(0 < float(w[i, j]) < float(w_raw[i, j])))
    ref["is_masked_frac"] = mean(lambda i, j: float(float(w[i, j]) == 0))
    ref["is_chi2"] = mean(lambda i, j: math.exp(lr[i][j]) ** 2 - 1)
    seqs = [i for i in range(b) if loss_mask[i].any()]
    seq_rho = {
        i: math.exp(max(-20.0, min(20.0, sum(lr[i][j] for j in range(t) if loss_mask[i, j])))) for i in seqs
    }
    ref["is_chi2_seq"] = sum(seq_rho[i] ** 2 - 1 for i in seqs) / max(len(seqs), 1)
    stale = (VERSION - versions).to(torch.float64)
    ref["staleness_mean"] = _loop_mean(stale, in_mask)
    ref["staleness_max"] = _loop_max(stale, in_mask)
    ref["stale_dropped_frac"] = _loop_mean((in_mask & ~loss_mask).double(), in_mask)
    ref["num_tokens"], ref["num_tokens_in"], ref["num_seqs"] = n, int(in_mask.sum()), len(seqs)
    ref["kl_mu_pi_k1"] = mean(lambda i, j: -d[i][j])
    ref["kl_mu_pi_k2"] = mean(lambda i, j: d[i][j] ** 2 / 2)
    ref["kl_mu_pi_k3"] = mean(lambda i, j: math.expm1(d[i][j]) - d[i][j])
    ref["kl_pi_mu_is"] = mean(lambda i, j: d[i][j] * math.exp(d[i][j]) - math.expm1(d[i][j]))
    for k in SIDE_METRICS:
        ref[k] = mean(lambda i, j, k=k: float(sides[k][i, j])) if k in sides else 0.0
    ref["dppo_masked_frac"] = ref["dppo_masked_frac_low"] + ref["dppo_masked_frac_high"]
    ref["clip_frac"] = ref["clip_frac_low"] + ref["clip_frac_high"]
    return ref


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shape", [(1, 1), (4, 6), (3, 9)])
@pytest.mark.parametrize("side_keys", [("dppo_masked_frac_low", "dppo_masked_frac_high", "dual_clip_frac"),
                                       ("clip_frac_low", "clip_frac_high"), ()])  # fmt: skip
def test_policy_metrics_batched_reduction_equals_loop_reference(seed, shape, side_keys) -> None:
    g = torch.Generator().manual_seed(seed)
    b, t = shape
    f64 = torch.float64
    behav = torch.log(torch.rand(b, t, generator=g, dtype=f64).clamp(min=1e-4))
    logp = (behav + 1.5 * torch.randn(b, t, generator=g, dtype=f64)).clamp(max=0.0)
    prox = (behav + torch.randn(b, t, generator=g, dtype=f64)).clamp(max=0.0)
    in_mask = torch.rand(b, t, generator=g) < 0.8
    versions = torch.randint(VERSION - 3, VERSION + 1, (b, t), generator=g)
    loss_mask = in_mask & ((VERSION - versions) <= 2)
    # Garbage off the loss mask (as a log_softmax of padding can give): must not reach any metric.
    logp = torch.where(loss_mask, logp, torch.tensor(float("-inf"), dtype=f64))
    w_raw = torch.exp((prox - behav).clamp(-20, 20))
    w = torch.where(torch.rand(b, t, generator=g) < 0.2, torch.zeros_like(w_raw), w_raw.clamp(max=2.0))
    ratio = torch.where(loss_mask, torch.exp(torch.randn(b, t, generator=g, dtype=f64)), torch.nan)
    sides = {k: torch.rand(b, t, generator=g) < 0.3 for k in side_keys}
    got = policy_metrics(logp=logp, logp_behav=behav, logp_prox=prox, ratio=ratio, w=w, w_raw=w_raw, sides=sides,
                         loss_mask=loss_mask, in_mask=in_mask, token_versions=versions, version=VERSION)  # fmt: skip
    ref = _reference_metrics(logp, behav, prox, ratio, w, w_raw, sides, loss_mask, in_mask, versions)
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert got[k].dtype == f64 and got[k].shape == (), k
        assert float(got[k]) == pytest.approx(v, rel=1e-12, abs=1e-12), (k, float(got[k]), v)


def test_policy_metrics_empty_mask_all_zero() -> None:
    z = torch.zeros(2, 3)
    none = torch.zeros(2, 3, dtype=torch.bool)
    got = policy_metrics(logp=z - math.inf, logp_behav=z, logp_prox=z, ratio=z + math.nan, w=z + 1, w_raw=z + 1,
                         sides={}, loss_mask=none, in_mask=none, token_versions=z.long(), version=0)  # fmt: skip
    assert all(float(v) == 0.0 for v in got.values()), got


def test_to_host_is_one_transfer_with_the_values_float_would_give() -> None:
    g = torch.Generator().manual_seed(3)
    metrics = {f"m{i}": torch.randn((), generator=g) for i in range(5)}
    terms = {"loss_policy": torch.randn((), generator=g, dtype=torch.float64)}  # mixed dtypes promote exactly
    sums = {"entropy_sum": torch.randn((), generator=g), "drift_n/0": torch.tensor(12.0)}
    loss = torch.tensor(float("nan"))
    got = MicroBatchResult(loss, terms, metrics, sums).to_host()
    assert math.isnan(got[0])
    assert got[1] == {k: float(v) for k, v in metrics.items()} and list(got[1]) == list(metrics)
    assert got[2] == {k: float(v) for k, v in terms.items()}
    assert got[3] == {k: float(v) for k, v in sums.items()}
    empty = MicroBatchResult(torch.tensor(2.5), {}, {}, {}).to_host()
    assert empty == (2.5, {}, {}, {})


def test_grad_norms_equal_the_per_tensor_loop() -> None:
    g = torch.Generator().manual_seed(4)
    grads = [torch.randn(s, generator=g) for s in [(3, 5), (7,), (2, 2, 2), (1,)]]
    assert [x.item() for x in grad_norms(grads)] == [torch.linalg.vector_norm(x).item() for x in grads]
    mixed = [grads[0].bfloat16(), grads[1]]
    assert [x.item() for x in grad_norms(mixed)] == [
        torch.linalg.vector_norm(x.float()).item() for x in mixed
    ]


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(4, 3), (5,), (2, 6)]]
    for p in ps:
        p.grad = 3.0 * torch.randn(p.shape, generator=g)
    return ps


@pytest.mark.parametrize("clip", [0.0, 0.5, 1e6])
def test_guarded_step_equals_clip_grad_norm_then_adamw_bitwise(clip) -> None:
    mine, ref = _params(5), _params(5)
    opt = GuardedAdamW(mine, lr=1e-2, check_grads=True, clip=clip, foreach=False)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, foreach=False)
    opt.step()
    norm = torch.nn.utils.clip_grad_norm_(ref, clip if clip > 0 else math.inf, foreach=False)
    ref_opt.step()
    assert opt.stepped and opt.last_grad_norm == pytest.approx(float(norm), rel=1e-6)
    for a, b in zip(mine, ref, strict=True):
        assert torch.equal(a, b)


def test_guarded_step_skips_a_nonfinite_gradient_and_leaves_weights_bitwise() -> None:
    ps = _params(6)
    before = [p.detach().clone() for p in ps]
    ps[1].grad[2] = float("inf")
    opt = GuardedAdamW(ps, lr=1e-2, check_grads=True, clip=1.0, foreach=False)
    opt.step()
    assert not opt.stepped and math.isinf(opt.last_grad_norm) and not opt.state
    assert all(torch.equal(p, q) for p, q in zip(ps, before, strict=True))


def _slow_collate(samples: list[Sample], indices: list[int], pad_id: int) -> dict[str, list]:
    rows = [samples[i] for i in indices]
    length = max(s.length for s in rows)
    out: dict[str, list] = {
        k: [] for k in ("input_ids", "attention_mask", LOSS_MASK, "logp_behav", "token_versions")
    }
    for s in rows:
        p, n = s.prompt_len, s.length
        tail = [0] * (length - n)
        out["input_ids"].append(s.input_ids.tolist() + [pad_id] * (length - n))
        out["attention_mask"].append([1] * n + tail)
        out[LOSS_MASK].append([False] * p + s.loss_mask.tolist() + [False] * (length - n))
        out["logp_behav"].append([0.0] * p + s.logp_behav.tolist() + [0.0] * (length - n))
        out["token_versions"].append([0] * p + s.versions.tolist() + tail)
    return out


def test_collate_equals_a_slow_reference_on_random_ragged_samples() -> None:
    rng = np.random.default_rng(7)
    samples = []
    for i in range(6):
        p, n = int(rng.integers(1, 5)), int(rng.integers(1, 7))
        samples.append(Sample(group_index=0, completion_index=i, input_ids=rng.integers(1, 50, p + n),
                              prompt_len=p, logp_behav=-rng.random(n).astype(np.float32),
                              versions=rng.integers(0, 4, n), loss_mask=rng.random(n) < 0.7,
                              advantage=float(rng.normal()), temperature=0.5 + i))  # fmt: skip
    idx = [4, 0, 5, 2]
    mb = collate(samples, idx, pad_id=99)
    ref = _slow_collate(samples, idx, 99)
    dtypes = {"input_ids": torch.int64, "attention_mask": torch.int64, LOSS_MASK: torch.bool,
              "logp_behav": torch.float32, "token_versions": torch.int64}  # fmt: skip
    for k, v in ref.items():
        assert mb[k].dtype == dtypes[k] and mb[k].tolist() == v, k
    assert mb["advantages"].tolist() == [float(np.float32(samples[i].advantage)) for i in idx]
    assert mb["temperature"].tolist() == [samples[i].temperature for i in idx]


@pytest.mark.parametrize("normalize_std", [True, False])
def test_stacked_group_advantages_equal_one_call_per_group(normalize_std) -> None:
    rng = np.random.default_rng(8)
    equal = [rng.integers(0, 2, 8).astype(float).tolist() for _ in range(5)] + [[1.0] * 8]
    # float64 rewards in, float64 advantages out (advantage_lists: fp32 rewards rounded 1e8 + 1 to 1e8).
    per_group = [
        group_advantages(torch.tensor(r, dtype=torch.float64), normalize_std).tolist() for r in equal
    ]
    assert advantage_lists(equal, normalize_std) == per_group
    ragged = [[1.0, 0.0, 1.0], [0.5], [0.0, 1.0]]
    expect = [group_advantages(torch.tensor(r, dtype=torch.float64), normalize_std).tolist() for r in ragged]
    assert advantage_lists(ragged, normalize_std) == expect
    assert advantage_lists([], normalize_std) == []
    # Rewards that fp32 cannot tell apart still get their advantages (a float64 reference by hand).
    big = advantage_lists([[1e8, 1e8 + 1.0]], normalize_std)[0]
    want = [-0.5, 0.5] if not normalize_std else [-0.5 / (0.5**0.5 + 1e-6), 0.5 / (0.5**0.5 + 1e-6)]
    assert big == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_tokens_equal_the_per_sample_loop(seed) -> None:
    """One pass over the step's tokens = per sample: mask & (V - v <= eta), its sum, np.unique of V - v."""
    rng = np.random.default_rng(seed)
    version, max_staleness = 9, 2
    samples = []
    for i in range(int(rng.integers(1, 12))):
        n = int(rng.integers(1, 9))
        mask = rng.random(n) < 0.8
        if i % 4 == 3:
            mask[:] = False  # overlong-masked
        samples.append(Sample(group_index=0, completion_index=i, input_ids=np.zeros(n + 2, np.int64), prompt_len=2,
                              logp_behav=np.zeros(n, np.float32), versions=rng.integers(5, 11, n).astype(np.int64),
                              loss_mask=mask, advantage=0.0, temperature=1.0))  # fmt: skip
    per, hist = loss_tokens(samples, version, max_staleness)
    masks = [s.loss_mask & ((version - s.versions) <= max_staleness) for s in samples]
    assert per == [int(m.sum()) for m in masks]
    stale = np.concatenate([version - s.versions[m] for s, m in zip(samples, masks, strict=True)])
    vals, counts = np.unique(stale, return_counts=True)
    assert hist == {str(v): int(c) for v, c in zip(vals.tolist(), counts.tolist(), strict=True)}
    assert list(hist) == sorted(hist, key=int) and loss_tokens([], version, max_staleness) == ([], {})
