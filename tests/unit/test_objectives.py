"""Objective building blocks vs slow, obvious float64 reference code (tests/unit/_objective_refs.py).

Inputs are random (several seeds, shapes, masks, extreme values, -inf / NaN at masked positions);
the implementation runs on the same float64 inputs and must agree to 1e-6.
"""

from __future__ import annotations

import math

import pytest
import torch
from _objective_refs import (
    BATCHES,
    VERSION,
    adv_at,
    assert_close,
    cells,
    exact_kl,
    make_batch,
    ref_dppo,
    ref_kl,
    ref_m2po_keep,
    ref_prox,
    ref_weights,
)

from asyncrl.learner.objectives import (
    dppo_drop_masks,
    dppo_keep_mask,
    group_advantages,
    importance_weights,
    kl_penalty,
    loglinear_prox_logp,
    m2po_keep_mask,
    rollout_kl_estimates,
    staleness_mask,
)

# ---------------------------------------------------------------------------------------------
# KL: penalties and the direction/estimator-named metrics
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3"])
@pytest.mark.parametrize("batch", BATCHES[:6])
def test_kl_penalty_matches_reference(kind, batch):
    logp, logp_behav, _, _, mask, _ = make_batch(*batch)
    out = kl_penalty(logp, logp_behav, kind, mask=mask)
    ref = [[ref_kl(float(logp[b, t]), float(logp_behav[b, t]), kind) if mask[b, t] else 0.0
            for t in range(mask.shape[1])] for b in range(mask.shape[0])]  # fmt: skip
    assert_close(out, ref)


@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3"])
def test_kl_penalty_huge_differences_finite_and_masked_grad_zero(kind):
    d = torch.tensor([[-1e4, -30.0, -1.0, 0.0, 1.0, 30.0, 1e4, 0.5]], dtype=torch.float64)
    logp = (d - 1.0).clone().requires_grad_()
    ref = torch.full_like(d, -1.0)
    mask = torch.tensor([[True] * 7 + [False]])
    with torch.no_grad():
        logp[0, 7] = float("-inf")
    out = kl_penalty(logp, ref, kind, mask=mask)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(logp.grad).all()
    assert logp.grad[0, 7] == 0 and out[0, 7] == 0
    assert_close(out[0, :7], [ref_kl(float(x) - 1.0, -1.0, kind) for x in d[0, :7]])
    if kind in ("k1", "k3"):  # beyond k3's clamp (its exp) the estimate is constant: gradient 0, not inf/NaN
        assert logp.grad[0, 0] == 0 and logp.grad[0, 6] == 0 and logp.grad[0, 2] != 0
    else:  # k2 and abs have no exp and no clamp: they keep pulling (before: flat past |d| = 20)
        want = (
            [float(x) for x in d[0, :7]] if kind == "k2" else [math.copysign(1.0, float(x)) for x in d[0, :7]]
        )
        want[3] = 0.0  # d = 0: k2's gradient is 0, abs's subgradient is taken as 0
        assert logp.grad[0, :7].tolist() == want, logp.grad


@pytest.mark.parametrize("kind", ["abs", "k2"])
def test_kl_penalty_holds_sentinel_differences_finite_in_fp32(kind):
    """A logprob of -1e30 (an engine's "masked" sentinel) made the default k2 rollout-KL inf in fp32
    (d^2 overflows past |d| ~ 1.8e19) and voided the whole step. Past |d| = 1e6 the difference is
    held there: finite value, gradient 0; within it the plain difference still pulls."""
    from asyncrl.learner.objectives.kl import PENALTY_DIFF_MAX

    d = torch.tensor([[-1e30, -1e7, -1e6, -5e5, 5e5, 1e6, 1e7, 1e30]], dtype=torch.float32)
    logp = torch.zeros_like(d).requires_grad_()
    out = kl_penalty(logp, -d, kind)  # logp - ref = d
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(out.sum()) and torch.isfinite(logp.grad).all()
    held = [max(-PENALTY_DIFF_MAX, min(PENALTY_DIFF_MAX, float(x))) for x in d[0]]
    want = [0.5 * h * h if kind == "k2" else abs(h) for h in held]
    assert out[0].tolist() == pytest.approx(want, rel=1e-6)
    inside = [abs(float(x)) <= PENALTY_DIFF_MAX for x in d[0]]  # the bound itself still pulls
    for g, x, keep in zip(logp.grad[0].tolist(), d[0].tolist(), inside, strict=True):
        assert g == (pytest.approx(x if kind == "k2" else math.copysign(1.0, x)) if keep else 0.0)


