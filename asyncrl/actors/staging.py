"""Staged weight swaps inside the vLLM worker: build the new weights while generating, switch in the pause.

vLLM's in-place reload (``asyncrl.actors.worker_ext``) does all its work inside the generation pause:
on CPU every linear layer is materialized, loaded and re-processed into a new oneDNN handle (~12 ms
at the tiny size, ~1 GB/s at 300M). A staged swap moves that work out of the pause:

* ``begin`` (an RPC that returns at once) starts a background thread in the worker. It builds a
  *shadow* of every module: a new object sharing the live module's attributes but with its own
  parameter/buffer dicts, in which each loadable tensor is a new one shaped from the model-format
  metadata vLLM recorded at construction (exactly what the layerwise reload materializes). The
  published file is loaded into the shadow tree with the model's own ``load_weights`` (same name
  mapping, stacking and TP narrowing), and each shadow layer is processed by its quant method
  (``process_weights_after_loading``: the oneDNN / sgl packing on CPU) as soon as its loaders have
  written all its checkpoint elements, as vLLM's layerwise reload does (layers left partly loaded,
  e.g. padding, are processed after the load). The live model is only read; the main thread keeps
  running model steps. Later stages replay the copies the first one's loaders made, into shadows of
  the loaded layers only (:mod:`asyncrl.actors.stage_replay`; ``actors.swap_stage_replay``).
* Scratch (:class:`asyncrl.actors.stage_shadow.Scratch`): on CPU the packing copies each linear
  weight into memory oneDNN owns and the layer drops the model-format tensor. That tensor's storage
  goes back to a pool and the next layer of the same shape (and the next stage) loads into it, so a
  stage writes into memory that is already mapped (on transparent huge pages) instead of faulting in
  and unmapping a model's worth of fresh 4 KiB pages (the pool holds about one layer's weights
  between stages). At 300M (1.15 GB, 2-core VM, staged swaps in a row) the stage went from 1.64 to
  1.13-1.27 s (loads ~0.3 s in both; packing 1.30 -> 0.77-0.94 s, i.e. oneDNN's packed copy, which
  faults in fresh memory).
  The pool is off where the engine process's malloc keeps freed memory (asyncrl.actors.cpu_heap,
  checkpoints of 64 MiB or more): the dropped storages then go back to that heap, and the next
  layer's allocation (and oneDNN's packed copy) reuses them without the pool's own mappings.
* ``poll`` (RPC) reports whether the thread finished (or why it failed).
* ``commit`` (RPC, inside the pause) moves each loaded shadow layer's attribute dict into the live
  layer object (``_parameters``, ``_buffers``, the ``cpu_linear`` handle, ...): a few dict updates
  per layer, no copy and no processing. The old tensors and handles are freed by a thread after the
  pause (freeing 1 GB of weights is ~30 ms of munmap).

Cost: a second copy of the (processed) weights while a stage is held (2x model memory at the peak),
and the scratch pool (about one layer's model-format weights) for the life of the worker.

Invariants. A commit switches every layer the file loaded or raises before switching any (all
checks happen in ``begin``'s thread or at the top of ``commit``). A storage is in the scratch pool
only while no tensor but the dropped model-format one references it (checked by the storage's use
count after processing), and that tensor's loaders refuse to write again (a load into a layer
already processed fails the stage): pooled memory is never live, and never written while live.
Layers the file does not load (rotary caches, attention scales) keep their live tensors, as in
vLLM's reload. Only models whose every processing step is known to be a pure function of the
layer's own loaded tensors are staged (:func:`unsupported_reason`); anything else (quantized or MoE
layers, tied parameters, attention layers that load weights, CUDA graphs / torch.compile holding
tensor pointers) is refused with the reason, and the front end falls back to the in-place reload
for that engine.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from asyncrl.actors.stage_shadow import Scratch, Shadow, layer_tensors, rebind

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


RETIRE_DELAY_S = 0.05  # the pause (label, KV reset, resume) ends within a few ms of the commit


def _free_later(retired: list[dict]) -> None:
    time.sleep(RETIRE_DELAY_S)
    while retired:  # one layer at a time: the GIL is free between two layers' deallocations
        retired.pop()


class Stager:
    """One worker's staged swap (see the module doc). Methods are called from the worker's RPCs."""

    def __init__(
        self,
        model: torch.nn.Module,
        model_config: Any,
        vllm_config: Any,
        open_checked: Callable,
        scratch_pool: bool = True,
    ):
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
        self._scratch = Scratch(scratch_pool)  # off when the heap keeps freed memory (cpu_heap)
        self._retired: list[weakref.ref] = []  # the tensors the last commit replaced (freed after it)
        # Replayed loads (asyncrl.actors.stage_replay): the plan the first stage recorded, why none
        # could be recorded (the loaders' path for good), and whether the last stage was replayed.
        self.replay = True
        self._plan: Any = None
        self.plan_refused: str | None = None
        self.plan_mismatches = 0  # files whose layout differed from the plan's (loaded, then recorded)
        self.replayed = False

    def begin(self, path: str, version: int, wait: bool = False, replay: bool = True) -> dict:
        """Start building the stage of ``path``; ``wait``: build it in this call (the caller's thread)
        and return :meth:`poll`'s answer, for an engine with nothing to generate meanwhile. ``replay``:
        replay the recorded loads when the file's names are the recorded ones (see the module doc of
        asyncrl.actors.stage_replay), else always the loaders."""
        if self.reason is not None:
            return {"unsupported": self.reason}
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("a stage is already being built")
        self.discard()
        self.replay = replay
        if not replay:
            self._plan = None
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
                "seconds": self._seconds, "recycled_bytes": self._scratch.reused,
                "replayed": self.replayed, "plan_refused": self.plan_refused,
                "plan_mismatches": self.plan_mismatches,
                "retired_alive": sum(r() is not None for r in self._retired)}  # fmt: skip

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
        kept = {id(t) for _, state in layers for t in layer_tensors(state)}  # e.g. rotary caches: not loaded
        self._retired = [weakref.ref(t) for d in retired for t in layer_tensors(d) if id(t) not in kept]
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
        """The new attribute dict of every loaded layer: replayed from the plan when there is one for
        this file's names (asyncrl.actors.stage_replay), else by the loaders (recording a plan)."""
        from asyncrl.actors.stage_replay import PlanMismatch, Recorder

        self._scratch.reused = 0
        names = tuple(sorted(owner))
        plan = self._plan if self.replay else None
        if plan is not None and plan.names == names:
            try:
                layers = self._replay(owner, plan)
                self.replayed = True
                return layers
            except PlanMismatch:  # a file of another layout: the loaders, recording a plan for it
                self._plan = None
                self.plan_mismatches += 1
        self.replayed = False
        recorder = Recorder() if self.replay and self.plan_refused is None else None
        shadow = Shadow(
            self.model, self._scratch, lambda sid: self._process(shadow, sid, recorder), recorder=recorder
        )

        def tensors() -> Iterator:
            for name in names:  # sorted: a layer's tensors are consecutive
                if recorder is None:
                    yield name, owner[name].get_tensor(name)
                    continue
                with recorder.paused():  # reading the file is not the loaders' (safetensors reads a byte)
                    t = owner[name].get_tensor(name)
                recorder.source(name, t)
                yield name, t

        if recorder is not None:
            with recorder:
                shadow.root.load_weights(tensors())
        else:
            shadow.root.load_weights(tensors())
        shadow.uncount()
        for sid in shadow.expected:
            # partly loaded (padding): processed now, as vLLM's reload does
            if shadow.loaded[sid] > 0 and sid not in shadow.processed:
                self._process(shadow, sid, recorder)
        if recorder is not None:
            self._plan = recorder.plan(names, shadow.live)
            self.plan_refused = recorder.why
        return self._finish(shadow, [sid for sid in shadow.expected if shadow.loaded[sid] > 0])

    def _replay(self, owner: dict[str, Any], plan: Any) -> list[tuple[torch.nn.Module, dict]]:
        """The recorded copies, from this file into new tensors of the loaded layers, each layer
        processed after its copies (see asyncrl.actors.stage_replay)."""
        from asyncrl.actors.stage_replay import Replay

        shadow = Shadow(self.model, self._scratch, layers=[live for live, _ in plan.layers])
        replay = Replay(plan, lambda name: owner[name].get_tensor(name))
        sids = []
        for i, (live, _) in enumerate(plan.layers):
            sh = shadow.of[id(live)]
            replay.layer(i, sh.__dict__)
            self._process(shadow, id(sh), None)
            sids.append(id(sh))
        return self._finish(shadow, sids)

    def _process(self, shadow: Shadow, sid: int, recorder: Any) -> None:
        """Layer ``sid``'s post-load processing (the oneDNN packing on CPU), then its dropped storages
        to the scratch pool."""
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

        live = shadow.live[sid]
        sh = shadow.of[id(live)]
        if is_deferred_attention_layer(live):
            raise RuntimeError(f"{type(live).__name__} loads weights: not stageable")
        shadow.processed.add(sid)  # before processing: its loaders refuse from now on
        if recorder is not None:
            recorder.processed(sid, live, sh)
        qm = getattr(sh, "quant_method", None)
        with recorder.paused() if recorder is not None else contextlib.nullcontext():
            if isinstance(qm, QuantizeMethodBase):
                sh.__dict__.pop("_already_called_process_weights_after_loading", None)
                qm.process_weights_after_loading(sh)
                if hasattr(sh, "update_param_tp_status"):
                    sh.update_param_tp_status()
            self._scratch.reclaim(sh, shadow.made.pop(sid, []))

    def _finish(self, shadow: Shadow, sids: list[int]) -> list[tuple[torch.nn.Module, dict]]:
        layers = []
        for sid in sids:
            live = shadow.live[sid]
            sh = shadow.of[id(live)]
            # Prepared here, off the pause: the loaders of the new tensors act on the live layer from
            # now on (later in-place reloads), and the attribute dict the commit moves in.
            for t in list(layer_tensors(sh.__dict__)):
                rebind(t, sh, live)
            layers.append((live, {k: v for k, v in sh.__dict__.items() if k != "_modules"}))
        shadow.release()
        return layers
