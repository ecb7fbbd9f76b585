"""ObjectiveConfig: the knobs of the objective, validated by the same rules as ``learner.loss``.

Every field shared with :class:`asyncrl.config.LossConfig` has the same name, type and default, and
is checked by :func:`asyncrl.config.validate_loss`, so a value ``load_config`` accepts is a value the
objective accepts and vice versa (tests/unit/test_objectives_config.py holds both to that).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from asyncrl.config import LossConfig, validate_loss

__all__ = ["ObjectiveConfig", "RATIO_CLIP_LOSSES", "MASK_LOSSES"]

#: Losses that clip the ratio pi_theta / pi_anchor (IS weight = IS(pi_anchor / mu)).
RATIO_CLIP_LOSSES = ("ppo_clip", "gspo", "cispo")
#: Losses that mask -w r A with r = pi_theta / pi_prox, w = IS(pi_prox / mu).
MASK_LOSSES = ("dppo", "m2po")


@dataclass
class ObjectiveConfig:
    """Knobs of :func:`~asyncrl.learner.objectives.policy_loss`; docs: ``asyncrl config --explain``."""

    anchor: str = "behaviour"
    policy_loss: str = "dppo"
    divergence: str = "tv"
    dppo_low: float = 0.2
    dppo_high: float = 0.2
    m2po_tau: float = 0.04
    eps_low: float = 0.2
    eps_high: float = 0.28
    gspo_eps_low: float = 3e-4
    gspo_eps_high: float = 4e-4
    dual_clip: float = 3.0
    is_mode: str = "tis"
    is_level: str = "token"
    is_cap: float = 2.0
    is_low: float = 0.5
    is_veto: float = 0.0
    beta_rollout_kl: float = 1e-3
    rollout_kl_kind: str = "k2"
    max_staleness: int | None = None
    """Tokens with V - v_t > max_staleness leave the loss mask; None keeps all (buffer.max_staleness)."""

    def __post_init__(self) -> None:
        shared = {f.name for f in dataclasses.fields(LossConfig)}
        validate_loss(LossConfig(**{k: v for k, v in dataclasses.asdict(self).items() if k in shared}))
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"ObjectiveConfig.max_staleness must be >= 0, got {self.max_staleness}")

    @classmethod
    def from_loss_config(cls, lc: LossConfig, max_staleness: int | None) -> ObjectiveConfig:
        """The objective's config from ``learner.loss`` and ``buffer.max_staleness``."""
        names = {f.name for f in dataclasses.fields(cls)} - {"max_staleness"}
        return cls(**{n: getattr(lc, n) for n in names}, max_staleness=max_staleness)
