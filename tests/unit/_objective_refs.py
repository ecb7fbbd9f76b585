"""Slow, obvious float64 reference code for the objective tests (python loops, one scalar at a time).

Written straight from the formulas in issue 11 and the papers; shares no code with
asyncrl.learner.objectives. Used by tests/unit/test_objectives*.py.
"""

from __future__ import annotations

import itertools
import math

import torch

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
    # k3 (exp) and the k1 metric use the clamped log-ratio; k2 and abs the plain one (a finite one).
    raw = lp - lr
    d = raw if kind in ("abs", "k2") and math.isfinite(raw) else clamp(raw)
    if kind == "k3":
        return math.exp(-d) + d - 1
    return {"k1": d, "abs": abs(d), "k2": d * d / 2}[kind]


def ref_dppo(lp: float, la: float, a: float, divergence: str, low: float, high: float) -> tuple[bool, bool]:
    """(drop_low, drop_high) for one token, straight from the DPPO definitions."""
    p, q = math.exp(lp), math.exp(la)
    if divergence == "tv":
        return (a < 0 and q - p > low), (a > 0 and p - q > high)
    p = min(max(p, 1e-6), 1 - 1e-6)
    q = min(max(q, 1e-6), 1 - 1e-6)
    d = q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))
    return (a < 0 and p < q and d > low), (a > 0 and p > q and d > high)


def ref_prox(lp: float, lb: float, s: int, offset: float = 0.0, progress: float = 1.0) -> float:
    """A-3PO: alpha = (s + o) / (s + o + p), alpha = 1 when that is 0/0."""
    num = s + offset
    den = num + progress
    alpha = num / den if den > 0 else 1.0
    return lb + alpha * (lp - lb)


def ref_weights(lnum, lbehav, mask, mode, cap, low, level, veto=0.0) -> list[list[float]]:
    """IS weights over a [B][T] grid; masked positions get weight 1."""
    B, T = mask.shape
    w = [[1.0] * T for _ in range(B)]

    def f(rho: float) -> float:
        if mode == "tis":
            return min(rho, cap)
        if mode == "icepop":
            return rho if low <= rho <= cap else 0.0
        return 1.0

    for b in range(B):
        toks = [t for t in range(T) if mask[b, t]]
        logs = [clamp(float(lnum[b, t]) - float(lbehav[b, t])) for t in toks]
        if level == "sequence":
            seq = f(math.exp(clamp(math.fsum(logs)))) if toks else 1.0
        elif level == "geometric":
            seq = f(math.exp(clamp(math.fsum(logs) / len(toks)))) if toks else 1.0
        vetoed = veto > 0 and any(math.exp(x) < veto for x in logs)
        for t, x in zip(toks, logs, strict=True):
            v = seq if level in ("sequence", "geometric") else f(math.exp(x))
            w[b][t] = 0.0 if vetoed else v
    return w


def ref_m2po_keep(lp, lanchor, mask, tau) -> list[list[bool]]:
    """Drop the largest d^2 (ties: lowest flat index) until mean(d^2) of the rest <= tau."""
    B, T = mask.shape
    items = [
        (clamp(float(lp[b, t]) - float(lanchor[b, t])) ** 2, b * T + t)
        for b in range(B)
        for t in range(T)
        if mask[b, t]
    ]
    kept = list(items)
    while kept and math.fsum(x for x, _ in kept) / len(kept) > tau:
        top = max(kept, key=lambda it: (it[0], -it[1]))
        kept.remove(top)
    ids = {i for _, i in kept}
    return [[bool(mask[b, t]) and (b * T + t) in ids for t in range(T)] for b in range(B)]


def exact_kl(p: list[float], q: list[float]) -> float:
    """KL(p || q) of two categorical distributions."""
    return math.fsum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True) if pi > 0)


