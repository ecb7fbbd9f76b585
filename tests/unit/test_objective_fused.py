"""The learner's one-pass objective (``objective_terms``) equals the separate functions it fuses (issue 14).

``objective_terms`` forms every intermediate the policy loss, the rollout-KL term, the metrics and the
drift sums share once (sanitised inputs, log-ratios to mu and pi_prox, their exps) instead of once per
function. What is checked here, bit for bit, on random inputs and at the edges (masked garbage -inf /
NaN, huge ratios, underflowing probabilities, empty masks), with a finite backward:

- its rollout-KL term, gradient and drift sums against ``rollout_kl_loss`` and ``drift_sums`` computed
  from the logprobs alone;
- its policy term and metrics against ``policy_loss``, which is a view of ``objective_terms`` without
  the rollout-KL term: this half only shows that adding the KL term changes nothing else;
- ``policy_metrics`` given the loss's intermediates against the same metrics recomputed (defaults).

The policy term, its gradient and every metric are checked against slow float64 reference code in
test_objectives_losses.py (``_objective_refs.ref_policy``); that is where a wrong formula fails.
"""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.learner.objectives import (
    ObjectiveConfig,
    drift_sums,
    objective_terms,
    policy_loss,
    reduce_loss,
    rollout_kl_loss,
    token_mean,
)
from asyncrl.learner.objectives.diagnostics import policy_metrics

VERSION = 5

CONFIGS = [
    {},  # the defaults: dppo-tv, tis token, dual clip, k2 rollout KL
    {"divergence": "kl", "is_mode": "icepop", "is_veto": 0.2, "rollout_kl_kind": "k3"},
    {"policy_loss": "m2po", "is_level": "sequence", "dual_clip": 0.0},
    {"policy_loss": "dppo", "anchor": "prox", "is_mode": "none", "rollout_kl_kind": "abs"},
    {"policy_loss": "ppo_clip", "anchor": "prox", "is_level": "geometric"},
    {"policy_loss": "ppo_clip", "beta_rollout_kl": 0.0},
    {"policy_loss": "gspo", "anchor": "prox", "is_mode": "icepop", "is_low": 0.0},
    {"policy_loss": "cispo", "dual_clip": 0.0, "beta_rollout_kl": 0.5},
]
EDGES = ["plain", "huge_ratio", "underflow", "empty"]


def _batch(seed: int, edge: str, b: int = 5, t: int = 8):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, generator=g) * 2
    behav = torch.log_softmax(torch.randn(b, t, 3, generator=g), -1)[..., 0]
    prox = behav + 0.3 * torch.randn(b, t, generator=g)
    if edge == "huge_ratio":  # mu far below pi: log-ratios past the +-20 clamp
        behav = behav - 60 * torch.rand(b, t, generator=g)
    if edge == "underflow":  # probabilities that underflow fp32's exp (p = 0)
        logits = logits - 120
    mask = torch.rand(b, t, generator=g) < 0.7
    mask[0] = False  # always one empty sequence
    if edge == "empty":
        mask[:] = False
    versions = torch.randint(VERSION - 3, VERSION + 1, (b, t), generator=g)
    adv = torch.randn(b, generator=g) if seed % 2 else torch.randn(b, t, generator=g)
    # Garbage where nothing is trained: must reach no value and no gradient.
    behav = torch.where(mask, behav, torch.tensor(-math.inf))
    prox = torch.where(mask, prox, torch.tensor(math.nan))
    return logits, behav, prox, adv, mask, versions


