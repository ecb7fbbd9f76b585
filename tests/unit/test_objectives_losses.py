"""policy_loss (dppo, m2po, ppo_clip, gspo, cispo, IS variants, ratio cap) vs the float64 reference.

Values, per-token gradients and metrics are compared token by token with
tests/unit/_objective_refs.ref_policy; then NaN/inf safety, empty masks and metric aggregation.
"""

from __future__ import annotations

import math

import pytest
import torch
from _objective_refs import BATCHES, TOL, VERSION, assert_close, make_batch, ref_policy

from asyncrl.learner.objectives import (
    ObjectiveConfig,
    aggregate_metrics,
    policy_loss,
    reduce_loss,
    rollout_kl_loss,
)

CONFIGS = [
    ObjectiveConfig(),
    ObjectiveConfig(dppo_low=0.1, dppo_high=0.3, is_cap=1.5, dual_clip=1.5),
    ObjectiveConfig(divergence="kl", dppo_low=0.05, dppo_high=0.1, anchor="prox", dual_clip=0.0),
    ObjectiveConfig(is_mode="icepop", is_level="sequence", max_staleness=3, is_veto=0.05),
    ObjectiveConfig(is_mode="tis", is_level="geometric", is_low=0.0),
    ObjectiveConfig(policy_loss="m2po", m2po_tau=0.3),
    ObjectiveConfig(policy_loss="m2po", anchor="prox", is_mode="none", m2po_tau=0.05),
    ObjectiveConfig(policy_loss="ppo_clip", anchor="prox", is_level="sequence"),
    ObjectiveConfig(policy_loss="ppo_clip", dual_clip=2.0, max_staleness=2),
    ObjectiveConfig(policy_loss="gspo", anchor="prox", gspo_eps_low=0.05, gspo_eps_high=0.1),
    ObjectiveConfig(policy_loss="gspo", is_mode="icepop"),
    ObjectiveConfig(policy_loss="cispo", anchor="prox", eps_low=0.5, eps_high=0.5),
    ObjectiveConfig(policy_loss="cispo", dual_clip=1.2),
]


def cid(c: ObjectiveConfig) -> str:
    return f"{c.policy_loss}-{c.anchor}-{c.is_mode}-{c.is_level}-c{c.dual_clip}"


def _check(batch, cfg, prox_kind):
    logp, logp_behav, logp_prox, adv, mask, versions = make_batch(*batch)
    logp = logp.clone().requires_grad_()
    kw = {"exact": dict(logp_prox=logp_prox), "a3po": dict(prox_offset=0.5, progress=0.25), "default": {}}[
        prox_kind
    ]
    loss, loss_mask, metrics = policy_loss(logp, logp_behav, adv, mask, versions, VERSION, cfg, **kw)
    ref_loss, ref_grad, ref_mask, ref_metrics = ref_policy(
        logp.detach(), logp_behav, adv, mask, versions, cfg, kw.get("logp_prox"),
        kw.get("prox_offset", 0.0), kw.get("progress", 1.0),
    )  # fmt: skip
    assert loss_mask.dtype == torch.bool and loss_mask.tolist() == ref_mask
    assert_close(loss, ref_loss)
    loss.sum().backward()
    assert_close(logp.grad, ref_grad)
    for k, v in ref_metrics.items():
        assert abs(float(metrics[k]) - v) < TOL * max(1.0, abs(v)), (k, float(metrics[k]), v)
    return metrics


