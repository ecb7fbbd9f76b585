"""Staged weight swaps inside the vLLM worker: build the new weights while generating, switch in the pause.

vLLM's in-place reload (``asyncrl.actors.worker_ext``) does all its work inside the generation pause:
on CPU every linear layer is materialized, loaded and re-processed into a new oneDNN handle (~12 ms
at the tiny size, ~1 GB/s at 300M). A staged swap moves that work out of the pause:

* ``begin`` (an RPC that returns at once) starts a background thread in the worker. It builds a
  *shadow* of every module: a new object sharing the live module's attributes but with its own
  parameter/buffer dicts, in which each loadable tensor is a fresh one materialized from the
  model-format metadata vLLM recorded at construction (exactly what the layerwise reload
  materializes). The published file is loaded into the shadow tree with the model's own
  ``load_weights`` (same name mapping, stacking and TP narrowing), and each loaded shadow layer is
  processed by its quant method (``process_weights_after_loading``: the oneDNN / sgl packing on CPU).
  The live model is only read; the main thread keeps running model steps.
* ``poll`` (RPC) reports whether the thread finished (or why it failed).
* ``commit`` (RPC, inside the pause) moves each loaded shadow layer's attribute dict into the live
  layer object (``_parameters``, ``_buffers``, the ``cpu_linear`` handle, ...): a few dict updates
  per layer, no copy and no processing. The old tensors and handles are freed by a thread after the
  pause (freeing 1 GB of weights is ~30 ms of munmap).

Cost: a second copy of the weights while a stage is held (2x model memory at the peak).

Invariants. A commit switches every layer the file loaded or raises before switching any (all
checks happen in ``begin``'s thread or at the top of ``commit``). Layers the file does not load
(rotary caches, attention scales) keep their live tensors, as in vLLM's reload. Only models whose
every processing step is known to be a pure function of the layer's own loaded tensors are staged
(:func:`unsupported_reason`); anything else (quantized or MoE layers, tied parameters, attention
layers that load weights, CUDA graphs / torch.compile holding tensor pointers) is refused with the
reason, and the front end falls back to the in-place reload for that engine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from types import MethodType
from typing import Any

import torch

__all__ = ["Stager", "unsupported_reason", "SUPPORTED_METHODS"]

#: Quant methods whose ``process_weights_after_loading`` only rewrites the layer's own attributes.
SUPPORTED_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")


def unsupported_reason(model: torch.nn.Module, model_config: Any) -> str | None:
    """Why ``model`` cannot be staged (None = it can)."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    if not getattr(model_config, "enforce_eager", False):
        return "enforce_eager is off: CUDA graphs / torch.compile hold the weights' pointers"
    owners: dict[int, str] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        qm = getattr(mod, "quant_method", None)
        if isinstance(qm, QuantizeMethodBase) and type(qm).__name__ not in SUPPORTED_METHODS:
            return f"{name}: quant method {type(qm).__name__} is not known to be stageable"
        for pname, p in mod._parameters.items():
            if p is None:
                continue
            if owners.setdefault(id(p), f"{name}.{pname}") != f"{name}.{pname}":
                return f"tied parameters ({owners[id(p)]} is {name}.{pname})"
    return None


def _rebind(t: torch.Tensor, old: Any, new: Any) -> None:
    """Point a tensor's bound-method attributes (weight loaders) from ``old`` to ``new``."""
    for key, value in list(t.__dict__.items()):
        if isinstance(value, MethodType) and value.__self__ is old:
            t.__dict__[key] = value.__func__.__get__(new)


