"""Field helper, error type and config directory: the building blocks of every section.

Part of :mod:`asyncrl.config` (imports neither torch, vllm nor ray)."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import field
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names the full key path."""


def F(default: Any, doc: str, *, choices: tuple | None = None, ge=None, gt=None, le=None, lt=None) -> Any:
    """A documented, validated dataclass field (doc = meaning, unit, trade-off)."""
    meta = {"doc": doc, "choices": choices, "ge": ge, "gt": gt, "le": le, "lt": lt}
    if isinstance(default, list | dict) or dataclasses.is_dataclass(default):
        return field(default_factory=lambda: _copy(default), metadata=meta)
    return field(default=default, metadata=meta)


def _copy(v: Any) -> Any:
    # Deep: a shallow replace shared nested defaults (e.g. learner.loss) between Config() instances.
    return copy.deepcopy(v)
