"""Replaying a stage's loads: the copies the model's loaders made, recorded once, redone without them.

A stage (``asyncrl.actors.staging``) loads every published version with the model's own
``load_weights``: name mapping, q/k/v and gate/up stacking, TP narrowing, one Python weight-loader
call per checkpoint tensor, counted by a dispatch mode. At the tiny demo size that Python is most of
a ~5.5 ms stage (cProfile: the oneDNN handles ~1.6 ms, the rest loaders, the shadow tree of every
module and the counting), and the stage runs on the engine core, holding its GIL against the model
steps, once per published version. Every version has the same names and shapes, so the loaders do
the same thing every time: the first stage records it, later stages replay it.

What is recorded, by :class:`Recorder` (a ``TorchDispatchMode`` around the first stage's
``load_weights``): every ``aten.copy_`` into a tensor the stage built for a layer, as (that tensor,
the offset, size and stride of the written view, the checkpoint tensor read, the offset, size and
stride of the read view), per layer, in order, and the order in which layers were processed. The
replay (``Stager._replay`` with :class:`Replay`) builds shadows of the loaded layers only, reads each
checkpoint tensor it needs once, redoes the copies on views of the same geometry, and processes each layer as the first stage
did (the oneDNN packing is not replayable: a new handle per version).

Invariants (what makes a replay the same stage, bit for bit; anything else is not recorded, and
every version keeps the loaders' path, with the reason in ``poll``):

* The only writes into a layer's new tensors during loading are ``copy_`` calls whose source is a
  view of a checkpoint tensor as read from the file, still alive (matched by its storage and a weak
  reference: a temporary at a freed checkpoint tensor's address is not taken for it), and ``fill_``
  / ``zero_`` with a number (padding). A loader that converts, concatenates or transforms in place
  (e.g. ``composed_weight_loader``) is refused, and so is one that reads any tensor value into Python
  during loading (``.item()``, ``bool()``, ``torch.equal``): its choices, or its fill values, could
  depend on the file. Nothing writes into a checkpoint tensor before it is copied.
* Loading rebinds no tensor of a loaded layer (``param.data = ...`` writes nothing the dispatcher
  sees: each tensor still has the storage it was built with when its layer is processed) and sets no
  attribute on it (every attribute but its parameter/buffer dicts is still the live layer's own
  object, checked at its processing); loaded layers have no children.
* A replay reads the same names with the same dtype, size and stride as recorded, or stops with
  :class:`PlanMismatch` and the stage is built by the loaders again (and recorded anew).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Copy", "Plan", "PlanMismatch", "Recorder", "Replay", "view_of"]

#: (offset from the base tensor's own storage offset, size, stride), in elements.
Geometry = tuple[int, tuple[int, ...], tuple[int, ...]]


class PlanMismatch(RuntimeError):
    """The file differs from the recorded one (names, dtypes or shapes): load it with the loaders."""


@dataclass(frozen=True)
class Copy:
    """One recorded write: ``store[name]``'s view ``dst`` := checkpoint ``src_name``'s view ``src``
    (``copy_``), or := the number ``fill`` where ``src_name`` is None (``fill_``/``zero_``: padding)."""

    store: str  # "_parameters" or "_buffers" of the layer
    name: str
    dst: Geometry
    src_name: str | None
    src: Geometry | None
    fill: float | int | bool | None = None


@dataclass
class Plan:
    """The loads of one stage: the loaded layers in processing order, each with its copies in order."""

    names: tuple[str, ...]  # every tensor name of the recorded file, sorted
    sources: dict[str, tuple[torch.dtype, tuple[int, ...], tuple[int, ...]]]  # read tensors' layouts
    layers: list[tuple[torch.nn.Module, list[Copy]]] = field(default_factory=list)  # live layer, copies


def _span_bytes(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage pointer, first byte, end byte) that ``t``'s elements reach in its storage."""
    lo = t.storage_offset() * t.element_size()
    n = 1 + sum((k - 1) * s for k, s in zip(t.size(), t.stride(), strict=True)) if t.numel() else 0
    return t.untyped_storage().data_ptr(), lo, lo + n * t.element_size()