class _Shadow:
    """The shadow tree of a model and the bookkeeping of what its loaders wrote."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.of: dict[int, torch.nn.Module] = {}  # id(live) -> shadow
        self.live: dict[int, torch.nn.Module] = {}  # id(shadow) -> live
        self.expected: dict[int, int] = {}  # id(shadow) -> loadable elements
        self.loaded: dict[int, int] = {}  # id(shadow) -> elements written by its loaders
        self.root = self._copy(model)

    def _copy(self, mod: torch.nn.Module) -> torch.nn.Module:
        if id(mod) in self.of:
            return self.of[id(mod)]
        sh = mod.__class__.__new__(mod.__class__)
        sh.__dict__.update(mod.__dict__)
        sh._parameters = dict(mod._parameters)
        sh._buffers = dict(mod._buffers)
        sh._non_persistent_buffers_set = set(mod._non_persistent_buffers_set)
        self.of[id(mod)], self.live[id(sh)] = sh, mod
        sh._modules = {k: (None if c is None else self._copy(c)) for k, c in mod._modules.items()}
        self._materialize(mod, sh)
        return sh

    def _materialize(self, live: torch.nn.Module, sh: torch.nn.Module) -> None:
        """Fresh, counted tensors for every loadable tensor of ``sh`` (as vLLM's reload materializes)."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.meta import (
            SKIP_LOAD_TENSORS,
            SKIP_MODULES,
            materialize_meta_tensor,
        )
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
        from vllm.model_executor.model_loader.reload.utils import get_tensor_load_numel

        if live.__class__.__name__ in SKIP_MODULES:
            return
        info = LAYERWISE_INFO.get(live)
        meta_params, meta_buffers = info.restore_metadata if info is not None else ({}, {})
        device = info.restore_device if info is not None else torch.device("cpu")
        total = 0
        for store, meta in ((sh._parameters, meta_params), (sh._buffers, meta_buffers)):
            names = set(meta) | {n for n, t in store.items() if t is not None}
            for name in sorted(names - SKIP_LOAD_TENSORS):
                if name in meta:  # model format, as recorded at construction
                    with device:
                        t = restore_layer_refs(materialize_meta_tensor(meta[name]), sh)
                else:  # built after create_weights (e.g. bias): never on meta, same shape as live
                    cur = store[name]
                    t = torch.empty_like(cur.data)
                    t.__class__ = cur.__class__
                    t.__dict__ = cur.__dict__.copy()
                    _rebind(t, live, sh)
                self._count(sh, t)
                store[name] = t
                total += get_tensor_load_numel(t)
        if total:
            self.expected[id(sh)] = total
            self.loaded[id(sh)] = 0

    def _count(self, sh: torch.nn.Module, t: torch.Tensor) -> None:
        """Wrap ``t``'s loader so the elements it writes are counted for ``sh`` (vLLM's CopyCounter)."""
        from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader
        from vllm.model_executor.model_loader.reload.meta import CopyCounter
        from vllm.model_executor.model_loader.reload.utils import get_tensor_load_numel

        had = "weight_loader" in t.__dict__
        loader: Callable = _get_original_loader(t)
        cap = get_tensor_load_numel(t)

        def counted(*args: Any, **kwargs: Any) -> Any:
            with CopyCounter() as c:
                out = loader(*args, **kwargs)
            self.loaded[id(sh)] += min(c.copied_numel, cap)
            return out

        counted._asyncrl_restore = (had, loader)  # type: ignore[attr-defined]
        t.weight_loader = counted  # type: ignore[attr-defined]

    def uncount(self) -> None:
        for sh in self.of.values():
            for t in list(sh._parameters.values()) + list(sh._buffers.values()):
                restore = getattr(getattr(t, "weight_loader", None), "_asyncrl_restore", None)
                if restore is None:
                    continue
                had, loader = restore
                if had:
                    t.weight_loader = loader
                else:
                    del t.weight_loader


RETIRE_DELAY_S = 0.05  # the pause (label, KV reset, resume) ends within a few ms of the commit


def _free_later(retired: list[dict]) -> None:
    time.sleep(RETIRE_DELAY_S)
    while retired:  # one layer at a time: the GIL is free between two layers' deallocations
        retired.pop()


