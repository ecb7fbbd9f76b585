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
  running model steps.
* Scratch (:class:`_Scratch`): on CPU the packing copies each linear weight into memory oneDNN owns
  and the layer drops the model-format tensor. That tensor's storage goes back to a pool and the
  next layer of the same shape (and the next stage) loads into it, so a stage writes into memory
  that is already mapped (on transparent huge pages) instead of faulting in and unmapping a model's
  worth of fresh 4 KiB pages (the pool holds about one layer's weights between stages). At 300M
  (1.15 GB, 2-core VM, staged swaps in a row) the stage went from 1.64 to 1.13-1.27 s (loads ~0.3
  s in both; packing 1.30 -> 0.77-0.94 s, i.e. oneDNN's packed copy, which faults in fresh memory).
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
import mmap
import threading
import time
import weakref
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


class _Scratch:
    """Storages of model-format tensors that processing dropped, by size in bytes (see the module doc).

    Only the stage's thread uses it (one build at a time). A storage taken out is owned by the tensor
    built on it, which may end up live (a norm weight): it comes back only through :meth:`reclaim`.
    New storages of :data:`HUGE` bytes or more are fresh anonymous mappings advised for transparent
    huge pages (``MADV_HUGEPAGE``; the system default is ``madvise``): the first stage faults 512x
    fewer pages, and later ones ran 1.13 s against 1.25-1.40 s on 4 KiB pages (300M, two pairs of
    runs; the pool's memory is never in glibc's heap either).
    """

    #: Storages beyond this are freed, not kept (the pool normally holds one layer's weights).
    MAX_BYTES = 1 << 30
    #: A transparent huge page (x86-64 and 4 KiB-page arm64).
    HUGE = 2 << 20

    def __init__(self, enabled: bool = True) -> None:
        # Off where the process's malloc keeps freed memory (asyncrl.actors.cpu_heap): the dropped
        # storages then go back to the heap and the next layer's allocation reuses them just as well,
        # without the pool's own mappings (300M, shm, the bench's medians of 5 staged swaps: stage
        # prepared in 550 vs 639 ms, publish-to-serving 716 vs 800 ms).
        self.enabled = enabled
        self.free: dict[int, list[tuple[torch.UntypedStorage, int]]] = {}  # bytes -> (storage, offset)
        self.held = 0  # bytes in the pool
        self.reused = 0  # bytes handed out by the current build

    def empty(self, size: tuple, stride: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor of that layout, on a pooled storage of exactly its bytes if there is one (its data
        is a previous layer's: like ``torch.empty``'s, it is overwritten by the loaders)."""
        item = torch.empty(0, dtype=dtype).element_size()
        n = _span(size, stride) * item
        if not self.enabled or device.type != "cpu" or n == 0:
            return torch.empty_strided(size, stride, dtype=dtype, device=device)
        pool = self.free.get(n)
        if pool:
            st, off = pool.pop()
            self.held -= n
            self.reused += n
        elif n >= self.HUGE:
            st, off = _huge_mapping(n, self.HUGE)
        else:
            return torch.empty_strided(size, stride, dtype=dtype, device=device)
        return torch.empty(0, dtype=dtype).set_(st, off // item, size, stride)

    def reclaim(self, layer: torch.nn.Module, made: list[torch.Tensor]) -> None:
        """Pool the storages of ``made`` (the tensors the stage built for ``layer``) that processing
        dropped: referenced by nothing but their own tensor (whose loaders refuse from now on)."""
        if not self.enabled:
            return
        kept = {id(t) for t in _tensors(layer.__dict__)}
        kept |= {id(v) for v in layer.__dict__.values() if isinstance(v, torch.Tensor)}
        for t in made:
            if id(t) in kept or t.device.type != "cpu":
                continue
            st = t.untyped_storage()
            n = _span(tuple(t.size()), tuple(t.stride())) * t.element_size()
            # 2 = ``t`` and ``st``: no view, no ``.data`` alias, no packed kernel holding a tensor on it.
            if torch._C._storage_Use_Count(st._cdata) != 2 or n == 0:
                continue
            if self.held + n > self.MAX_BYTES:
                continue
            self.free.setdefault(n, []).append((st, t.storage_offset() * t.element_size()))
            self.held += n


def _huge_mapping(nbytes: int, huge: int) -> tuple[torch.UntypedStorage, int]:
    """A storage on a fresh anonymous mapping advised for transparent huge pages, and the byte offset
    of its first huge-page boundary (``nbytes`` fit after it). Nothing is touched here: the pages are
    faulted in by the first load, as huge pages where the kernel has them (4 KiB ones otherwise)."""
    m = mmap.mmap(-1, nbytes + huge)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # no THP on this system: plain pages
        pass
    buf = torch.frombuffer(m, dtype=torch.uint8)  # keeps ``m`` mapped as long as the storage lives
    return buf.untyped_storage(), -buf.data_ptr() % huge


def _span(size: tuple, stride: tuple) -> int:
    """Elements a strided layout reaches (its storage size)."""
    if any(n == 0 for n in size):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True))


class _Shadow:
    """The shadow tree of a model and the bookkeeping of what its loaders wrote.

    ``complete(id(shadow))`` is called after the loader call that writes a layer's last checkpoint
    element; from then on that layer's loaders raise (its tensors may be in the scratch pool).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        scratch: _Scratch,
        complete: Callable[[int], None] | None = None,
        layers: list[torch.nn.Module] | None = None,
        recorder: Any = None,
    ) -> None:
        """``layers``: shadow only these (leaf) layers, with uncounted tensors (a replayed stage,
        asyncrl.actors.stage_replay); else the whole tree, with counted loaders. ``recorder``: told of
        every tensor built (a recorded stage)."""
        self.scratch = scratch
        self.complete = complete
        self.recorder = recorder
        self.counted = layers is None
        self.of: dict[int, torch.nn.Module] = {}  # id(live) -> shadow
        self.live: dict[int, torch.nn.Module] = {}  # id(shadow) -> live
        self.expected: dict[int, int] = {}  # id(shadow) -> loadable elements
        self.loaded: dict[int, int] = {}  # id(shadow) -> elements written by its loaders
        self.made: dict[int, list[torch.Tensor]] = {}  # id(shadow) -> the tensors built for it
        self.processed: set[int] = set()  # id(shadow) of layers processed (their loaders refuse)
        self.root = self._copy(model) if layers is None else None
        for live in layers or ():
            self._copy(live, leaf=True)

    def _copy(self, mod: torch.nn.Module, leaf: bool = False) -> torch.nn.Module:
        if id(mod) in self.of:
            return self.of[id(mod)]
        sh = mod.__class__.__new__(mod.__class__)
        sh.__dict__.update(mod.__dict__)
        sh._parameters = dict(mod._parameters)
        sh._buffers = dict(mod._buffers)
        sh._non_persistent_buffers_set = set(mod._non_persistent_buffers_set)
        self.of[id(mod)], self.live[id(sh)] = sh, mod
        if leaf:  # a replayed layer: never loaded through the tree, no children (the recorder checked)
            sh._modules = dict(mod._modules)
        else:
            sh._modules = {k: (None if c is None else self._copy(c)) for k, c in mod._modules.items()}
        self._materialize(mod, sh)
        return sh

    def _materialize(self, live: torch.nn.Module, sh: torch.nn.Module) -> None:
        """New, counted tensors for every loadable tensor of ``sh`` (as vLLM's reload materializes)."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS, SKIP_MODULES
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
        from vllm.model_executor.model_loader.reload.utils import get_tensor_load_numel

        if live.__class__.__name__ in SKIP_MODULES:
            return
        info = LAYERWISE_INFO.get(live)
        meta_params, meta_buffers = info.restore_metadata if info is not None else ({}, {})
        device = info.restore_device if info is not None else torch.device("cpu")
        total = 0
        made = []
        for key, store, meta in (
            ("_parameters", sh._parameters, meta_params),
            ("_buffers", sh._buffers, meta_buffers),
        ):
            names = set(meta) | {n for n, t in store.items() if t is not None}
            for name in sorted(names - SKIP_LOAD_TENSORS):
                # Model format, as recorded at construction; else built after create_weights (e.g.
                # bias): never on meta, same layout as live. Class and attributes as
                # vllm's materialize_meta_tensor gives them.
                src = meta[name] if name in meta else store[name]
                data = src if name in meta else src.data
                t = self.scratch.empty(
                    tuple(data.size()), tuple(data.stride()), data.dtype, torch.device(device)
                )
                t.__class__ = src.__class__
                t.__dict__ = src.__dict__.copy()
                if name in meta:
                    t = restore_layer_refs(t, sh)
                else:
                    _rebind(t, live, sh)
                if self.counted:
                    self._count(sh, t)
                if self.recorder is not None:
                    self.recorder.target(id(sh), key, name, t)
                store[name] = t
                made.append(t)
                total += get_tensor_load_numel(t)
        self.made[id(sh)] = made
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
        sid = id(sh)

        def counted(*args: Any, **kwargs: Any) -> Any:
            if sid in self.processed:  # its tensors may be scratch now: never write them
                raise RuntimeError(f"{type(sh).__name__}: loaded again after all its elements were")
            with CopyCounter() as c:
                out = loader(*args, **kwargs)
            self.loaded[sid] += min(c.copied_numel, cap)
            if self.complete is not None and self.loaded[sid] >= self.expected[sid]:
                self.complete(sid)
            return out

        counted._asyncrl_restore = (had, loader)  # type: ignore[attr-defined]
        t.weight_loader = counted  # type: ignore[attr-defined]

    def release(self) -> None:
        """Drop the tree and the bookkeeping. ``complete`` (the build's ``process``) refers back to
        this object, so without this a whole shadow tree, the previous version's attribute dicts and
        oneDNN handles included, lived in a reference cycle until a full garbage collection: +1.1 GB
        of RSS every third 300M swap in a row, freed only when Python's oldest generation was collected."""
        self.complete = None
        self.root = None
        for d in (self.of, self.live, self.expected, self.loaded, self.made):
            d.clear()
        self.processed.clear()

    def uncount(self) -> None:
        for sh in self.of.values():
            for t in list(_tensors(sh.__dict__)):
                restore = getattr(getattr(t, "weight_loader", None), "_asyncrl_restore", None)
                if restore is None:
                    continue
                had, loader = restore
                if had:
                    t.weight_loader = loader
                else:
                    del t.weight_loader


RETIRE_DELAY_S = 0.05  # the pause (label, KV reset, resume) ends within a few ms of the commit


def _tensors(attrs: dict) -> Iterator[torch.Tensor]:
    """The parameters and buffers in a layer's attribute dict."""
    for key in ("_parameters", "_buffers"):
        yield from (t for t in attrs.get(key, {}).values() if t is not None)


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
        self._scratch = _Scratch(scratch_pool)  # off when the heap keeps freed memory (cpu_heap)
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
        kept = {id(t) for _, state in layers for t in _tensors(state)}  # e.g. rotary caches: not loaded
        self._retired = [weakref.ref(t) for d in retired for t in _tensors(d) if id(t) not in kept]
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
        shadow = _Shadow(
            self.model, self._scratch, lambda sid: self._process(shadow, sid, recorder), recorder=recorder
        )

        def tensors() -> Iterator:
            for name in names:  # sorted: a layer's tensors are consecutive
                t = owner[name].get_tensor(name)
                if recorder is not None:
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

        shadow = _Shadow(self.model, self._scratch, layers=[live for live, _ in plan.layers])
        replay = Replay(plan, lambda name: owner[name].get_tensor(name))
        sids = []
        for i, (live, _) in enumerate(plan.layers):
            sh = shadow.of[id(live)]
            replay.layer(i, sh.__dict__)
            self._process(shadow, id(sh), None)
            sids.append(id(sh))
        return self._finish(shadow, sids)

    def _process(self, shadow: _Shadow, sid: int, recorder: Any) -> None:
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

    def _finish(self, shadow: _Shadow, sids: list[int]) -> list[tuple[torch.nn.Module, dict]]:
        layers = []
        for sid in sids:
            live = shadow.live[sid]
            sh = shadow.of[id(live)]
            # Prepared here, off the pause: the loaders of the new tensors act on the live layer from
            # now on (later in-place reloads), and the attribute dict the commit moves in.
            for t in list(_tensors(sh.__dict__)):
                _rebind(t, sh, live)
            layers.append((live, {k: v for k, v in sh.__dict__.items() if k != "_modules"}))
        shadow.release()
        return layers