def ref_policy(logp, logp_behav, adv, mask, versions, cfg, logp_prox=None, offset=0.0, progress=1.0):
    """Per-token policy loss, d loss_t / d logp_t (scalar autograd), loss mask and metrics.

    Straight from the table in asyncrl.learner.objectives.policy, one token at a time.
    """
    B, T = mask.shape
    lm = [[bool(mask[b, t]) and (cfg.max_staleness is None or VERSION - int(versions[b, t]) <= cfg.max_staleness)
           for t in range(T)] for b in range(B)]  # fmt: skip
    lmt = torch.tensor(lm, dtype=torch.bool).reshape(B, T)
    prox = [[0.0] * T for _ in range(B)]
    for b, t in cells(mask):
        if lm[b][t]:
            lp, lb, s = float(logp[b, t]), float(logp_behav[b, t]), VERSION - int(versions[b, t])
            prox[b][t] = (
                float(logp_prox[b, t]) if logp_prox is not None else ref_prox(lp, lb, s, offset, progress)
            )
    anchor = [
        [float(logp_behav[b, t]) if cfg.anchor == "behaviour" else prox[b][t] for t in range(T)]
        for b in range(B)
    ]
    prox_t = torch.tensor(prox, dtype=torch.float64).reshape(B, T)
    anchor_t = torch.tensor(anchor, dtype=torch.float64).reshape(B, T)
    mask_loss = cfg.policy_loss in ("dppo", "m2po")
    is_args = (cfg.is_mode, cfg.is_cap, cfg.is_low, cfg.is_level, cfg.is_veto)
    if mask_loss:
        w = ref_weights(prox_t, logp_behav, lmt, *is_args)
    elif cfg.anchor == "prox":
        w = ref_weights(anchor_t, logp_behav, lmt, *is_args)
    else:
        w = [[1.0] * T for _ in range(B)]
    # Truncated: a positive weight below the untruncated ratio at its level (only tis truncates; with
    # is_mode none, or no IS at all, nothing is). The untruncated ratio: icepop's with no bounds.
    weighted = cfg.is_mode != "none" and (mask_loss or cfg.anchor == "prox")
    w_raw = ref_weights(prox_t, logp_behav, lmt, "icepop", math.inf, 0.0, cfg.is_level) if weighted else w
    m2keep = ref_m2po_keep(logp, anchor_t, lmt, cfg.m2po_tau) if cfg.policy_loss == "m2po" else None
    seq_log = {}
    for b in range(B):
        toks = [t for t in range(T) if lm[b][t]]
        if toks:
            seq_log[b] = clamp(math.fsum(clamp(float(logp[b, t]) - anchor[b][t]) for t in toks) / len(toks))
    loss = [[0.0] * T for _ in range(B)]
    grad = [[0.0] * T for _ in range(B)]
    acc = {
        k: []
        for k in [
            "ratio",
            "dl",
            "dh",
            "m2",
            "cl",
            "ch",
            "dual",
            "w",
            "k1",
            "k2",
            "k3",
            "kis",
            "chi2",
            "trunc",
        ]
    }
    for b, t in cells(mask):
        if not lm[b][t]:
            continue
        a = adv_at(adv, b, t)
        lpv = float(logp[b, t])
        lp = torch.tensor(lpv, dtype=torch.float64, requires_grad=True)
        lb, px, anc, wt = float(logp_behav[b, t]), prox[b][t], anchor[b][t], w[b][t]
        unit = torch.exp(lp - lp.detach())
        dl = dh = m2 = cl = ch = False
        if mask_loss:
            r = torch.exp(torch.clamp(lp - px, -CLAMP, CLAMP))
            if cfg.policy_loss == "dppo":
                dl, dh = ref_dppo(lpv, anc, a, cfg.divergence, cfg.dppo_low, cfg.dppo_high)
                keep = not (dl or dh)
            else:
                keep = m2keep[b][t]
                m2 = not keep
            pg = -wt * r * a if keep else torch.zeros((), dtype=torch.float64)
        elif cfg.policy_loss == "cispo":
            rv = math.exp(clamp(lpv - anc))
            lo, hi = 1 - cfg.eps_low, 1 + cfg.eps_high
            cl, ch = rv < lo, rv > hi
            r = torch.tensor(rv, dtype=torch.float64)
            pg = -wt * min(max(rv, lo), hi) * a * unit
        else:
            if cfg.policy_loss == "gspo":
                r = math.exp(seq_log[b]) * unit
                lo, hi = 1 - cfg.gspo_eps_low, 1 + cfg.gspo_eps_high
            else:
                r = torch.exp(torch.clamp(lp - anc, -CLAMP, CLAMP))
                lo, hi = 1 - cfg.eps_low, 1 + cfg.eps_high
            unclipped = -a * r
            clipped = -a * torch.clamp(r, lo, hi)
            active = float(clipped) > float(unclipped)
            cl, ch = active and a < 0, active and a > 0
            pg = wt * (clipped if active else unclipped)
        dual = cfg.dual_clip > 0 and a < 0 and float(pg) > -cfg.dual_clip * a
        if dual:
            pg = torch.tensor(-cfg.dual_clip * a, dtype=torch.float64)
        g = torch.autograd.grad(pg, lp, allow_unused=True)[0] if pg.requires_grad else None
        loss[b][t] = float(pg.detach())
        grad[b][t] = 0.0 if g is None else float(g)
        d = clamp(lpv - lb)
        rho = math.exp(clamp(px - lb))
        for k, v in [("ratio", float(r.detach()) if torch.is_tensor(r) else r), ("dl", dl), ("dh", dh), ("m2", m2), ("cl", cl), ("ch", ch),
                     ("dual", dual), ("w", wt), ("k1", -d), ("k2", d * d / 2), ("k3", math.exp(d) - 1 - d),
                     ("kis", d * math.exp(d) - (math.exp(d) - 1)), ("chi2", rho * rho - 1)]:  # fmt: skip
            acc[k].append(float(v))
        acc["trunc"].append(float(0.0 < wt < w_raw[b][t]))
    stale = [VERSION - int(versions[b, t]) for b, t in cells(mask) if mask[b, t]]

    def mean(xs):
        return math.fsum(xs) / len(xs) if xs else 0.0

    ws = acc["w"]
    metrics = {
        "ratio_mean": mean(acc["ratio"]),
        "dppo_masked_frac": mean(acc["dl"]) + mean(acc["dh"]),
        "dppo_masked_frac_low": mean(acc["dl"]),
        "dppo_masked_frac_high": mean(acc["dh"]),
        "m2po_masked_frac": mean(acc["m2"]),
        "clip_frac_low": mean(acc["cl"]),
        "clip_frac_high": mean(acc["ch"]),
        "dual_clip_frac": mean(acc["dual"]),
        "is_weight_mean": mean(ws),
        "is_trunc_frac": mean(acc["trunc"]),
        "is_weight_max": max(ws) if ws else 0.0,
        "ess": (sum(ws) ** 2 / (len(ws) * sum(x * x for x in ws)))
        if ws and sum(x * x for x in ws) > 0
        else 0.0,
        "kl_mu_pi_k1": mean(acc["k1"]),
        "kl_mu_pi_k2": mean(acc["k2"]),
        "kl_mu_pi_k3": mean(acc["k3"]),
        "kl_pi_mu_is": mean(acc["kis"]),
        "is_chi2": mean(acc["chi2"]),
        "staleness_mean": mean(stale),
        "staleness_max": float(max(stale)) if stale else 0.0,
        "stale_dropped_frac": mean([0.0 if lm[b][t] else 1.0 for b, t in cells(mask) if mask[b, t]]),
        "num_tokens": float(sum(map(sum, lm))),
        "num_seqs": float(sum(any(row) for row in lm)),
    }
    return loss, grad, lm, metrics