@pytest.mark.parametrize(
    "mu, pi",
    [
        ([1 / 8, 3 / 8, 4 / 8], [0.2, 0.5, 0.3]),
        ([1 / 8, 1 / 8, 6 / 8], [0.6, 0.3, 0.1]),
        ([2 / 8, 2 / 8, 4 / 8], [2 / 8, 2 / 8, 4 / 8]),  # equal: every estimate is 0
    ],
)
def test_rollout_kl_metrics_estimate_the_exact_categorical_kl(mu, pi):
    """Tokens drawn from mu in exact proportion (counts 8 mu): the token means ARE the expectations."""
    counts = [round(8 * m) for m in mu]
    ys = [y for y, c in enumerate(counts) for _ in range(c)]
    logp = torch.tensor([[math.log(pi[y]) for y in ys]], dtype=torch.float64)
    logp_behav = torch.tensor([[math.log(mu[y]) for y in ys]], dtype=torch.float64)
    mask = torch.ones_like(logp, dtype=torch.bool)
    est = {k: float(v.mean()) for k, v in rollout_kl_estimates(logp, logp_behav, mask).items()}
    kl_mu_pi, kl_pi_mu = exact_kl(mu, pi), exact_kl(pi, mu)
    assert est["kl_mu_pi_k1"] == pytest.approx(kl_mu_pi, abs=1e-12)
    assert est["kl_mu_pi_k3"] == pytest.approx(kl_mu_pi, abs=1e-12)
    assert est["kl_pi_mu_is"] == pytest.approx(kl_pi_mu, abs=1e-12)
    # k2 and the old k3-over-mu-samples estimate neither direction (the bug this replaces).
    old_k3 = float(kl_penalty(logp, logp_behav, "k3").mean())
    if kl_mu_pi > 0:
        for biased in (est["kl_mu_pi_k2"], old_k3):
            assert abs(biased - kl_mu_pi) > 1e-3 and abs(biased - kl_pi_mu) > 1e-3


# ---------------------------------------------------------------------------------------------
# DPPO and M2PO masks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mu, pi, adv, kept",
    [
        (1e-5, 1e-3, 1.0, True),  # rare token raised: tiny TV change, kept (PPO's ratio 100 would clip)
        (0.9, 0.65, -1.0, False),  # |dp| = 0.25 > 0.2 in the direction A < 0 pushes
        (0.9, 0.72, -1.0, True),  # |dp| = 0.18 <= 0.2
        (0.5, 0.75, 1.0, False),  # dp = 0.25 > 0.2 with A > 0
        (0.1, 0.9, 1.0, False),  # the example, anchored on mu
    ],
)
def test_dppo_tv_worked_cases(mu, pi, adv, kept):
    logp = torch.tensor([[math.log(pi)]])
    logp_anchor = torch.tensor([[math.log(mu)]])
    keep = dppo_keep_mask(logp, logp_anchor, torch.tensor([adv]), divergence="tv", low=0.2, high=0.2)
    assert keep.dtype == torch.bool and bool(keep[0, 0]) is kept


@pytest.mark.parametrize("divergence", ["tv", "kl"])
@pytest.mark.parametrize("batch", BATCHES)
def test_dppo_masks_match_reference(divergence, batch):
    logp, _, logp_anchor, adv, mask, _ = make_batch(*batch)
    logp = torch.where(mask, logp, torch.full_like(logp, -0.3))
    logp_anchor = torch.where(mask, logp_anchor, torch.full_like(logp, -2.0))
    low, high = (0.15, 0.25) if divergence == "tv" else (0.05, 0.1)  # asymmetric: a swap cannot pass
    drop_low, drop_high = dppo_drop_masks(logp, logp_anchor, adv, divergence, low, high)
    keep = dppo_keep_mask(logp, logp_anchor, adv, divergence, low, high)
    for b, t in cells(mask):
        rl, rh = ref_dppo(
            float(logp[b, t]), float(logp_anchor[b, t]), adv_at(adv, b, t), divergence, low, high
        )
        assert (bool(drop_low[b, t]), bool(drop_high[b, t]), bool(keep[b, t])) == (rl, rh, not (rl or rh))


