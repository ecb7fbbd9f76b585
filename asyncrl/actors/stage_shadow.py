"""The shadow tree a stage is built in, and the scratch memory it recycles (asyncrl.actors.staging).

:class:`Shadow` is a copy of the model's module tree (or of some of its layers) sharing every
attribute of the live modules but their parameter/buffer dicts, whose loadable tensors are new ones
shaped from the model-format metadata vLLM recorded at construction; :class:`Scratch` hands those
tensors storages that an earlier layer's processing dropped. The design, its costs and invariants are
in the module doc of :mod:`asyncrl.actors.staging`.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterator
from types import MethodType
from typing import Any

import torch

__all__ = ["Scratch", "Shadow", "layer_tensors", "rebind"]


def rebind(t: torch.Tensor, old: Any, new: Any) -> None:
    """Point a tensor's bound-method attributes (weight loaders) from ``old`` to ``new``."""
    for key, value in list(t.__dict__.items()):
        if isinstance(value, MethodType) and value.__self__ is old:
            t.__dict__[key] = value.__func__.__get__(new)


class Scratch:
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
        n = span(size, stride) * item
        if not self.enabled or device.type != "cpu" or n == 0:
            return torch.empty_strided(size, stride, dtype=dtype, device=device)
        pool = self.free.get(n)
        if pool:
            st, off = pool.pop()
            self.held -= n
            self.reused += n
        elif n >= self.HUGE:
            st, off = huge_mapping(n, self.HUGE)
        else:
            return torch.empty_strided(size, stride, dtype=dtype, device=device)
        return torch.empty(0, dtype=dtype).set_(st, off // item, size, stride)

    def reclaim(self, layer: torch.nn.Module, made: list[torch.Tensor]) -> None:
        """Pool the storages of ``made`` (the tensors the stage built for ``layer``) that processing
        dropped: referenced by nothing but their own tensor (whose loaders refuse from now on)."""
        if not self.enabled:
            return
        kept = {id(t) for t in layer_tensors(layer.__dict__)}
        kept |= {id(v) for v in layer.__dict__.values() if isinstance(v, torch.Tensor)}
        for t in made:
            if id(t) in kept or t.device.type != "cpu":
                continue
            st = t.untyped_storage()
            n = span(tuple(t.size()), tuple(t.stride())) * t.element_size()
            # 2 = ``t`` and ``st``: no view, no ``.data`` alias, no packed kernel holding a tensor on it.
            if torch._C._storage_Use_Count(st._cdata) != 2 or n == 0:
                continue
            if self.held + n > self.MAX_BYTES:
                continue
            self.free.setdefault(n, []).append((st, t.storage_offset() * t.element_size()))
            self.held += n


def huge_mapping(nbytes: int, huge: int) -> tuple[torch.UntypedStorage, int]:
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


def span(size: tuple, stride: tuple) -> int:
    """Elements a strided layout reaches (its storage size)."""
    if any(n == 0 for n in size):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True))


class Shadow:
    """The shadow tree of a model and the bookkeeping of what its loaders wrote.

    ``complete(id(shadow))`` is called after the loader call that writes a layer's last checkpoint
    element; from then on that layer's loaders raise (its tensors may be in the scratch pool).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        scratch: Scratch,
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
                    rebind(t, live, sh)
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
            for t in list(layer_tensors(sh.__dict__)):
                restore = getattr(getattr(t, "weight_loader", None), "_asyncrl_restore", None)
                if restore is None:
                    continue
                had, loader = restore
                if had:
                    t.weight_loader = loader
                else:
                    del t.weight_loader


def layer_tensors(attrs: dict) -> Iterator[torch.Tensor]:
    """The parameters and buffers in a layer's attribute dict."""
    for key in ("_parameters", "_buffers"):
        yield from (t for t in attrs.get(key, {}).values() if t is not None)
