"""Helpers of the weight-swap tests (tests/integration/test_weight_swap.py, test_tied_swap.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def perturbed(base: dict[str, torch.Tensor]) -> Callable[[int], dict[str, torch.Tensor]]:
    """version -> ``base`` plus seeded noise (version 0: ``base`` itself); every version differs."""

    def weights(version: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + version)
        return {k: v + 0.05 * torch.randn(v.shape, generator=g) * (version > 0) for k, v in base.items()}

    return weights
