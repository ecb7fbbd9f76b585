"""Objective library vs slow, obvious float64 reference code (python loops over elements).

Every reference below is written straight from the formulas in the issue / papers, one scalar at
a time, and shares no code with asyncrl.learner.objectives. Inputs are random (several seeds,
shapes, masks, extreme values, -inf at masked positions); the implementation runs on the same
float64 inputs and must agree to 1e-6.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from asyncrl.learner.objectives import (
    ObjectiveConfig,
    aggregate_metrics,
    dppo_drop_masks,
    dppo_keep_mask,
    group_advantages,
    importance_weights,
    kl_penalty,
    loglinear_prox_logp,
    policy_loss,
    reduce_loss,
    staleness_mask,
)

TOL = 1e-6
CLAMP = 20.0
VERSION = 10
SEEDS = [0, 1, 2]
SHAPES = [(1, 1), (3, 7), (5, 4)]


def clamp(x: float, lo: float = -CLAMP, hi: float = CLAMP) -> float:
    return min(max(x, lo), hi)


def assert_close(actual: torch.Tensor, expected, tol: float = TOL) -> None:
    expected = torch.as_tensor(expected, dtype=torch.float64)
    actual = actual.detach().to(torch.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    err = (actual - expected).abs()
    # Absolute tolerance; the 1e-15 relative slack only matters for values ~1e8 (exp(20)).
    bound = tol + 1e-15 * expected.abs()
    assert bool((err <= bound).all()), f"max abs err {err.max().item():.3e}"


# ---------------------------------------------------------------------------------------------
# Random inputs
# ---------------------------------------------------------------------------------------------


def make_batch(seed: int, shape: tuple[int, int], extreme: bool = False, per_token_adv: bool = False):
    """Random float64 batch. Masked positions hold -inf / NaN garbage on purpose."""
    g = torch.Generator().manual_seed(seed)
    B, T = shape
    logp_behav = torch.log(torch.rand(B, T, generator=g, dtype=torch.float64).clamp(min=1e-4))
    # policy = behaviour + drift; some tokens drift a lot so DPPO / clip / IS caps all trigger.
    drift = torch.randn(B, T, generator=g, dtype=torch.float64) * 1.2
    logp = (logp_behav + drift).clamp(max=0.0)
    logp_prox = (logp_behav + 0.5 * drift + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(
        max=0.0
    )
    if extreme:
        pick = torch.rand(B, T, generator=g) < 0.3
        logp = torch.where(pick, torch.full_like(logp, -60.0), logp)  # d ~ -60: beyond the clamp
        pick = torch.rand(B, T, generator=g) < 0.2
        logp_behav = torch.where(pick, torch.full_like(logp, -45.0), logp_behav)  # d ~ +45
    mask = torch.rand(B, T, generator=g) < 0.75
    if B > 1:
        mask[1] = False  # a sequence without loss tokens
    adv_shape = (B, T) if per_token_adv else (B,)
    adv = torch.randn(adv_shape, generator=g, dtype=torch.float64)
    adv = torch.where(torch.rand(adv_shape, generator=g) < 0.15, torch.zeros_like(adv), adv)  # A = 0
    versions = VERSION - torch.randint(0, 6, (B, T), generator=g)
    # Garbage where the mask is off: must not leak anywhere.
    logp = torch.where(mask, logp, torch.full_like(logp, float("-inf")))
    logp_behav = torch.where(mask, logp_behav, torch.full_like(logp, float("nan")))
    logp_prox = torch.where(mask, logp_prox, torch.full_like(logp, float("-inf")))
    return logp, logp_behav, logp_prox, adv, mask, versions


def adv_at(adv: torch.Tensor, b: int, t: int) -> float:
    return float(adv[b]) if adv.dim() == 1 else float(adv[b, t])


def cells(mask: torch.Tensor):
    B, T = mask.shape
    return [(b, t) for b in range(B) for t in range(T)]


BATCHES = [
    (seed, shape, extreme, per_tok)
    for seed, shape, (extreme, per_tok) in itertools.product(
        SEEDS, SHAPES, [(False, False), (True, False), (False, True)]
    )
]


# ---------------------------------------------------------------------------------------------
# Scalar references
# ---------------------------------------------------------------------------------------------


def ref_kl(lp: float, lr: float, kind: str) -> float:
    d = clamp(lp - lr)
    return {"k1": d, "abs": abs(d), "k2": d * d / 2, "k3": math.exp(-d) + d - 1}[kind]


def ref_dppo(lp: float, la: float, a: float, divergence: str, low: float, high: float) -> tuple[bool, bool]:
    """(drop_low, drop_high) for one token, straight from the DPPO definitions."""
    p, q = math.exp(lp), math.exp(la)
    if divergence == "tv":
        return (a < 0 and q - p > low), (a > 0 and p - q > high)
    p = min(max(p, 1e-6), 1 - 1e-6)
    q = min(max(q, 1e-6), 1 - 1e-6)
    d = q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))
    return (a < 0 and p < q and d > low), (a > 0 and p > q and d > high)


def ref_prox(lp: float, lb: float, s: int) -> float:
    alpha = (s - 1) / s if s > 1 else 0.0
    return lb + alpha * (lp - lb)


def ref_weights(lprox, lbehav, mask, mode, cap, low, level) -> list[list[float]]:
    """Loops over a [B][T] grid; masked positions get weight 1."""
    B, T = mask.shape
    w = [[1.0] * T for _ in range(B)]
    if mode == "none":
        return w

    def f(rho: float) -> float:
        if mode == "tis":
            return min(rho, cap)
        return rho if low <= rho <= cap else 0.0

    for b in range(B):
        if level == "sequence":
            s = 0.0
            for t in range(T):
                if mask[b, t]:
                    s += clamp(float(lprox[b, t]) - float(lbehav[b, t]))
            ws = f(math.exp(clamp(s)))
        for t in range(T):
            if mask[b, t]:
                w[b][t] = (
                    ws
                    if level == "sequence"
                    else f(math.exp(clamp(float(lprox[b, t]) - float(lbehav[b, t]))))
                )
    return w


# ---------------------------------------------------------------------------------------------
# kl_penalty
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3"])
@pytest.mark.parametrize("batch", BATCHES[:6])
def test_kl_penalty_matches_reference(kind, batch):
    logp, logp_behav, _, _, mask, _ = make_batch(*batch)
    out = kl_penalty(logp, logp_behav, kind, mask=mask)
    ref = [
        [
            ref_kl(float(logp[b, t]), float(logp_behav[b, t]), kind) if mask[b, t] else 0.0
            for t in range(mask.shape[1])
        ]
        for b in range(mask.shape[0])
    ]
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
    # Beyond the clamp the estimate is constant, so its gradient is 0 (not inf, not NaN).
    assert logp.grad[0, 0] == 0 and logp.grad[0, 6] == 0 and logp.grad[0, 2] != 0


# ---------------------------------------------------------------------------------------------
# DPPO
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mu, pi, adv, kept",
    [
        (1e-5, 1e-3, 1.0, True),  # rare token raised: tiny TV change, kept (PPO's ratio 100 would clip)
        (0.9, 0.65, -1.0, False),  # |dp| = 0.25 > 0.2 in the direction A < 0 pushes
        (0.9, 0.72, -1.0, True),  # |dp| = 0.18 <= 0.2
        (0.5, 0.75, 1.0, False),  # dp = 0.25 > 0.2 with A > 0
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
    # Fill masked garbage with real numbers: the function itself has no mask argument.
    logp = torch.where(mask, logp, torch.full_like(logp, -0.3))
    logp_anchor = torch.where(mask, logp_anchor, torch.full_like(logp, -2.0))
    # Asymmetric thresholds so a swapped low/high cannot pass.
    low, high = (0.15, 0.25) if divergence == "tv" else (0.05, 0.1)
    drop_low, drop_high = dppo_drop_masks(logp, logp_anchor, adv, divergence, low, high)
    keep = dppo_keep_mask(logp, logp_anchor, adv, divergence, low, high)
    for b, t in cells(mask):
        rl, rh = ref_dppo(
            float(logp[b, t]), float(logp_anchor[b, t]), adv_at(adv, b, t), divergence, low, high
        )
        assert (bool(drop_low[b, t]), bool(drop_high[b, t]), bool(keep[b, t])) == (rl, rh, not (rl or rh))


@pytest.mark.parametrize("divergence", ["tv", "kl"])
def test_random_batches_exercise_every_branch(divergence):
    """Coverage guard: the random inputs above must hit every DPPO / IS branch, or those
    reference comparisons prove little."""
    low = high = 0.2 if divergence == "tv" else 0.1
    counts = dict(drop_low=0, drop_high=0, kept=0, capped=0, icepop_zero=0, clip=0, dual_clip=0)
    cfg = ObjectiveConfig(policy_loss="ppo_clip", dual_clip=3.0, divergence=divergence)
    for batch in BATCHES:
        logp, logp_behav, logp_prox, adv, mask, _v = make_batch(*batch)
        dl, dh = dppo_drop_masks(logp, logp_prox, adv, divergence, low, high)
        counts["drop_low"] += int((dl & mask).sum())
        counts["drop_high"] += int((dh & mask).sum())
        counts["kept"] += int((~dl & ~dh & mask).sum())
        w = importance_weights(logp_prox, logp_behav, mask, "tis")
        counts["capped"] += int(((w == 2.0) & mask).sum())
        w = importance_weights(logp_prox, logp_behav, mask, "icepop")
        counts["icepop_zero"] += int(((w == 0) & mask).sum())
        _, _, m = policy_loss(logp, logp_behav, adv, mask, _v, VERSION, cfg)
        counts["clip"] += round(float(m["clip_frac"] * m["num_tokens"]))
        counts["dual_clip"] += round(float(m["dual_clip_frac"] * m["num_tokens"]))
    assert min(counts.values()) >= 3, counts


# ---------------------------------------------------------------------------------------------
# Proximal policy, staleness, importance weights
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", BATCHES)
def test_loglinear_prox_matches_reference(batch):
    logp, logp_behav, _, _, mask, versions = make_batch(*batch)
    logp = logp.clone().requires_grad_()
    out = loglinear_prox_logp(logp, logp_behav, versions, VERSION, mask=mask)
    assert not out.requires_grad  # the proximal policy is a constant of the step
    ref = [
        [
            ref_prox(float(logp.detach()[b, t]), float(logp_behav[b, t]), VERSION - int(versions[b, t]))
            if mask[b, t]
            else 0.0
            for t in range(mask.shape[1])
        ]
        for b in range(mask.shape[0])
    ]
    assert_close(out, ref)


def test_loglinear_prox_alpha_values():
    logp = torch.zeros(1, 5)
    logp_behav = torch.full((1, 5), -1.0)
    versions = torch.tensor([[10, 9, 8, 6, 0]])  # s = 0, 1, 2, 4, 10
    out = loglinear_prox_logp(logp, logp_behav, versions, 10)
    assert_close(out, [[-1.0, -1.0, -0.5, -0.25, -0.1]])


def test_staleness_mask():
    mask = torch.tensor([[True, True, True, False]])
    versions = torch.tensor([[10, 8, 7, 0]])
    assert staleness_mask(mask, versions, 10, 2).tolist() == [[True, True, False, False]]
    assert staleness_mask(mask, versions, 10, None).tolist() == mask.tolist()
    assert staleness_mask(mask, versions, 10, 0).tolist() == [[True, False, False, False]]


@pytest.mark.parametrize("mode", ["tis", "icepop", "none"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("batch", BATCHES[::2])
def test_importance_weights_match_reference(mode, level, batch):
    logp, logp_behav, logp_prox, _, mask, _ = make_batch(*batch)
    cap, low = 2.0, 0.5
    w = importance_weights(logp_prox, logp_behav, mask, mode=mode, cap=cap, low=low, level=level)
    assert not w.requires_grad
    assert_close(w, ref_weights(logp_prox, logp_behav, mask, mode, cap, low, level))


def test_importance_weights_sequence_icepop_drops_whole_sequence():
    logp_behav = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
    logp_prox = torch.log(torch.tensor([[0.9, 0.9, 0.9], [0.6, 0.5, 0.4]]))
    mask = torch.ones(2, 3, dtype=torch.bool)
    w = importance_weights(logp_prox, logp_behav, mask, mode="icepop", level="sequence")
    assert w[0].tolist() == [0.0, 0.0, 0.0]  # 1.8^3 = 5.8 > cap
    assert_close(w[1], [0.96] * 3, tol=1e-6)


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
@pytest.mark.parametrize("seed", SEEDS)
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


# ---------------------------------------------------------------------------------------------
# policy_loss vs a per-token reference (values, gradients, metrics)
# ---------------------------------------------------------------------------------------------


def ref_policy(logp, logp_behav, adv, mask, versions, cfg: ObjectiveConfig, logp_prox=None):
    """Per-token loss, d loss_t / d logp_t (scalar autograd) and metrics, one token at a time."""
    B, T = mask.shape
    lmask = [
        [
            bool(mask[b, t])
            and (cfg.max_staleness is None or VERSION - int(versions[b, t]) <= cfg.max_staleness)
            for t in range(T)
        ]
        for b in range(B)
    ]
    anchor = [[0.0] * T for _ in range(B)]
    for b, t in cells(mask):
        if not lmask[b][t]:
            continue
        lp, lb, s = float(logp[b, t]), float(logp_behav[b, t]), VERSION - int(versions[b, t])
        if cfg.anchor == "behaviour":
            anchor[b][t] = lb
        elif logp_prox is not None:
            anchor[b][t] = float(logp_prox[b, t])
        else:
            anchor[b][t] = ref_prox(lp, lb, s)
    lm = torch.tensor(lmask, dtype=torch.bool).reshape(B, T)
    w = ref_weights(
        torch.tensor(anchor, dtype=torch.float64).reshape(B, T),
        logp_behav,
        lm,
        cfg.is_mode,
        cfg.is_cap,
        cfg.is_low,
        cfg.is_level,
    )
    loss = [[0.0] * T for _ in range(B)]
    grad = [[0.0] * T for _ in range(B)]
    acc = {k: [] for k in ["ratio", "drop", "drop_low", "drop_high", "w", "k2", "k3", "clip", "dual"]}
    for b, t in cells(mask):
        if not lmask[b][t]:
            continue
        a_t = adv_at(adv, b, t)
        lp = torch.tensor(float(logp[b, t]), dtype=torch.float64, requires_grad=True)
        lb, anc = float(logp_behav[b, t]), anchor[b][t]
        r = torch.exp(torch.clamp(lp - anc, -CLAMP, CLAMP))
        dl, dh = ref_dppo(float(lp.detach()), anc, a_t, cfg.divergence, cfg.dppo_low, cfg.dppo_high)
        clip = dual = False
        if cfg.policy_loss == "dppo":
            pg = torch.zeros((), dtype=torch.float64) if (dl or dh) else -w[b][t] * r * a_t
        else:
            unclipped = -a_t * r
            clipped = -a_t * torch.clamp(r, 1 - cfg.eps_low, 1 + cfg.eps_high)
            ppo = unclipped if float(unclipped.detach()) >= float(clipped.detach()) else clipped
            clip = float(clipped.detach()) > float(unclipped.detach())
            if cfg.dual_clip is not None and a_t < 0 and float(ppo.detach()) > -cfg.dual_clip * a_t:
                ppo = torch.tensor(-cfg.dual_clip * a_t, dtype=torch.float64)
                dual = True
            pg = w[b][t] * ppo
        d = torch.clamp(lp - lb, -CLAMP, CLAMP)
        kl = {"k1": d, "abs": d.abs(), "k2": d * d / 2, "k3": torch.exp(-d) + d - 1}[cfg.rollout_kl_kind]
        total = pg + cfg.beta_rollout_kl * kl
        (g,) = torch.autograd.grad(total, lp, allow_unused=True)
        loss[b][t] = float(total.detach())
        grad[b][t] = 0.0 if g is None else float(g)
        for k, v in [
            ("ratio", float(r.detach())),
            ("drop", dl or dh),
            ("drop_low", dl),
            ("drop_high", dh),
            ("w", w[b][t]),
            ("k2", ref_kl(float(lp.detach()), lb, "k2")),
            ("k3", ref_kl(float(lp.detach()), lb, "k3")),
            ("clip", clip),
            ("dual", dual),
        ]:
            acc[k].append(float(v))
    stale = [VERSION - int(versions[b, t]) for b, t in cells(mask) if mask[b, t]]

    def mean(xs):
        return sum(xs) / len(xs) if xs else 0.0

    ws = acc["w"]
    metrics = {
        "ratio_mean": mean(acc["ratio"]),
        "dppo_masked_frac": mean(acc["drop"]),
        "dppo_masked_frac_low": mean(acc["drop_low"]),
        "dppo_masked_frac_high": mean(acc["drop_high"]),
        "is_weight_mean": mean(ws),
        "is_weight_max": max(ws) if ws else 0.0,
        "ess": (sum(ws) ** 2 / (len(ws) * sum(x * x for x in ws)))
        if ws and sum(x * x for x in ws) > 0
        else 0.0,
        "rollout_kl_k2": mean(acc["k2"]),
        "rollout_kl_k3": mean(acc["k3"]),
        "staleness_mean": mean(stale),
        "staleness_max": float(max(stale)) if stale else 0.0,
        "stale_dropped_frac": mean([0.0 if lmask[b][t] else 1.0 for b, t in cells(mask) if mask[b, t]]),
        "num_tokens": float(sum(map(sum, lmask))),
    }
    if cfg.policy_loss == "ppo_clip":
        metrics["clip_frac"] = mean(acc["clip"])
        metrics["dual_clip_frac"] = mean(acc["dual"])
    return loss, grad, lmask, metrics


CONFIGS = [
    ObjectiveConfig(),
    ObjectiveConfig(dppo_low=0.1, dppo_high=0.3, is_cap=1.5),
    ObjectiveConfig(divergence="kl", dppo_low=0.05, dppo_high=0.1, rollout_kl_kind="k3", beta_rollout_kl=0.1),
    ObjectiveConfig(is_mode="icepop", is_level="sequence", max_staleness=3),
    ObjectiveConfig(anchor="behaviour", is_mode="none", beta_rollout_kl=0.0),
    ObjectiveConfig(policy_loss="ppo_clip", eps_high=0.28, is_level="sequence"),
    ObjectiveConfig(
        policy_loss="ppo_clip", dual_clip=3.0, max_staleness=2, is_mode="icepop", rollout_kl_kind="k1"
    ),
    ObjectiveConfig(policy_loss="ppo_clip", anchor="behaviour", dual_clip=2.0, rollout_kl_kind="abs"),
]


@pytest.mark.parametrize("exact_prox", [False, True])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.policy_loss}-{c.anchor}-{c.is_mode}-{c.is_level}")
@pytest.mark.parametrize("batch", [b for b in BATCHES if b[1] != (1, 1)][::2])
def test_policy_loss_matches_reference(batch, cfg, exact_prox):
    logp, logp_behav, logp_prox, adv, mask, versions = make_batch(*batch)
    logp = logp.clone().requires_grad_()
    prox = logp_prox if exact_prox else None
    loss, loss_mask, metrics = policy_loss(
        logp, logp_behav, adv, mask, versions, VERSION, cfg, logp_prox=prox
    )
    ref_loss, ref_grad, ref_mask, ref_metrics = ref_policy(
        logp.detach(), logp_behav, adv, mask, versions, cfg, prox
    )
    assert loss_mask.dtype == torch.bool and loss_mask.tolist() == ref_mask
    assert_close(loss, ref_loss)
    loss.sum().backward()
    assert_close(logp.grad, ref_grad)
    for k, v in ref_metrics.items():
        assert abs(float(metrics[k]) - v) < TOL, (k, float(metrics[k]), v)


def test_policy_loss_fp32_close_to_float64():
    logp, logp_behav, logp_prox, adv, mask, versions = make_batch(7, (6, 9))
    cfg = ObjectiveConfig(beta_rollout_kl=0.05)
    out64, _, m64 = policy_loss(logp, logp_behav, adv, mask, versions, VERSION, cfg)
    out32, _, m32 = policy_loss(logp.float(), logp_behav.float(), adv.float(), mask, versions, VERSION, cfg)
    assert out32.dtype == torch.float32
    assert_close(out32, out64.float().double(), tol=1e-4)
    for k in m64:
        assert abs(float(m64[k]) - float(m32[k])) < 1e-4 * max(1.0, abs(float(m64[k]))), k


# ---------------------------------------------------------------------------------------------
# On-policy identity
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("exact_prox", [False, True])
@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize(
    "cfg",
    [
        ObjectiveConfig(),
        ObjectiveConfig(divergence="kl", is_mode="icepop", is_level="sequence", rollout_kl_kind="k3"),
        ObjectiveConfig(anchor="behaviour", max_staleness=0),
        ObjectiveConfig(policy_loss="ppo_clip", dual_clip=3.0, beta_rollout_kl=0.5),
    ],
    ids=["dppo", "dppo-kl-icepop-seq", "behaviour", "ppo-dual"],
)
def test_on_policy_identity(cfg, reduction, exact_prox):
    """logp == logp_behav == anchor, lag 0: ratio 1, nothing masked, weights 1, KL 0, and the
    gradient is exactly the plain policy gradient -A grad(logp), reduced the same way."""
    g = torch.Generator().manual_seed(3)
    B, T = 4, 6
    logp = torch.log(torch.rand(B, T, generator=g, dtype=torch.float64) * 0.9 + 0.05).requires_grad_()
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[:, 0] = True
    versions = torch.full((B, T), VERSION)
    prox = logp.detach().clone() if exact_prox else None
    loss, loss_mask, m = policy_loss(
        logp, logp.detach().clone(), adv, mask, versions, VERSION, cfg, logp_prox=prox
    )
    assert loss_mask.tolist() == mask.tolist()
    for k, v in [
        ("ratio_mean", 1.0),
        ("is_weight_mean", 1.0),
        ("is_weight_max", 1.0),
        ("ess", 1.0),
        ("dppo_masked_frac", 0.0),
        ("rollout_kl_k2", 0.0),
        ("rollout_kl_k3", 0.0),
        ("staleness_max", 0.0),
        ("stale_dropped_frac", 0.0),
    ]:
        assert abs(float(m[k]) - v) < 1e-12, k
    if "clip_frac" in m:
        assert float(m["clip_frac"]) == 0.0 and float(m["dual_clip_frac"]) == 0.0
    n, s = int(mask.sum()), int(mask.any(-1).sum())
    assert_close(loss, torch.where(mask, -adv[:, None].expand(B, T), torch.zeros(B, T, dtype=torch.float64)))
    (g_obj,) = torch.autograd.grad(reduce_loss(loss, loss_mask, reduction, n, s, max_tokens=T), logp)
    plain = -adv[:, None] * logp
    (g_pg,) = torch.autograd.grad(reduce_loss(plain, mask, reduction, n, s, max_tokens=T), logp)
    assert_close(g_obj, g_pg, tol=1e-12)
    assert g_pg.abs().max() > 1e-3  # the identity is not vacuous


# ---------------------------------------------------------------------------------------------
# NaN / inf safety
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cfg", CONFIGS + [ObjectiveConfig(is_level="sequence", divergence="kl")])
def test_no_nan_with_inf_masked_and_huge_differences(cfg, dtype):
    B, T = 3, 8
    g = torch.Generator().manual_seed(11)
    logp_behav = torch.log(torch.rand(B, T, generator=g, dtype=torch.float64) * 0.9 + 0.05)
    logp = logp_behav.clone()
    logp[:, 1] = -1e4  # d = -1e4
    logp_behav[:, 2] = -1e4  # d ~ +1e4
    logp[:, 3] = -3e3
    logp_behav[:, 3] = -1e4  # both tiny, d = 7e3
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, -2:] = False
    mask[2] = False
    logp[~mask] = float("-inf")
    logp_behav[~mask] = float("-inf")
    prox = logp_behav.clone()
    prox[:, 4] = 0.0
    prox[~mask] = float("nan")
    adv = torch.tensor([1.5, -2.0, 1.0], dtype=torch.float64)
    versions = VERSION - torch.randint(0, 5, (B, T), generator=g)
    for p in (None, prox):
        lp = logp.to(dtype).requires_grad_()
        loss, lmask, m = policy_loss(
            lp,
            logp_behav.to(dtype),
            adv.to(dtype),
            mask,
            versions,
            VERSION,
            cfg,
            logp_prox=None if p is None else p.to(dtype),
        )
        total = reduce_loss(loss, lmask, "token_mean", max(int(lmask.sum()), 1), 3)
        total.backward()
        assert torch.isfinite(loss).all() and torch.isfinite(total)
        assert torch.isfinite(lp.grad).all()
        assert (lp.grad[~mask] == 0).all() and (loss[~mask] == 0).all()
        assert all(math.isfinite(float(v)) for v in m.values())


@pytest.mark.parametrize("cfg", CONFIGS)
def test_empty_mask_metrics_are_zero(cfg):
    logp = torch.full((2, 3), float("-inf"), requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    versions = torch.zeros(2, 3, dtype=torch.long)
    loss, lmask, m = policy_loss(logp, logp.detach(), torch.ones(2), mask, versions, VERSION, cfg)
    reduce_loss(loss, lmask, "sequence_mean", 0, 0).backward()
    assert (loss == 0).all() and (logp.grad == 0).all()
    assert all(float(v) == 0.0 for v in m.values()), m


# ---------------------------------------------------------------------------------------------
# Metrics aggregate across micro-batches exactly like the full batch
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.policy_loss}-{c.anchor}-{c.is_mode}-{c.is_level}")
def test_metrics_aggregate_across_micro_batches(cfg):
    logp, logp_behav, logp_prox, adv, mask, versions = make_batch(5, (8, 6), extreme=True)
    _, _, full = policy_loss(logp, logp_behav, adv, mask, versions, VERSION, cfg)
    by_size = {}
    for mbs in (1, 3, 8):
        parts = by_size[mbs] = []
        for i in range(0, 8, mbs):
            sl = slice(i, i + mbs)
            parts.append(
                policy_loss(logp[sl], logp_behav[sl], adv[sl], mask[sl], versions[sl], VERSION, cfg)[2]
            )
        agg = aggregate_metrics(parts)
        assert set(agg) == set(full)
        for k, v in full.items():
            assert abs(agg[k] - float(v)) < 1e-9 * max(1.0, abs(float(v))), (mbs, k, agg[k], float(v))
    # A naive average of micro-batch means is wrong here (uneven token counts): the test can fail.
    naive = sum(float(p["ratio_mean"]) for p in by_size[3]) / len(by_size[3])
    assert abs(naive - float(full["ratio_mean"])) > 1e-6


def test_config_validation():
    with pytest.raises(ValueError):
        ObjectiveConfig(policy_loss="grpo")
    with pytest.raises(ValueError):
        ObjectiveConfig(dual_clip=0.5)
    with pytest.raises(ValueError):
        ObjectiveConfig(max_staleness=-1)
    assert dataclasses.asdict(ObjectiveConfig())["beta_rollout_kl"] == 1e-3