@pytest.mark.parametrize("tau", [1e-3, 0.04, 0.5, 1e6])
@pytest.mark.parametrize("batch", BATCHES[::3])
def test_m2po_mask_matches_reference(tau, batch):
    logp, logp_behav, _, _, mask, _ = make_batch(*batch)
    keep = m2po_keep_mask(logp, logp_behav, mask, tau)
    assert keep.tolist() == ref_m2po_keep(logp, logp_behav, mask, tau)
    kept_d2 = ((logp - logp_behav).clamp(-20, 20) ** 2)[keep]
    assert kept_d2.numel() == 0 or float(kept_d2.mean()) <= tau


def test_m2po_mask_edges():
    empty = torch.zeros(2, 3, dtype=torch.bool)
    lp = torch.full((2, 3), float("-inf"))
    assert not m2po_keep_mask(lp, lp, empty, 0.04).any()
    # A huge ratio (d = 1e4, clamped to 20) goes first; the rest already satisfy the bound.
    logp = torch.tensor([[0.0, -1e4, -0.1, -0.2]])
    mask = torch.ones_like(logp, dtype=torch.bool)
    assert m2po_keep_mask(logp, torch.zeros_like(logp), mask, 0.04).tolist() == [[True, False, True, True]]


# ---------------------------------------------------------------------------------------------
# Proximal policy (version convention), staleness, importance weights
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("offset, progress", [(0.0, 1.0), (0.0, 0.5), (0.5, 0.25), (0.0, 0.0)])
@pytest.mark.parametrize("batch", BATCHES[::2])
def test_loglinear_prox_matches_reference(batch, offset, progress):
    logp, logp_behav, _, _, mask, versions = make_batch(*batch)
    logp = logp.clone().requires_grad_()
    out = loglinear_prox_logp(logp, logp_behav, versions, VERSION, mask, offset, progress)
    assert not out.requires_grad  # the proximal policy is a constant of the step
    ref = [[ref_prox(float(logp.detach()[b, t]), float(logp_behav[b, t]), VERSION - int(versions[b, t]),
                     offset, progress) if mask[b, t] else 0.0
            for t in range(mask.shape[1])] for b in range(mask.shape[0])]  # fmt: skip
    assert_close(out, ref)


def test_version_convention_worked_example():
    """Module docstring of objectives.importance: one step = 2 updates, publish_every = 1.

    Update 1 (progress 1/2): alpha = 0, 2/3, 4/5 for s = 0, 1, 2. Update 0 (progress 0): alpha = 1,
    i.e. pi_prox = pi_theta exactly for every s. publish_every = 2, second step (offset 1/2),
    update 1 of 2 (progress 1/4): alpha = (s + 1/2) / (s + 3/4).
    """
    logp = torch.zeros(1, 3, dtype=torch.float64)  # log pi_theta = 0
    logp_behav = torch.full((1, 3), -1.0, dtype=torch.float64)  # log mu = -1: log pi_prox = alpha - 1
    versions = torch.tensor([[10, 9, 8]])  # s = 0, 1, 2 at V = 10
    out = loglinear_prox_logp(logp, logp_behav, versions, 10, progress=0.5)
    assert_close(out + 1, [[0.0, 2 / 3, 4 / 5]], tol=1e-12)
    out = loglinear_prox_logp(logp, logp_behav, versions, 10, progress=0.0)
    assert_close(out + 1, [[1.0, 1.0, 1.0]], tol=1e-12)
    out = loglinear_prox_logp(logp, logp_behav, versions, 10, prox_offset=0.5, progress=0.25)
    assert_close(out + 1, [[0.5 / 0.75, 1.5 / 1.75, 2.5 / 2.75]], tol=1e-12)


def test_staleness_mask():
    mask = torch.tensor([[True, True, True, False]])
    versions = torch.tensor([[10, 8, 7, 0]])
    assert staleness_mask(mask, versions, 10, 2).tolist() == [[True, True, False, False]]
    assert staleness_mask(mask, versions, 10, None).tolist() == mask.tolist()
    assert staleness_mask(mask, versions, 10, 0).tolist() == [[True, False, False, False]]


@pytest.mark.parametrize("veto", [0.0, 0.3])
@pytest.mark.parametrize("mode", ["tis", "icepop", "none"])
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("batch", BATCHES[::3])
def test_importance_weights_match_reference(mode, level, veto, batch):
    logp, logp_behav, logp_prox, _, mask, _ = make_batch(*batch)
    cap, low = 2.0, 0.5
    w = importance_weights(logp_prox, logp_behav, mask, mode=mode, cap=cap, low=low, level=level, veto=veto)
    assert not w.requires_grad
    assert_close(w, ref_weights(logp_prox, logp_behav, mask, mode, cap, low, level, veto))


