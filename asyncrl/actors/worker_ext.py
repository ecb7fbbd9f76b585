"""vLLM worker extension: in-place weight reload from a published safetensors file.

vLLM mixes this class into its worker (``worker_extension_cls``), so ``self`` is the worker and
``self.reload_weights`` / ``self.vllm_config`` are vLLM's. The engine wrapper reaches these methods
through ``AsyncLLM.collective_rpc`` while generation is paused.

Invariant: a reload either loads every tensor the served checkpoint has, or raises before touching
the model. vLLM itself only logs a warning for weights missing from an iterator, which would leave
a silently half-updated policy; the name check below turns that into an error.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

__all__ = ["WeightReloadExtension", "EXTENSION_CLS"]

EXTENSION_CLS = f"{__name__}.WeightReloadExtension"
_TIED_OK = {"lm_head.weight"}


def _checkpoint_names(model_dir: Path) -> set[str]:
    """Tensor names of the safetensors checkpoint the engine was started from."""
    from safetensors import safe_open

    names: set[str] = set()
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            names.update(fh.keys())
    return names


class WeightReloadExtension:
    """Methods added to every vLLM worker."""

    def reload_weights_from(self, path: str) -> dict:
        """Load all tensors of ``path`` into the running model, in place.

        ``path`` is a safetensors file, or a directory whose ``*.safetensors`` files are loaded
        together (a sharded checkpoint). Returns ``{"seconds": ..., "tensors": ...}``. Raises
        ``ValueError`` if the weights miss a tensor of the original checkpoint or have one it does
        not know (weights of another model), before any parameter is touched.
        """
        from safetensors import safe_open

        t0 = time.perf_counter()
        expected = getattr(self, "_asyncrl_expected_names", None)
        if expected is None:
            expected = _checkpoint_names(Path(self.vllm_config.model_config.model))
            self._asyncrl_expected_names = expected
        p = Path(path)
        files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
        if not files:
            raise ValueError(f"{path}: no safetensors files")
        with ExitStack() as stack:
            handles = [stack.enter_context(safe_open(str(f), framework="pt")) for f in files]
            owner = {name: fh for fh in handles for name in fh.keys()}
            names = set(owner)
            if expected:
                # A tied lm_head is saved by some trainers and skipped by vLLM: not an error.
                missing, extra = sorted(expected - names), sorted(names - expected - _TIED_OK)
                if missing or extra:
                    raise ValueError(
                        f"{path}: tensor names do not match the served model "
                        f"(missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                        f"unexpected {extra[:5]}{'...' if len(extra) > 5 else ''})"
                    )

            def tensors() -> Iterator:
                for name in sorted(names):
                    yield name, owner[name].get_tensor(name)

            self.reload_weights(weights_iterator=tensors())
        return {"seconds": time.perf_counter() - t0, "tensors": len(names)}