class _Index:
    """Tensors by the storage bytes they span: which one a view lies in (storages may be shared)."""

    def __init__(self) -> None:
        self.by_ptr: dict[int, list[tuple[int, int, Any]]] = {}

    def add(self, t: torch.Tensor, payload: Any) -> None:
        ptr, lo, hi = _span_bytes(t)
        self.by_ptr.setdefault(ptr, []).append((lo, hi, payload))

    def find(self, view: torch.Tensor, overlap: bool = False) -> list[Any]:
        """The payloads of the tensors ``view`` lies in (``overlap``: that it touches)."""
        ptr, lo, hi = _span_bytes(view)
        if overlap:
            return [p for a, b, p in self.by_ptr.get(ptr, ()) if lo < b and a < hi]
        return [p for a, b, p in self.by_ptr.get(ptr, ()) if a <= lo and hi <= b]


def _geometry(view: torch.Tensor, base_offset: int) -> Geometry:
    return (view.storage_offset() - base_offset, tuple(view.size()), tuple(view.stride()))


def view_of(base: torch.Tensor, g: Geometry) -> torch.Tensor:
    """The view of ``base``'s storage that ``g`` recorded (a plain tensor: no parameter subclass)."""
    off, size, stride = g
    return base.data.as_strided(size, stride, base.storage_offset() + off)


class Replay:
    """Redoes a plan's writes layer by layer, reading each checkpoint tensor once (``get(name)``) and
    dropping it after the last layer that reads it."""

    def __init__(self, plan: Plan, get: Callable[[str], torch.Tensor]) -> None:
        self.plan = plan
        self.get = get
        self.read: dict[str, torch.Tensor] = {}
        last = {c.src_name: i for i, (_, cs) in enumerate(plan.layers) for c in cs if c.src_name}
        self.drop: dict[int, list[str]] = {}  # layer -> the tensors no later layer reads
        for name, i in last.items():
            self.drop.setdefault(i, []).append(name)

    def layer(self, i: int, attrs: dict[str, Any]) -> None:
        """Layer ``i``'s writes into the tensors of ``attrs`` (a shadow layer's ``__dict__``)."""
        for c in self.plan.layers[i][1]:
            dst = view_of(attrs[c.store][c.name], c.dst)
            if c.src_name is None:  # a recorded fill (padding)
                dst.fill_(c.fill)
                continue
            src = self.read.get(c.src_name)
            if src is None:
                src = self.read[c.src_name] = self.get(c.src_name)
                if (src.dtype, tuple(src.size()), tuple(src.stride())) != self.plan.sources[c.src_name]:
                    raise PlanMismatch(f"{c.src_name}: {src.dtype} {tuple(src.size())} is not as recorded")
            dst.copy_(view_of(src, c.src))
        for name in self.drop.get(i, ()):
            self.read.pop(name, None)