def test_importance_weights_sequence_levels_and_veto():
    logp_behav = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
    logp_prox = torch.log(torch.tensor([[0.9, 0.9, 0.9], [0.6, 0.5, 0.4], [0.9, 0.9, 1e-7]]))
    mask = torch.ones(3, 3, dtype=torch.bool)
    w = importance_weights(logp_prox, logp_behav, mask, mode="icepop", level="sequence")
    assert w[0].tolist() == [0.0, 0.0, 0.0]  # 1.8^3 = 5.8 > cap
    assert_close(w[1], [0.96] * 3, tol=1e-6)
    g = importance_weights(logp_prox, logp_behav, mask, mode="icepop", level="geometric")
    assert_close(g[0], [1.8] * 3, tol=1e-5)  # geometric mean 1.8 is inside [0.5, 2]
    assert_close(g[1], [0.96 ** (1 / 3)] * 3, tol=1e-6)
    v = importance_weights(logp_prox, logp_behav, mask, mode="tis", level="token", veto=1e-4)
    assert v[2].tolist() == [0.0, 0.0, 0.0] and v[0].tolist() == pytest.approx([1.8] * 3)  # 2e-7 < 1e-4


def test_importance_weights_clamp_log_ratio_before_exp():
    # Sequence log-ratio -30 is clamped to -20; token log-ratio 1e4 must not overflow to inf/NaN.
    logp_behav = torch.tensor([[-1.0, -1.0, -1.0], [-1e4, -1.0, -1.0]], dtype=torch.float64)
    logp_prox = torch.tensor([[-11.0, -21.0, -1.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.bool)
    w = importance_weights(logp_prox, logp_behav, mask, mode="tis", cap=1e12, level="sequence")
    assert torch.allclose(w[0], torch.full((3,), math.exp(-20.0), dtype=torch.float64), rtol=1e-12, atol=0)
    assert torch.allclose(w[1], torch.full((3,), math.exp(20.0), dtype=torch.float64), rtol=1e-12, atol=0)
    w = importance_weights(logp_prox.float(), logp_behav.float(), mask, mode="icepop", cap=1e12, low=0.0)
    assert torch.isfinite(w).all() and abs(float(w[1, 0]) / math.exp(20.0) - 1) < 1e-5


# ---------------------------------------------------------------------------------------------
# Group advantages
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("shape", [(1, 1), (4, 1), (3, 8), (6, 2)])
@pytest.mark.parametrize("seed", [0, 1])
def test_group_advantages_match_reference(normalize_std, shape, seed):
    g = torch.Generator().manual_seed(seed)
    rewards = (torch.rand(shape, generator=g, dtype=torch.float64) > 0.5).double()
    rewards[0] = rewards[0] * 0 + 1.0  # an all-correct group: std 0 must not blow up
    if shape[1] > 2:
        rewards[-1] = torch.randn(shape[1], generator=g, dtype=torch.float64) * 5
    out = group_advantages(rewards, normalize_std=normalize_std, eps=1e-6)
    ref = []
    for row in rewards.tolist():
        mean = sum(row) / len(row)
        std = math.sqrt(sum((r - mean) ** 2 for r in row) / (len(row) - 1)) if len(row) > 1 else 0.0
        ref.append([(r - mean) / (std + 1e-6) if normalize_std else r - mean for r in row])
    assert torch.isfinite(out).all()
    assert_close(out, ref)


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_group_of_equal_rewards_has_exactly_zero_advantage(normalize_std, dtype):
    """Rewards whose fp32 mean is an ulp off them (0.6 x 8: the copy task's partial credit). Before:
    (r - mean) / (std + eps) was that ulp over an ulp-sized std, 0.056 for every completion of the
    group (one sign: a push with no signal behind it). Groups that differ keep the reference values."""
    values = [0.6, 0.7, 1 / 3, 2.3, 10.1, 123.4]
    for g in (2, 4, 8, 16):
        rewards = torch.tensor([[v] * g for v in values] + [[0.6] * (g - 1) + [1.0]], dtype=dtype)
        out = group_advantages(rewards, normalize_std=normalize_std)
        assert out.dtype == dtype
        assert out[:-1].abs().max().item() == 0.0, (g, out[:-1])
        row = rewards[-1].double().tolist()
        mean = sum(row) / g
        std = math.sqrt(sum((r - mean) ** 2 for r in row) / (g - 1))
        ref = [(r - mean) / (std + 1e-6) if normalize_std else r - mean for r in row]
        assert_close(out[-1:], [ref], tol=1e-5 if dtype == torch.float32 else 1e-12)
