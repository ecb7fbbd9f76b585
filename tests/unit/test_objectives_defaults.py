"""The objective at the DEFAULT config: composition, version convention, edge cases, config parity.

Issue 11: each named mechanism (DPPO mask against mu, k2 rollout KL, staleness-aware IS weight,
ratio cap) acts at the default objective; the ratio cap only once the weights moved within a step
(several mini-batches or epochs): at the demo's one update per step r = 1 and w <= is_cap (2) < 3,
so it cannot fire there. Staleness 0 in fp32 reduces exactly to the on-policy gradient;
k1 is refused as a loss; the entropy gradient stays finite when a probability underflows; the
bf16 DeepSpeed config accumulates and reduces gradients in fp32; config and objective agree.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from asyncrl.config import Config, ConfigError, LossConfig, explain, load_config
from asyncrl.learner.engine import ds_config
from asyncrl.learner.logprobs import token_logprobs
from asyncrl.learner.objectives import (
    ObjectiveConfig,
    entropy_from_logits,
    policy_loss,
    reduce_loss,
    rollout_kl_loss,
    token_mean,
)
from asyncrl.learner.step import _drift_split, prox_plan

V = 5


def objective(logp, behav, adv, mask, versions, cfg, prox=None, reduction="token_mean"):
    """The learner's loss for one micro-batch that is a whole optimizer step (step.Trainer)."""
    pg, lm, m = policy_loss(logp, behav, adv, mask, versions, V, cfg, logp_prox=prox)
    n, s = int(lm.sum()), int(lm.any(-1).sum())
    total = reduce_loss(pg, lm, reduction, n, s, max_tokens=mask.shape[1])
    return total + token_mean(rollout_kl_loss(logp, behav, lm, cfg), lm, n), m


def stale_batch():
    """Two sequences sampled one version ago (s = 1); the learner has drifted since.

    Token (0, 0): mu = 0.1, pi = 0.9, A > 0  -> DPPO (TV vs mu: 0.8 > 0.2) drops it.
    Other tokens: moderate drift, so the IS weight pi_prox/mu != 1 and the k2 gradient is != 0.
    """
    g = torch.Generator().manual_seed(0)
    behav = torch.log(torch.rand(2, 5, generator=g) * 0.5 + 0.2)
    logp = (behav + 0.3 * torch.randn(2, 5, generator=g)).clamp(max=-0.01)
    behav[0, 0], logp[0, 0] = math.log(0.1), math.log(0.9)
    mask = torch.ones(2, 5, dtype=torch.bool)
    versions = torch.full((2, 5), V - 1)
    adv = torch.tensor([1.0, -0.7])
    return logp, behav, adv, mask, versions


def grad_at(cfg, batch):
    logp, behav, adv, mask, versions = batch
    lp = logp.clone().requires_grad_()
    loss, m = objective(lp, behav, adv, mask, versions, cfg, prox=lp.detach())  # update 0: exact prox
    (g,) = torch.autograd.grad(loss, lp)
    return g, m


def test_each_mechanism_changes_the_gradient_of_a_stale_batch_at_the_defaults():
    batch = stale_batch()
    g, m = grad_at(ObjectiveConfig(), batch)
    assert float(m["dppo_masked_frac"]) > 0 and abs(float(m["is_weight_mean"]) - 1) > 0.01
    assert float(m["kl_mu_pi_k2"]) > 0
    for name, off in [
        ("DPPO mask", ObjectiveConfig(dppo_low=1e9, dppo_high=1e9)),
        ("k2 rollout KL", ObjectiveConfig(beta_rollout_kl=0.0)),
        ("staleness-aware IS weight", ObjectiveConfig(is_mode="none")),
    ]:
        g_off, _ = grad_at(off, batch)
        assert (g - g_off).abs().max() > 1e-5, f"{name} is inert at the defaults"
    # The DPPO-dropped token keeps only the KL pull back toward mu (pi > mu there: a positive grad).
    g_nokl, _ = grad_at(ObjectiveConfig(beta_rollout_kl=0.0), batch)
    assert g_nokl[0, 0] == 0 and g[0, 0] > 0


