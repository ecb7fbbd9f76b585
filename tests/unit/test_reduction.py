"""Loss reduction, DeepSpeed scaling and metric aggregation.

Reductions are checked against python-loop float64 references; the global-denominator design is
checked end to end: the same optimizer step split into micro-batches of 1, 2, 4 and all
sequences, on 1 or 2 simulated data-parallel ranks (DeepSpeed's 1/GAS inside backward and the
rank-averaging all-reduce simulated explicitly), must give the same gradient on the parameters
of a small linear "model", with the rollout-KL, reference-KL and entropy terms switched on.
The regularisers are token means over the step whatever the policy reduction, and Dr.GRPO's
normaliser counts sampled sequences, not masked ones.
"""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.learner.objectives import (
    LOSS_REDUCTIONS,
    LossDenominators,
    MetricAccumulator,
    ObjectiveConfig,
    aggregate_metrics,
    count_denominators,
    deepspeed_loss_scale,
    entropy_bonus,
    entropy_from_logits,
    kl_penalty,
    policy_loss,
    reduce_loss,
    rollout_kl_loss,
    staleness_mask,
    token_mean,
)

VERSION = 7


def random_loss(seed: int, B: int, T: int):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(B, T, generator=g, dtype=torch.float64) * 3
    mask = torch.rand(B, T, generator=g) < 0.6
    mask[0] = False  # empty sequence
    if B > 2:
        mask[2] = True  # full sequence
    loss = torch.where(mask, loss, torch.full_like(loss, float("inf")))  # garbage must not leak
    return loss, mask


def ref_reduce(loss, mask, mode, n_tok, n_seq, max_tokens):
    B, T = mask.shape
    total = 0.0
    for b in range(B):
        s = sum(float(loss[b, t]) for t in range(T) if mask[b, t])
        n = sum(1 for t in range(T) if mask[b, t])
        if mode == "token_mean":
            total += s / n_tok
        elif mode == "sequence_mean":
            total += (s / n if n else 0.0) / n_seq
        else:
            total += (s / max_tokens) / n_seq
    return total


@pytest.mark.parametrize("mode", LOSS_REDUCTIONS)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (6, 9)])
def test_reduce_loss_matches_reference(mode, seed, shape):
    loss, mask = random_loss(seed, *shape)
    n_tok, n_seq, max_tokens = 37, 5, 12  # global denominators: unrelated to this micro-batch
    out = reduce_loss(loss, mask, mode, n_tok, n_seq, max_tokens=max_tokens)
    assert abs(float(out) - ref_reduce(loss, mask, mode, n_tok, n_seq, max_tokens)) < 1e-9
    out_t = reduce_loss(loss, mask, mode, torch.tensor(n_tok), torch.tensor(n_seq), max_tokens=max_tokens)
    assert abs(float(out_t) - float(out)) < 1e-12
    tok = reduce_loss(loss, mask, "token_mean", n_tok, n_seq)
    assert abs(float(token_mean(loss, mask, n_tok)) - float(tok)) < 1e-12
    assert abs(float(entropy_bonus(loss, mask, 0.3, n_tok)) + 0.3 * float(tok)) < 1e-12