class Stager:
    """One worker's staged swap (see the module doc). Methods are called from the worker's RPCs."""

    def __init__(self, model: torch.nn.Module, model_config: Any, vllm_config: Any, open_checked: Callable):
        self.model = model
        self.model_config = model_config
        self.vllm_config = vllm_config
        # open_checked(path, version, stack) -> {name: open safetensors handle}; raises on a bad file.
        self.open_checked = open_checked
        self.reason = unsupported_reason(model, model_config)
        self._thread: threading.Thread | None = None
        self._version: int | None = None
        self._layers: list[tuple[torch.nn.Module, dict]] | None = None  # (live layer, its new __dict__)
        self._error: str | None = None
        self._seconds = 0.0

    def begin(self, path: str, version: int, wait: bool = False) -> dict:
        """Start building the stage of ``path``; ``wait``: build it in this call (the caller's thread)
        and return :meth:`poll`'s answer, for an engine with nothing to generate meanwhile."""
        if self.reason is not None:
            return {"unsupported": self.reason}
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("a stage is already being built")
        self.discard()
        self._version = version
        if wait:
            self._run(path, version)
            return {"started": True, **self.poll()}
        self._thread = threading.Thread(
            target=self._run, args=(path, version), name="asyncrl-stage", daemon=True
        )
        self._thread.start()
        return {"started": True}

    def poll(self) -> dict:
        busy = self._thread is not None and self._thread.is_alive()
        return {"done": not busy and self._layers is not None, "busy": busy, "error": self._error,
                "seconds": self._seconds}  # fmt: skip

    def discard(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._thread.join()  # a failed front end: the stage is dropped when built (rare)
        self._thread, self._layers, self._error, self._version = None, None, None, None

    def commit(self, version: int) -> dict:
        t0 = time.perf_counter()
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("commit while the stage is still being built")
        if self._layers is None or self._version != version:
            raise RuntimeError(
                f"no stage for version {version} (staged: {self._version}, error: {self._error})"
            )
        layers, self._layers = self._layers, None
        retired = []
        for live, state in layers:
            retired.append({k: live.__dict__[k] for k in state if k in live.__dict__})
            live.__dict__.update(state)
        self._thread, self._version = None, None
        # The old weights and handles are freed after the pause, in a thread: freeing is munmap-bound
        # (measured ~30 ms per GB inside the pause when the old dicts were dropped here).
        threading.Thread(target=_free_later, args=(retired,), name="asyncrl-retire", daemon=True).start()
        return {"layers": len(layers), "commit_s": time.perf_counter() - t0, "stage_s": self._seconds}

    # ------------------------------------------------------------------ the background thread

    def _run(self, path: str, version: int) -> None:
        from contextlib import ExitStack

        from vllm.config import set_current_vllm_config

        t0 = time.perf_counter()
        try:
            with torch.no_grad(), set_current_vllm_config(self.vllm_config), ExitStack() as stack:
                owner = self.open_checked(path, version, stack)
                layers = self._build(owner)
            self._seconds = time.perf_counter() - t0
            self._layers = layers
        except BaseException as e:  # reported by poll(); the live model was never touched
            self._error = f"{type(e).__name__}: {e}"

    def _build(self, owner: dict[str, Any]) -> list[tuple[torch.nn.Module, dict]]:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

        shadow = _Shadow(self.model)

        def tensors() -> Iterator:
            for name in sorted(owner):
                yield name, owner[name].get_tensor(name)

        shadow.root.load_weights(tensors())
        shadow.uncount()
        layers = []
        # Partially loaded layers (padding) are processed too, as vLLM's reload does.
        for sid in shadow.expected:
            if shadow.loaded[sid] <= 0:  # not in the checkpoint (e.g. attention scales): live tensors stay
                continue
            live = shadow.live[sid]
            sh = shadow.of[id(live)]
            if is_deferred_attention_layer(live):
                raise RuntimeError(f"{type(live).__name__} loads weights: not stageable")
            qm = getattr(sh, "quant_method", None)
            if isinstance(qm, QuantizeMethodBase):
                sh.__dict__.pop("_already_called_process_weights_after_loading", None)
                qm.process_weights_after_loading(sh)
                if hasattr(sh, "update_param_tp_status"):
                    sh.update_param_tp_status()
            # Prepared here, off the pause: the loaders of the new tensors act on the live layer from
            # now on (later in-place reloads), and the attribute dict the commit moves in.
            for t in list(sh._parameters.values()) + list(sh._buffers.values()):
                if t is not None:
                    _rebind(t, sh, live)
            layers.append((live, {k: v for k, v in sh.__dict__.items() if k != "_modules"}))
        return layers