def test_issue_example_token_is_dropped_against_mu_and_kept_against_prox():
    """pi = 0.9, mu = 0.1, A = +1, one mini-batch (pi_prox = pi): DPPO around pi_prox never fires."""
    lp = torch.tensor([[math.log(0.9)]], requires_grad=True)
    behav = torch.tensor([[math.log(0.1)]])
    args = (behav, torch.tensor([1.0]), torch.ones(1, 1, dtype=torch.bool), torch.full((1, 1), V))
    for cfg, want in [(ObjectiveConfig(), 0.0), (ObjectiveConfig(anchor="prox"), -2.0)]:
        pg, _, _ = policy_loss(lp, *args, V, cfg, logp_prox=lp.detach())
        (g,) = torch.autograd.grad(pg.sum(), lp)
        assert float(g) == pytest.approx(want)  # prox-anchored: kept with weight min(9, 2) = 2


@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "seq_mean_token_sum_norm"])
def test_staleness_zero_fp32_is_exactly_the_on_policy_gradient(reduction):
    g = torch.Generator().manual_seed(1)
    logp = torch.log(torch.rand(3, 6, generator=g) * 0.9 + 0.05)
    mask = torch.rand(3, 6, generator=g) < 0.8
    mask[:, 0] = True
    adv = torch.randn(3, generator=g)
    versions = torch.full((3, 6), V)
    lp = logp.clone().requires_grad_()
    loss, m = objective(lp, logp.clone(), adv, mask, versions, ObjectiveConfig(), lp.detach(), reduction)
    (g_obj,) = torch.autograd.grad(loss, lp)
    lp2 = logp.clone().requires_grad_()
    n, s = int(mask.sum()), int(mask.any(-1).sum())
    plain = reduce_loss(-adv[:, None] * lp2, mask, reduction, n, s, max_tokens=6)
    (g_pg,) = torch.autograd.grad(plain, lp2)
    assert torch.equal(g_obj, g_pg) and g_pg.abs().max() > 1e-3
    for k, v in [
        ("ratio_mean", 1.0),
        ("is_weight_mean", 1.0),
        ("dppo_masked_frac", 0.0),
        ("kl_mu_pi_k3", 0.0),
    ]:
        assert float(m[k]) == v, k