class Recorder(TorchDispatchMode):
    """Records the copies into the stage's tensors while ``load_weights`` runs (see the module doc).

    ``why`` is set (and recording stops) at the first write the plan cannot express. Layers'
    processing runs under :meth:`paused`: it is redone, not replayed.
    """

    def __init__(self) -> None:
        super().__init__()
        self.sources = _Index()  # checkpoint tensors: (name, weak reference)
        # The stage's tensors: (sid, store, name, storage offset, dtype); no reference to them (a
        # processed layer's dropped tensors go to the scratch pool only when nothing else holds them).
        self.targets = _Index()
        self.placed: dict[
            int, dict[tuple[str, str], tuple[int, int]]
        ] = {}  # sid -> (store, name) -> (ptr, offset)
        self.copies: dict[int, list[Copy]] = {}  # sid -> its copies, in order
        self.layouts: dict[str, tuple[torch.dtype, tuple[int, ...], tuple[int, ...]]] = {}
        self.order: list[int] = []  # sids in processing order
        self.why: str | None = None
        self._paused = 0

    def target(self, sid: int, store: str, name: str, t: torch.Tensor) -> None:
        """A tensor the stage built for layer ``sid`` (its loaders write it)."""
        if t.numel():
            self.targets.add(t, (sid, store, name, t.storage_offset(), t.dtype))
            self.placed.setdefault(sid, {})[(store, name)] = (
                t.untyped_storage().data_ptr(),
                t.storage_offset(),
            )

    def source(self, name: str, t: torch.Tensor) -> None:
        """A checkpoint tensor as read from the file, handed to the loaders."""
        self.sources.add(t, (name, weakref.ref(t)))
        self.layouts[name] = (t.dtype, tuple(t.size()), tuple(t.stride()))

    def processed(self, sid: int, live: torch.nn.Module, shadow: torch.nn.Module) -> None:
        """Layer ``sid`` is about to be processed: check the loads left its attributes alone."""
        self.order.append(sid)
        if live._modules:
            self.refuse(f"{type(live).__name__} has child modules")
        for k, v in shadow.__dict__.items():
            if k not in ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"):
                if live.__dict__.get(k, _MISSING) is not v:
                    self.refuse(f"loading set {type(live).__name__}.{k}")
        # A loader that rebinds a tensor (``param.data = loaded``, a new Parameter) writes nothing the
        # dispatcher sees: the replay would leave that tensor unwritten.
        for (store, name), where in self.placed.get(sid, {}).items():
            t = shadow.__dict__.get(store, {}).get(name)
            if t is None or (t.untyped_storage().data_ptr(), t.storage_offset()) != where:
                self.refuse(f"loading replaced {type(live).__name__}.{name}")

    def refuse(self, why: str) -> None:
        if self.why is None:
            self.why = why

    class _Pause:
        def __init__(self, rec: Recorder) -> None:
            self.rec = rec

        def __enter__(self) -> None:
            self.rec._paused += 1

        def __exit__(self, *exc: Any) -> None:
            self.rec._paused -= 1

    def paused(self) -> Recorder._Pause:
        return Recorder._Pause(self)

    def plan(self, names: tuple[str, ...], live_of: dict[int, torch.nn.Module]) -> Plan | None:
        """The recorded plan (None if refused). ``live_of``: sid -> the live layer."""
        if self.why is not None:
            return None
        missing = set(self.copies) - set(self.order)
        if missing:  # copies into a layer that was never processed: not a stage the replay can redo
            self.refuse(f"{len(missing)} loaded layer(s) never processed")
            return None
        used = {c.src_name for cs in self.copies.values() for c in cs if c.src_name is not None}
        plan = Plan(names, {n: self.layouts[n] for n in used})
        plan.layers = [(live_of[sid], self.copies.get(sid, [])) for sid in self.order]
        return plan

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self._paused and self.why is None:
            self._see(func, args, kwargs)
        return func(*args, **kwargs)

    def _see(self, func: Any, args: tuple, kwargs: dict) -> None:
        if func in _VALUE_READS:  # a Python value out of tensor data: the load may depend on the data
            self.refuse(f"loading reads tensor values ({func}): it may depend on the data")
            return
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            hits = self.targets.find(dst) if dst.numel() else []
            if not hits:  # into a temporary (only its use as a source matters), not across a target
                if dst.numel() and (
                    self.targets.find(dst, overlap=True) or self.sources.find(dst, overlap=True)
                ):
                    self.refuse("a copy_ writes across a stage tensor or into a checkpoint tensor")
                return
            sid, store, name, offset, dtype = hits[0]
            # Alive checkpoint tensors the source lies in (a dead one's address may hold a temporary now).
            found = [(n, b) for n, r in self.sources.find(src) if (b := r()) is not None]
            if len(hits) != 1 or dst.dtype != dtype:
                self.refuse(f"{name} is written through a view of another layout")
                return
            if len(found) != 1 or kwargs or src.dtype != found[0][1].dtype:
                self.refuse(f"{name} is written from a computed tensor, not a view of a checkpoint tensor")
                return
            copy = Copy(
                store, name, _geometry(dst, offset), found[0][0], _geometry(src, found[0][1].storage_offset())
            )
            self.copies.setdefault(sid, []).append(copy)
            return
        if func in _FILLS and isinstance(args[0], torch.Tensor) and args[0].numel():
            hits = self.targets.find(args[0])
            value = 0 if func is torch.ops.aten.zero_.default else args[1]
            if (
                len(hits) == 1
                and not kwargs
                and isinstance(value, float | int | bool)
                and args[0].dtype == hits[0][4]
            ):
                sid, store, name, offset, _ = hits[0]
                self.copies.setdefault(sid, []).append(
                    Copy(store, name, _geometry(args[0], offset), None, None, value)
                )
                return
        schema = func._schema
        if not schema.is_mutable:
            return
        for i, a in enumerate(schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            val = kwargs.get(a.name, args[i] if i < len(args) else None)
            for t in val if isinstance(val, list | tuple) else (val,):
                if not isinstance(t, torch.Tensor) or not t.numel():
                    continue
                if hits := self.targets.find(t, overlap=True):
                    self.refuse(f"{func} writes {hits[0][2]}")
                elif self.sources.find(t, overlap=True):  # the replay reads the file as it is
                    self.refuse(f"{func} modifies a checkpoint tensor before it is copied")


_MISSING = object()
_FILLS = (torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default)
#: Ops that hand tensor data to Python (``.item()``, ``bool(t)``, ``.tolist()``, ``torch.equal``): a
#: loader that branches on, or fills with, a value of the file would replay the first file's choice.
_VALUE_READS = (
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.equal.default,
)