def _logp(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log sigmoid with -inf off the mask, as a log_softmax at padding can give."""
    return torch.where(mask, torch.nn.functional.logsigmoid(logits), torch.tensor(-math.inf))


def _separate(logits, behav, adv, mask, versions, cfg, prox_arg, prox_mode):
    x = logits.clone().requires_grad_(True)
    logp = _logp(x, mask)
    start = logp.detach() if prox_mode == "current" else prox_arg
    pg, lm, metrics = policy_loss(logp, behav, adv, mask, versions, VERSION, cfg, logp_prox=start,
                                  prox_offset=0.5, progress=0.25)  # fmt: skip
    kl = rollout_kl_loss(logp, behav, lm, cfg)
    loss = reduce_loss(pg, lm, "sequence_mean", 11, 3) + token_mean(kl, lm, 11)
    loss.backward()
    drift = drift_sums(logp.detach(), behav, lm, versions, VERSION)
    return pg.detach(), kl.detach(), lm, metrics, loss.detach(), x.grad, drift


def _fused(logits, behav, adv, mask, versions, cfg, prox_arg, prox_mode):
    x = logits.clone().requires_grad_(True)
    logp = _logp(x, mask)
    start = logp.detach() if prox_mode == "current" else prox_arg
    t = objective_terms(logp, behav, adv, mask, versions, VERSION, cfg, logp_prox=start,
                        prox_offset=0.5, progress=0.25)  # fmt: skip
    loss = reduce_loss(t.policy, t.loss_mask, "sequence_mean", 11, 3) + token_mean(
        t.rollout_kl, t.loss_mask, 11
    )
    loss.backward()
    drift = drift_sums(logp.detach(), behav, t.loss_mask, versions, VERSION, t.log_ratio_behav)
    return t.policy.detach(), t.rollout_kl.detach(), t.loss_mask, t.metrics, loss.detach(), x.grad, drift


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(a, b), (what, (a - b).abs().max())


@pytest.mark.parametrize(
    "kw", CONFIGS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()) or "defaults"
)
@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("prox_mode", ["current", "exact", "loglinear"])
def test_objective_terms_equal_the_separate_functions_bit_for_bit(kw, edge, prox_mode) -> None:
    cfg = ObjectiveConfig(max_staleness=2, **kw)
    for seed in (0, 1):
        logits, behav, prox, adv, mask, versions = _batch(seed * 7 + len(kw), edge)
        prox_arg = None if prox_mode == "loglinear" else prox
        ref = _separate(logits, behav, adv, mask, versions, cfg, prox_arg, prox_mode)
        got = _fused(logits, behav, adv, mask, versions, cfg, prox_arg, prox_mode)
        for name, r, o in zip(
            ("pg", "kl", "loss_mask", "loss", "grad"), ref[:3] + ref[4:6], got[:3] + got[4:6], strict=True
        ):
            _same(o, r, name)
        assert set(got[3]) == set(ref[3])
        for k in ref[3]:
            _same(got[3][k], ref[3][k], k)
        assert set(got[6]) == set(ref[6])
        for k in ref[6]:
            _same(got[6][k], ref[6][k], k)
        assert torch.isfinite(got[5]).all()  # NaN-safe backward through every masked position
        lm = got[2]
        assert (got[5][~lm] == 0).all() and (got[0][~lm] == 0).all() and (got[1][~lm] == 0).all()
        if edge == "empty":
            assert got[4] == 0 and all(float(v) == 0 for k, v in got[3].items() if k != "num_tokens_in")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_policy_metrics_reused_intermediates_equal_recomputed(seed) -> None:
    """The intermediates the loss hands to policy_metrics are the ones it would form itself."""
    logits, behav, prox, adv, mask, versions = _batch(seed, "huge_ratio" if seed == 2 else "plain")
    cfg = ObjectiveConfig(max_staleness=2)
    logp = _logp(logits, mask)
    t = objective_terms(logp, behav, adv, mask, versions, VERSION, cfg, logp_prox=prox)
    lm = t.loss_mask
    w = torch.where(lm, torch.exp((torch.where(lm, prox, 0) - torch.where(lm, behav, 0)).clamp(-20, 20)), 1.0)
    w = w.clamp(max=cfg.is_cap)
    ratio = torch.exp((torch.where(lm, logp, 0) - torch.where(lm, prox, 0)).clamp(-20, 20))
    common = dict(logp=logp, logp_behav=behav, logp_prox=prox, ratio=ratio, w=w, sides={}, loss_mask=lm,
                  in_mask=mask, token_versions=versions, version=VERSION)  # fmt: skip
    w_raw = torch.exp((torch.where(lm, prox, 0) - torch.where(lm, behav, 0)).clamp(-20, 20))
    plain = policy_metrics(w_raw=w_raw, **common)
    reused = policy_metrics(w_raw=w_raw, **common, d=t.log_ratio_behav, rho=w_raw,
                            log_rho=(torch.where(lm, prox, 0) - torch.where(lm, behav, 0)).clamp(-20, 20))  # fmt: skip
    for k in plain:
        _same(reused[k], plain[k], k)
    # ... and the drift sums from the objective's log-ratio are those from the logprobs.
    a = drift_sums(logp, behav, lm, versions, VERSION)
    b = drift_sums(logp, behav, lm, versions, VERSION, t.log_ratio_behav)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("seed", range(4))
def test_drift_buckets_from_host_versions_give_the_same_metrics(seed: int, edge: str) -> None:
    """``versions_present`` (the host's token versions, a superset of those under the objective's mask,
    so no device sync picks the buckets) changes nothing the learner reports: the same non-empty
    buckets bit for bit, extra buckets with zero tokens, which ``_drift_split`` drops."""
    from asyncrl.learner.step import _drift_split

    logits, behav, _prox, _adv, mask, versions = _batch(seed, edge)
    logp = _logp(logits, mask)
    lm = mask & (
        torch.rand(mask.shape, generator=torch.Generator().manual_seed(seed)) < 0.6
    )  # the objective drops some
    host = torch.unique(versions[mask]).tolist() + [VERSION - 9]  # plus a version with no token at all
    plain = drift_sums(logp, behav, lm, versions, VERSION)
    ours = drift_sums(logp, behav, lm, versions, VERSION, versions_present=host)
    for k, v in plain.items():
        _same(ours[k], v, k)
    extra = set(ours) - set(plain)
    assert f"drift_n/{9}" in extra or not mask.any()
    assert all(float(ours[k]) == 0.0 for k in extra)
    for since in (0, 1):
        a = {k: float(v) for k, v in plain.items()}
        b = {k: float(v) for k, v in ours.items()}
        assert _drift_split(a, since) == _drift_split(b, since) and a == b