@pytest.mark.parametrize("mode", LOSS_REDUCTIONS)
def test_reduce_loss_zero_denominators_and_masked_inf(mode):
    loss = torch.full((2, 3), float("inf"), requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    out = reduce_loss(loss, mask, mode, 0, 0, max_tokens=4)
    out.backward()
    assert float(out.detach()) == 0.0 and (loss.grad == 0).all()


def test_reduce_loss_rejects_bad_arguments():
    loss, mask = random_loss(0, 2, 2)
    with pytest.raises(ValueError):
        reduce_loss(loss, mask, "seq_mean_token_sum_norm", 3, 2)
    with pytest.raises(ValueError):
        reduce_loss(loss, mask, "mean", 3, 2)
    with pytest.raises(ValueError):
        deepspeed_loss_scale(0, 1)


def test_count_denominators_matches_loops():
    masks = [random_loss(s, 4, 7)[1] for s in range(3)] + [torch.zeros(0, 7, dtype=torch.bool)]
    tokens = sum(int(m[b, t]) for m in masks for b in range(m.shape[0]) for t in range(m.shape[1]))
    seqs = sum(any(bool(x) for x in m[b]) for m in masks for b in range(m.shape[0]))
    assert count_denominators(masks) == LossDenominators(tokens, seqs)
    assert count_denominators([]) == (0, 0)


def test_deepspeed_loss_scale():
    assert deepspeed_loss_scale(1, 1) == 1.0
    assert deepspeed_loss_scale(4, 8) == 32.0


# ---------------------------------------------------------------------------------------------
# Gradient invariance over micro-batch / data-parallel splits
# ---------------------------------------------------------------------------------------------

B, T, D, V = 8, 6, 5, 11
ENT_COEF, REF_KL_COEF = 0.03, 0.05


def make_problem(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    w0 = torch.randn(D, V, generator=g) * 0.7
    with torch.no_grad():
        logp0 = torch.log_softmax(x @ w0, -1).gather(-1, tokens[..., None])[..., 0]
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[3] = False  # a sequence without loss tokens
    return {
        "x": x,
        "tokens": tokens,
        "w0": w0,
        "behav": logp0 + 0.4 * torch.randn(B, T, generator=g),
        "ref": logp0 + 0.2 * torch.randn(B, T, generator=g),
        "adv": torch.randn(B, generator=g),
        "mask": mask,
        "versions": VERSION - torch.randint(0, 5, (B, T), generator=g),
    }


def micro_batch_loss(w, pb, idx, cfg, mode, n_tok, n_seq):
    """The learner's per-micro-batch loss: every term reduced with the global denominators
    (policy: ``mode``; rollout KL, reference KL, entropy: token means over the step)."""
    logits = pb["x"][idx] @ w
    logp = torch.log_softmax(logits, -1).gather(-1, pb["tokens"][idx][..., None])[..., 0]
    loss, lmask, _ = policy_loss(
        logp, pb["behav"][idx], pb["adv"][idx], pb["mask"][idx], pb["versions"][idx], VERSION, cfg
    )
    reg = rollout_kl_loss(logp, pb["behav"][idx], lmask, cfg) + REF_KL_COEF * kl_penalty(
        logp, pb["ref"][idx], "k3", lmask
    )
    total = reduce_loss(loss, lmask, mode, n_tok, n_seq, max_tokens=T) + token_mean(reg, lmask, n_tok)
    return total + entropy_bonus(entropy_from_logits(logits), lmask, ENT_COEF, n_tok)


def step_gradient(pb, split, cfg, mode, local_denominators=False):
    """Simulate one DeepSpeed step. ``split[rank][micro_batch]`` = sequence indices."""
    world, gas = len(split), len(split[0])
    assert all(len(r) == gas for r in split)
    # Per-rank counts from the loss masks (known before any forward), then all-reduce SUM.
    per_rank = [
        count_denominators(
            staleness_mask(pb["mask"][idx], pb["versions"][idx], VERSION, cfg.max_staleness) for idx in rank
        )
        for rank in split
    ]
    n_tok, n_seq = sum(d.tokens for d in per_rank), sum(d.seqs for d in per_rank)
    scale = deepspeed_loss_scale(gas, world)
    rank_grads = []
    for rank in split:
        w = pb["w0"].clone().requires_grad_()
        for idx in rank:
            if local_denominators:  # the bug this design prevents: micro-batch-local means
                lm = staleness_mask(pb["mask"][idx], pb["versions"][idx], VERSION, cfg.max_staleness)
                n_tok, n_seq = count_denominators([lm])
                scale = 1.0
            loss = micro_batch_loss(w, pb, idx, cfg, mode, n_tok, n_seq) * scale
            (loss / gas).backward()  # DeepSpeed engine.backward divides by GAS
        rank_grads.append(w.grad)
    return torch.stack(rank_grads).mean(0)  # all-reduce averages over data-parallel ranks


def split_into(indices: list[int], world: int, mbs: int) -> list[list[list[int]]]:
    per_rank = len(indices) // world
    ranks = [indices[r * per_rank : (r + 1) * per_rank] for r in range(world)]
    return [[rank[i : i + mbs] for i in range(0, per_rank, mbs)] for rank in ranks]


CFGS = [
    ObjectiveConfig(beta_rollout_kl=0.1, max_staleness=3),
    ObjectiveConfig(policy_loss="ppo_clip", anchor="prox", is_level="sequence", rollout_kl_kind="k3"),
    ObjectiveConfig(is_mode="icepop", divergence="kl", dppo_low=0.02, dppo_high=0.02),
    ObjectiveConfig(policy_loss="gspo", anchor="prox", gspo_eps_low=0.1, gspo_eps_high=0.1),
]


@pytest.mark.parametrize("cfg", CFGS, ids=["dppo", "ppo-prox-seqIS", "dppo-kl-icepop", "gspo"])
@pytest.mark.parametrize("mode", LOSS_REDUCTIONS)
def test_gradient_invariant_to_micro_batch_and_rank_split(mode, cfg):
    pb = make_problem(0)
    full = step_gradient(pb, [[list(range(B))]], cfg, mode)
    assert full.abs().max() > 1e-3
    shuffled = [5, 2, 7, 0, 3, 6, 1, 4]
    for world in (1, 2):
        for mbs in (1, 2, 4, B // world):
            for order in (list(range(B)), shuffled):
                g = step_gradient(pb, split_into(order, world, mbs), cfg, mode)
                rel = ((g - full).abs().max() / full.abs().max()).item()
                assert rel < 1e-5, (world, mbs, order, rel)


@pytest.mark.parametrize("mode", ["token_mean", "sequence_mean"])
def test_local_denominators_break_invariance(mode):
    """Negative control: the invariance test above can fail. Micro-batch-local means weight
    tokens by how the step was split (and multiply regularisers by GAS without the scale)."""
    pb = make_problem(0)
    cfg = CFGS[0]
    full = step_gradient(pb, [[list(range(B))]], cfg, mode)
    g = step_gradient(pb, split_into(list(range(B)), 1, 2), cfg, mode, local_denominators=True)
    assert ((g - full).abs().max() / full.abs().max()).item() > 1e-2


def test_entropy_and_kl_terms_scale_once_not_per_micro_batch():
    """SkyRL PR 1296 review bug: with zero policy signal, the regularisers alone must give the
    same gradient for GAS = 1 and GAS = 8 (not 8x larger)."""
    pb = make_problem(1)
    pb["adv"] = torch.zeros(B)
    cfg = ObjectiveConfig(beta_rollout_kl=0.2)
    full = step_gradient(pb, [[list(range(B))]], cfg, "token_mean")
    split = step_gradient(pb, split_into(list(range(B)), 1, 1), cfg, "token_mean")
    assert full.abs().max() > 1e-3
    assert ((split - full).abs().max() / full.abs().max()).item() < 1e-5


@pytest.mark.parametrize("mode", LOSS_REDUCTIONS)
def test_regularisers_are_token_means_whatever_the_policy_reduction(mode):
    """With zero advantages only the regularisers act: their gradient is the same for every policy
    reduction (each is sum_t term_t / N over the step's loss tokens)."""
    pb = make_problem(1)
    pb["adv"] = torch.zeros(B)
    cfg = ObjectiveConfig(beta_rollout_kl=0.2)
    want = step_gradient(pb, [[list(range(B))]], cfg, "token_mean")
    got = step_gradient(pb, split_into(list(range(B)), 2, 2), cfg, mode)
    assert want.abs().max() > 1e-3
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


def test_dr_grpo_normaliser_ignores_overlong_masked_sequences():
    """seq_mean_token_sum_norm divides by S_all * max_tokens, S_all = sampled sequences: masking a
    sequence's loss (overlong) removes its terms but leaves every other token's weight unchanged."""
    loss, mask = random_loss(3, 6, 5)
    loss = torch.where(mask, loss, torch.zeros_like(loss)).requires_grad_()
    full = reduce_loss(loss, mask, "seq_mean_token_sum_norm", 0, 6, max_tokens=5)
    (g_full,) = torch.autograd.grad(full, loss)
    overlong = mask.clone()
    overlong[2] = False  # its loss mask cleared; S_all is still 6
    (g_ov,) = torch.autograd.grad(reduce_loss(loss, overlong, "seq_mean_token_sum_norm", 0, 6, 5), loss)
    keep = overlong
    assert torch.equal(g_ov[keep], g_full[keep]) and (g_ov[2] == 0).all()
    assert torch.allclose(g_full[mask], torch.full_like(g_full[mask], 1 / 30))


def test_entropy_from_logits_matches_loops():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=g, dtype=torch.float64) * 4
    out = entropy_from_logits(logits)
    for b in range(2):
        for t in range(3):
            z = [float(v) for v in logits[b, t]]
            m = max(z)
            s = sum(math.exp(v - m) for v in z)
            p = [math.exp(v - m) / s for v in z]
            assert abs(float(out[b, t]) - -sum(q * math.log(q) for q in p)) < 1e-5


# ---------------------------------------------------------------------------------------------
# Metric aggregation across micro-batches and ranks
# ---------------------------------------------------------------------------------------------


def test_metric_accumulator_merges_ranks_like_the_full_batch():
    pb = make_problem(2)
    cfg = ObjectiveConfig(
        policy_loss="ppo_clip", dual_clip=2.0, max_staleness=2, is_mode="icepop", anchor="prox"
    )
    logp = pb["behav"] + 0.5 * torch.randn(B, T, generator=torch.Generator().manual_seed(9))
    logp = logp.double()

    def metrics(idx):
        return policy_loss(
            logp[idx],
            pb["behav"][idx].double(),
            pb["adv"][idx].double(),
            pb["mask"][idx],
            pb["versions"][idx],
            VERSION,
            cfg,
        )[2]

    full = metrics(list(range(B)))
    ranks = []
    for rank in split_into([4, 1, 6, 0, 2, 7, 5, 3], 2, 1):
        acc = MetricAccumulator()
        for idx in rank:
            acc.update(metrics(idx))
        ranks.append(acc)
    merged = MetricAccumulator()
    for acc in ranks:
        merged.merge(acc.state())  # what all_gather_object of state() would deliver
    got = merged.compute()
    assert set(got) == set(full)
    for k, v in full.items():
        assert abs(got[k] - float(v)) < 1e-9 * max(1.0, abs(float(v))), (k, got[k], float(v))
    assert got["num_tokens"] > 0 and 0 < got["ess"] <= 1


def test_ess_is_nan_without_loss_tokens_and_zero_when_every_weight_is_masked():
    """Not measured (no loss tokens) is NaN, never 0: the adaptive bound reads 0 as the worst ESS."""
    none = MetricAccumulator()
    none.update({"num_tokens": 0.0, "is_weight_mean": 0.0, "is_weight_sq_mean": 0.0})
    assert math.isnan(none.compute()["ess"])
    masked = MetricAccumulator()
    masked.update({"num_tokens": 5.0, "is_weight_mean": 0.0, "is_weight_sq_mean": 0.0})
    assert masked.compute()["ess"] == 0.0
    some = MetricAccumulator()
    some.update({"num_tokens": 2.0, "is_weight_mean": 0.5, "is_weight_sq_mean": 0.5})
    assert some.compute()["ess"] == 0.5


def test_unknown_metrics_average_uniformly_and_floats_work():
    agg = aggregate_metrics(
        [
            {"loss": 1.0, "num_tokens": 3.0, "ratio_mean": 2.0},
            {"loss": torch.tensor(3.0), "num_tokens": torch.tensor(1.0), "ratio_mean": torch.tensor(6.0)},
        ]
    )
    assert agg == {"loss": 2.0, "num_tokens": 4.0, "ratio_mean": 3.0}
    assert aggregate_metrics([]) == {}