@pytest.mark.parametrize("prox_kind", ["exact", "a3po", "default"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=cid)
@pytest.mark.parametrize("batch", [b for b in BATCHES if b[1] != (1, 1)][::3])
def test_policy_loss_matches_reference(batch, cfg, prox_kind):
    _check(batch, cfg, prox_kind)


def test_random_batches_exercise_every_branch():
    """Coverage guard: the random inputs must hit every masking / clipping branch, or the
    reference comparisons above prove little."""
    seen: dict[str, float] = {}
    for cfg in CONFIGS:
        for batch in BATCHES:
            logp, logp_behav, logp_prox, adv, mask, v = make_batch(*batch)
            _, _, m = policy_loss(logp, logp_behav, adv, mask, v, VERSION, cfg, logp_prox=logp_prox)
            for k in ("dppo_masked_frac_low", "dppo_masked_frac_high", "m2po_masked_frac", "clip_frac_low",
                      "clip_frac_high", "dual_clip_frac", "is_masked_frac", "is_trunc_frac"):  # fmt: skip
                seen[k] = seen.get(k, 0.0) + float(m[k] * m["num_tokens"])
    assert min(seen.values()) >= 3, seen


def test_policy_loss_fp32_close_to_float64():
    logp, logp_behav, logp_prox, adv, mask, versions = make_batch(7, (6, 9))
    for cfg in CONFIGS:
        out64, _, m64 = policy_loss(logp, logp_behav, adv, mask, versions, VERSION, cfg, logp_prox=logp_prox)
        out32, _, m32 = policy_loss(
            logp.float(),
            logp_behav.float(),
            adv.float(),
            mask,
            versions,
            VERSION,
            cfg,
            logp_prox=logp_prox.float(),
        )
        assert out32.dtype == torch.float32
        assert_close(out32, out64.float().double(), tol=1e-4 * max(1.0, float(out64.abs().max())))
        for k in m64:
            assert abs(float(m64[k]) - float(m32[k])) < 1e-3 * max(1.0, abs(float(m64[k]))), (cid(cfg), k)


def test_gspo_gradient_is_the_sequence_mean_of_token_gradients():
    """GSPO-token with sequence_mean reduction == GSPO: grad = mean_i s_i A_i mean_t grad log pi_t."""
    g = torch.Generator().manual_seed(4)
    logp = torch.log(torch.rand(3, 5, generator=g, dtype=torch.float64) * 0.8 + 0.1).requires_grad_()
    logp_behav = logp.detach() + 0.01 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1, 3:] = False
    v = torch.full((3, 5), VERSION)
    cfg = ObjectiveConfig(policy_loss="gspo", gspo_eps_low=0.5, gspo_eps_high=0.5, dual_clip=0.0)
    loss, lm, _ = policy_loss(logp, logp_behav, adv, mask, v, VERSION, cfg)
    (grad,) = torch.autograd.grad(reduce_loss(loss, lm, "sequence_mean", int(lm.sum()), 3), logp)
    ref = torch.zeros_like(grad)
    for b in range(3):
        toks = [t for t in range(5) if mask[b, t]]
        s = math.exp(sum(float(logp[b, t] - logp_behav[b, t]) for t in toks) / len(toks))
        for t in toks:
            ref[b, t] = -s * float(adv[b]) / len(toks) / 3
    assert_close(grad, ref, tol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cfg", CONFIGS, ids=cid)
def test_no_nan_with_inf_masked_and_huge_differences(cfg, dtype):
    B, T = 3, 8
    g = torch.Generator().manual_seed(11)
    logp_behav = torch.log(torch.rand(B, T, generator=g, dtype=torch.float64) * 0.9 + 0.05)
    logp = logp_behav.clone()
    logp[:, 1] = -1e4  # d = -1e4: an underflowing probability
    logp_behav[:, 2] = -1e4  # d ~ +1e4: a huge ratio
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
            lp, logp_behav.to(dtype), adv.to(dtype), mask, versions, VERSION, cfg,
            logp_prox=None if p is None else p.to(dtype),
        )  # fmt: skip
        kl = rollout_kl_loss(lp, logp_behav.to(dtype), lmask, cfg)
        total = reduce_loss(loss + kl, lmask, "token_mean", max(int(lmask.sum()), 1), 3)
        total.backward()
        assert torch.isfinite(loss).all() and torch.isfinite(total)
        assert torch.isfinite(lp.grad).all()
        assert (lp.grad[~mask] == 0).all() and (loss[~mask] == 0).all()
        assert all(math.isfinite(float(v)) for v in m.values()), m
        if cfg.dual_clip > 0:  # the ratio cap bounds every negative-advantage token's loss
            assert float(loss[1].max()) <= cfg.dual_clip * 2.0 + 1e-6


@pytest.mark.parametrize("cfg", CONFIGS, ids=cid)
def test_empty_mask_loss_grad_and_metrics_are_zero(cfg):
    logp = torch.full((2, 3), float("-inf"), requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    versions = torch.zeros(2, 3, dtype=torch.long)
    loss, lmask, m = policy_loss(logp, logp.detach(), torch.ones(2), mask, versions, VERSION, cfg)
    reduce_loss(
        loss + rollout_kl_loss(logp, logp.detach(), lmask, cfg), lmask, "sequence_mean", 0, 0
    ).backward()
    assert (loss == 0).all() and (logp.grad == 0).all()
    assert all(float(v) == 0.0 for v in m.values()), m


@pytest.mark.parametrize("cfg", CONFIGS[::2], ids=cid)
def test_metrics_aggregate_across_micro_batches(cfg):
    if cfg.policy_loss == "m2po":
        pytest.skip("the M2PO mask is taken per call (micro-batch), by definition")
    logp, logp_behav, logp_prox, adv, mask, versions = make_batch(5, (8, 6), extreme=True)
    _, _, full = policy_loss(logp, logp_behav, adv, mask, versions, VERSION, cfg, logp_prox=logp_prox)
    for mbs in (1, 3, 8):
        parts = []
        for i in range(0, 8, mbs):
            sl = slice(i, i + mbs)
            parts.append(policy_loss(logp[sl], logp_behav[sl], adv[sl], mask[sl], versions[sl], VERSION, cfg,
                                     logp_prox=logp_prox[sl])[2])  # fmt: skip
        agg = aggregate_metrics(parts)
        assert set(agg) == set(full)
        for k, v in full.items():
            assert abs(agg[k] - float(v)) < 1e-9 * max(1.0, abs(float(v))), (mbs, k, agg[k], float(v))