def test_ratio_cap_bounds_a_negative_advantage_token_by_default():
    """A < 0, mu = 1e-6, pi = 0.5 at a later update (pi_prox = 1.5 mu): DPPO keeps it (pi moved up,
    A pushes it down), w = 1.5, r = pi / pi_prox ~ 2.2e5. The default cap 3 keeps loss 3|A|, no grad.
    (A later update: with one update per step pi_prox = pi, r = 1 and w * r <= is_cap < 3.)"""
    lp = torch.tensor([[math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    behav = torch.tensor([[math.log(1e-6)]], dtype=torch.float64)
    prox = behav + math.log(1.5)
    args = (
        behav,
        torch.tensor([-2.0], dtype=torch.float64),
        torch.ones(1, 1, dtype=torch.bool),
        torch.full((1, 1), V),
    )
    pg, _, m = policy_loss(lp, *args, V, ObjectiveConfig(), logp_prox=prox)
    assert float(pg.detach()) == pytest.approx(6.0) and float(m["dual_clip_frac"]) == 1.0
    (g,) = torch.autograd.grad(pg.sum(), lp)
    assert float(g) == 0.0
    pg_off, _, _ = policy_loss(lp, *args, V, ObjectiveConfig(dual_clip=0.0), logp_prox=prox)
    (g_off,) = torch.autograd.grad(pg_off.sum(), lp)
    assert float(g_off) == pytest.approx(1.5 * (0.5 / 1.5e-6) * 2.0, rel=1e-9)  # the e^20-scale weight


# ---------------------------------------------------------------------------------------------
# Where pi_prox comes from in the learner (step.prox_plan) and the drift split
# ---------------------------------------------------------------------------------------------


def test_prox_plan_uses_the_free_exact_prox_until_an_update_applies():
    # prox_plan(applied, epoch, mini_batches, epochs, exact, since_publish, publish_every)
    p = prox_plan(0, 0, 1, 1, False, 0, 1)
    assert (p.source, p.measure) == ("current", True)
    p = prox_plan(1, 0, 2, 1, False, 0, 1)
    assert (p.source, p.prox_offset, p.progress, p.measure) == ("loglinear", 0.0, 0.5, False)
    p = prox_plan(2, 1, 2, 2, False, 1, 2)  # publish_every 2, second step, update 2 of 4
    assert (p.source, p.prox_offset, p.progress) == ("loglinear", 0.5, 2 / 8)
    # The first mini-batch moved nothing (no loss tokens, or vetoed): the second still sees the
    # step-start weights, so its pi_prox is exact and its drift is measured.
    p = prox_plan(0, 0, 2, 1, False, 0, 1)
    assert (p.source, p.measure) == ("current", True)
    # Nothing applied in the whole first epoch: exact again in the second, but measured only once.
    p = prox_plan(0, 1, 2, 2, False, 0, 1)
    assert (p.source, p.measure) == ("current", False)
    assert prox_plan(3, 1, 2, 2, True, 0, 1).source == "exact"
    assert prox_plan(1, 0, 2, 2, True, 0, 1).measure and not prox_plan(2, 1, 2, 2, True, 0, 1).measure


def test_drift_split_by_staleness_and_publication():
    sums = {"drift_kl_sum/0": 0.2, "drift_n/0": 4.0, "drift_kl_sum/2": 3.0, "drift_n/2": 6.0,
            "drift_kl_sum/1": 1.0, "drift_n/1": 10.0, "log_ppl_gap_sum": -2.0}  # fmt: skip
    m = dict(sums)
    by_s = _drift_split(m, since_publish=0)
    assert by_s == {"0": 0.05, "1": 0.1, "2": 0.5} and list(by_s) == ["0", "1", "2"]
    assert m["mismatch_kl"] == 0.05 and m["mismatch_tokens"] == 4.0
    assert m["staleness_kl"] == pytest.approx(4.0 / 16) and m["log_ppl_gap"] == pytest.approx(-0.1)
    m = dict(sums)
    _drift_split(m, since_publish=1)  # weights are past V: s = 0 is no longer pure engine mismatch
    assert m["mismatch_kl"] == 0.0 and m["mismatch_tokens"] == 0.0


# ---------------------------------------------------------------------------------------------
# Entropy with underflowing probabilities
# ---------------------------------------------------------------------------------------------


class _Bigram(torch.nn.Module):
    """A real (tiny) causal LM: logits = a lookup table row of the current token."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(table)

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        return type("Out", (), {"logits": self.table[input_ids]})()


def test_entropy_value_and_gradient_finite_when_a_probability_underflows():
    logits = torch.tensor([[0.0, -200.0, 1.0, -1e4], [3.0, 2.0, -150.0, 0.5]])
    lg = logits.clone().requires_grad_()
    ent = entropy_from_logits(lg)
    ent.sum().backward()
    assert torch.isfinite(ent).all() and torch.isfinite(lg.grad).all()
    for b, row in enumerate(logits.tolist()):  # float64 loops: log p_i = l_i - lse, finite
        m = max(row)
        lse = m + math.log(math.fsum(math.exp(x - m) for x in row))
        logp = [x - lse for x in row]
        h = -math.fsum(math.exp(lp) * lp for lp in logp)
        assert float(ent[b].detach()) == pytest.approx(h, abs=1e-6)
        for j, lp in enumerate(logp):  # dH/dl_j = -p_j (log p_j + H)
            assert float(lg.grad[b, j]) == pytest.approx(-math.exp(lp) * (lp + h), abs=1e-6)
    # Through the learner's logprob path, with the entropy gradient on (entropy_coef > 0).
    model = _Bigram(torch.cat([logits, logits]))
    mb = {"input_ids": torch.tensor([[0, 1, 2, 3]]), "attention_mask": torch.ones(1, 4, dtype=torch.long),
          "temperature": torch.tensor([1.0])}  # fmt: skip
    logp, e = token_logprobs(model, mb, entropy=True, entropy_grad=True)
    (logp.sum() + e.sum()).backward()
    assert torch.isfinite(e).all() and torch.isfinite(model.table.grad).all()


# ---------------------------------------------------------------------------------------------
# Config: defaults, parity with load_config, k1, deep copies, explain, bf16 DeepSpeed config
# ---------------------------------------------------------------------------------------------


def test_objective_and_config_defaults_are_equal():
    loss_fields = {f.name: f.default for f in dataclasses.fields(LossConfig)}
    for f in dataclasses.fields(ObjectiveConfig):
        if f.name == "max_staleness":
            continue
        assert f.name in loss_fields, f.name
        assert getattr(ObjectiveConfig(), f.name) == loss_fields[f.name], f.name
    lc = Config().learner.loss
    assert ObjectiveConfig.from_loss_config(lc, 1) == dataclasses.replace(ObjectiveConfig(), max_staleness=1)


@pytest.mark.parametrize(
    "key, value",
    [("dual_clip", 0.0), ("dual_clip", 0.5), ("dual_clip", 1.0), ("dual_clip", 1.01), ("is_low", 0.0),
     ("is_low", 2.5), ("is_cap", 0.4), ("is_veto", 0.5), ("is_veto", 1.0), ("rollout_kl_kind", "k1"),
     ("rollout_kl_kind", "k3"), ("is_level", "geometric"), ("policy_loss", "cispo"), ("m2po_tau", 0.0),
     ("eps_low", 1.0), ("anchor", "prox"), ("anchor", "mu")],
)  # fmt: skip
def test_load_config_and_objective_accept_the_same_values(key, value):
    try:
        load_config(overrides=[f"learner.loss.{key}={value}"])
        loaded = True
    except ConfigError:
        loaded = False
    try:
        ObjectiveConfig(**{key: value})
        built = True
    except ValueError:
        built = False
    assert loaded == built, (key, value, loaded, built)


def test_k1_refused_as_a_loss_with_the_reason():
    for key in ("rollout_kl_kind", "ref_kl_kind"):
        with pytest.raises(ConfigError, match=rf"learner.loss.{key}='k1'.*AWAY.*metric"):
            load_config(overrides=[f"learner.loss.{key}=k1"])


def test_nested_defaults_are_not_shared_between_configs():
    a, b = Config(), Config()
    a.learner.loss.ref_kl_coef = 0.5
    a.model.tiny.hidden_size = 64
    assert b.learner.loss.ref_kl_coef == 0.0 and b.model.tiny.hidden_size == 128
    assert Config().learner.loss.ref_kl_coef == 0.0


def test_explain_documents_the_composition_at_the_defaults():
    text = "\n".join(explain())
    for needle in ("r_t = pi_theta/pi_prox carries the gradient", "w_t = min(pi_prox/mu, is_cap)",
                   "DPPO-TV mask taken against mu", "learner.loss.anchor = 'behaviour'"):  # fmt: skip
        assert needle in text, needle


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_deepspeed_config_accumulates_and_reduces_in_fp32(stage):
    cfg = Config()
    cfg.learner.zero_stage = stage
    cfg.model.dtype = "bfloat16"
    conf = ds_config(cfg, guard_clips=False)
    assert conf["bf16"]["enabled"] is True
    assert conf["data_types"] == {"grad_accum_dtype": "fp32"}
    assert conf["communication_data_type"] == "fp32"
    # DeepSpeed 0.19 has no fp32 accumulation for ZeRO-0 bf16: stage 0 runs its ZeRO-1 BF16 optimizer.
    assert conf["zero_optimization"]["stage"] == max(stage, 1)
    cfg.model.dtype = "float32"
    conf = ds_config(cfg, guard_clips=stage == 0)
    assert "bf16" not in conf and "data_types" not in conf and conf["zero_optimization"]["stage"] == stage
