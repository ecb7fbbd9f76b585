"""What runs inside the vLLM worker: a weight-transfer engine for published safetensors files.

vLLM 0.32 has a weight-transfer API (``AsyncLLM.init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``) with pluggable engines
(NCCL and CUDA IPC built in). :class:`FileWeightTransferEngine` is ours, registered as
``asyncrl_file``: ``update_weights({"path": ..., "version": N})`` loads a published file (file or
shared-memory transport) into the running model. Its lifecycle is the one vLLM's NCCL engine uses
(layerwise reload started in ``start_weight_update``, finalized in ``finish_weight_update``), so
models whose weights are re-processed after loading (on CPU every linear layer is repacked into a
oneDNN handle) are re-processed exactly as vLLM does after a first load. CUDA actors use vLLM's
``nccl`` engine through the same calls (see ``asyncrl.actors.engine``). The worker extension's
``asyncrl_stage_*`` RPCs run the staged alternative (:mod:`asyncrl.actors.staging`): the same file,
checks and processing, built while generating and switched in the pause.

This module is imported by vLLM in the worker process (``worker_extension_cls``), which is where
the engine registry must know ``asyncrl_file`` before the worker creates its engine; the import
registers it. The front end never needs it.

Invariant: an update either loads every tensor the served checkpoint has, or raises before
touching the model. vLLM itself only logs a warning for weights missing from an iterator, which
would leave a silently half-updated policy; the name check below turns that into an error. A tensor
of another shape would raise inside ``load_weights``, after earlier layers were replaced: shapes and
dtypes are checked first too (from the files' headers), and a name in two files is refused. The
file's ``asyncrl_version`` metadata tag (written by every asyncrl transport) must equal the version
being loaded: the shared-memory transport has no sha256, so this is what proves the bytes are the
version the manifest names.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from . import eager_ranks, tensor_specs
from .cpu_heap import KEPT  # ctypes only
from .engine_logs import quiet_routine_lines

__all__ = [
    "WeightReloadExtension",
    "FileWeightTransferEngine",
    "EXTENSION_CLS",
    "FILE_BACKEND",
    "KEEP_FREED_KEY",
    "tied_layers",
    "reprocess",
]

EXTENSION_CLS = f"{__name__}.WeightReloadExtension"
FILE_BACKEND = "asyncrl_file"
#: ``additional_config`` key: keep the memory a CPU swap frees (asyncrl.actors.cpu_heap) when the
#: checkpoint has at least this value's bytes.
KEEP_FREED_KEY = "asyncrl_keep_freed_memory"

# No "Successfully reset prefix cache" line per swap in the actor's log (asyncrl.actors.engine_logs): this
# import runs in the engine-core process when the worker runs there (CPU in-process engine, one GPU).
quiet_routine_lines()


def _mark_computed_buffers() -> None:
    """vLLM's layerwise reload counts every buffer of a layer as loadable, but RotaryEmbedding's
    ``cos_sin_cache`` is computed at construction and is in no checkpoint: every swap logged the
    WARNING "RotaryEmbedding: Failed to load weights" and put the (correct) cache back. Declaring it
    never-loaded (vLLM's ``SKIP_LOAD_TENSORS``) states exactly that: no warning, the cache is kept."""
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS

    SKIP_LOAD_TENSORS.add("cos_sin_cache")


_mark_computed_buffers()  # this module is imported in the worker process, before any reload
eager_ranks.install()  # before the first sampling; see asyncrl.actors.eager_ranks


def tied_layers(model: Any) -> list[list[Any]]:
    """Groups of layers that share a parameter tensor (tied input/output embeddings: the head's
    ``weight`` is the embedding's), found while the model holds its real tensors.

    Why: the checkpoint holds the shared tensor once (no ``lm_head.weight``), so vLLM's layerwise reload
    loads the embedding and gives the head nothing. The new values do land in the shared tensor (the
    reload copies into the original storage), but the head's layer is not re-processed: on CPU its
    packed GEMM handle (``cpu_linear``, built from the weight) kept serving the first weights, and a
    synchronous fp32 run drifted from the learner at every swap (vLLM logs "ParallelLMHead: Failed to
    load weights"). :meth:`FileWeightTransferEngine.finish_weight_update` re-processes the unloaded
    members of a group one of whose layers loaded."""
    owners: dict[int, list[Any]] = {}
    for layer in model.modules():
        for p in layer._parameters.values():
            if p is not None and not p.is_meta:
                owners.setdefault(p.untyped_storage().data_ptr(), []).append(layer)
    groups: list[list[Any]] = []
    for layers in owners.values():
        unique = list({id(layer): layer for layer in layers}.values())
        if len(unique) > 1:
            groups.append(unique)
    return groups


class _QuietFollowers(logging.Filter):
    """Drops vLLM's "<layer>: Failed to load weights" for the layers named (tied followers)."""

    def __init__(self, names: set[str]) -> None:
        super().__init__()
        self.names = names

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.msg == "%s: Failed to load weights" and record.args and record.args[0] in self.names
        )


def reprocess(layer: Any) -> None:
    """Run ``layer``'s quant method's after-loading processing again, on its current tensors (what the
    layerwise reload does for a layer that loaded); only unquantized methods, whose processing is a
    pure function of the layer's own weight, reach here (asyncrl.actors.staging.SUPPORTED_METHODS)."""
    qm = getattr(layer, "quant_method", None)
    if qm is None:
        return
    if type(qm).__name__ not in ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"):
        raise RuntimeError(
            f"{type(layer).__name__} shares a parameter with a reloaded layer but its quant method "
            f"{type(qm).__name__} is not known to re-process from its weight alone"
        )
    if hasattr(layer, "_already_called_process_weights_after_loading"):
        delattr(layer, "_already_called_process_weights_after_loading")
    qm.process_weights_after_loading(layer)


@dataclass
class FileInitInfo(WeightTransferInitInfo):
    """Nothing to set up: the bytes come from a path named by each update."""


@dataclass
class FileUpdateInfo(WeightTransferUpdateInfo):
    path: str  # a safetensors file, or a directory of them (a sharded checkpoint)
    version: int = -1  # expected ``asyncrl_version`` metadata tag; -1 = files without one


class FileWeightTransferEngine(WeightTransferEngine[FileInitInfo, FileUpdateInfo]):
    """Loads published safetensors files into the worker's model (see the module doc)."""

    init_info_cls = FileInitInfo
    update_info_cls = FileUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._expected: dict[str, tensor_specs.TensorSpec] | None = None  # the served checkpoint's
        self._tied: list[list[Any]] | None = None  # layers sharing a parameter (tied_layers), found once
        self.last: dict[str, Any] = {}
        # Created once per worker, after the model loaded and before any swap: the first swap already
        # packs into memory that later swaps reuse. "off" = not asked for or not a CPU device.
        self.heap = "off"
        min_bytes = (self.vllm_config.additional_config or {}).get(KEEP_FREED_KEY)
        if self.device.type == "cpu" and min_bytes is not None:
            from .cpu_heap import keep_freed_memory
            from .swap_prepare import safetensors_bytes

            size = safetensors_bytes(self.model_config.model)
            if size >= int(min_bytes):
                self.heap = keep_freed_memory()
            else:
                self.heap = f"off: checkpoint {size / 2**20:.1f} MiB < {int(min_bytes) / 2**20:.0f} MiB"

    def init_transfer_engine(self, init_info: FileInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if self._tied is None:  # before the reload moves every layer's tensors to the meta device
            self._tied = tied_layers(self.model)
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        loaded = {id(layer) for group in self._tied or () for layer in group
                  if (get_layerwise_info(layer).load_numel or 0) > 0}  # fmt: skip
        follow = [layer for group in self._tied or () if any(id(x) in loaded for x in group)
                  for layer in group if id(layer) not in loaded]  # fmt: skip
        # vLLM warns "<layer>: Failed to load weights" for each of them; they follow the tensor they
        # share, re-processed below: not a failure, and a warning at every swap would say it was.
        quiet = _QuietFollowers({type(layer).__name__ for layer in follow})
        layerwise_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        layerwise_log.addFilter(quiet)
        try:
            finalize_layerwise_reload(self.model, self.model_config)
        finally:
            layerwise_log.removeFilter(quiet)
        for layer in follow:
            reprocess(layer)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes the accelerator afterwards, which raises on a CPU-only
        # torch; the copies below are ordered on the current stream anyway.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: FileUpdateInfo) -> None:
        t0 = time.perf_counter()
        with ExitStack() as stack:
            try:
                owner = self.open_checked(update_info.path, update_info.version, stack)
            except BaseException:
                # Nothing was loaded: finalizing puts every layer's current tensors back, so the
                # model keeps serving the old weights (vLLM ends the update session on a raise).
                self.finish_weight_update()
                raise

            def tensors() -> Iterator:
                for name in sorted(owner):
                    yield name, owner[name].get_tensor(name)

            self.model.load_weights(tensors())
        self.last = {"seconds": time.perf_counter() - t0, "tensors": len(owner)}

    def open_checked(self, path: str, version: int, stack: ExitStack) -> dict[str, Any]:
        """name -> open safetensors handle (closed with ``stack``), after the checks of the module doc:
        version tags, names, and each tensor's shape and dtype against the served checkpoint's (see
        :mod:`asyncrl.actors.tensor_specs`), all before the model is touched."""
        if self._expected is None:
            self._expected = tensor_specs.checkpoint_specs(self.model_config.model)
        return tensor_specs.open_checked(path, version, stack, self._expected)

    def shutdown(self) -> None:
        pass


def register() -> None:
    """Make ``asyncrl_file`` known to vLLM's engine registry in this process (idempotent)."""
    try:
        WeightTransferEngineFactory.register_engine(FILE_BACKEND, FileWeightTransferEngine)
    except ValueError:  # already registered (re-import)
        pass


register()


class WeightReloadExtension:
    """Methods added to every vLLM worker (``self`` is the worker)."""

    def asyncrl_last_update(self) -> dict:
        """Timing of the last file update in this worker: ``{"seconds", "tensors"}``."""
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(getattr(engine, "last", {}) or {})

    def asyncrl_heap(self) -> str:
        """What asyncrl.actors.cpu_heap did in this worker: "kept", "off", or why not."""
        return str(getattr(getattr(self, "weight_transfer_engine", None), "heap", "off"))

    # Staged swaps (asyncrl.actors.staging): begin and poll run while the engine generates, commit
    # inside the pause; the front end sets the weight version label itself.

    def _asyncrl_stager(self):
        stager = getattr(self, "_asyncrl_stager_obj", None)
        if stager is None:
            from asyncrl.actors.staging import Stager

            engine = self.weight_transfer_engine
            if not isinstance(engine, FileWeightTransferEngine):
                raise RuntimeError(f"staged swaps need the {FILE_BACKEND} weight-transfer engine")
            stager = Stager(
                engine.model,
                engine.model_config,
                self.vllm_config,
                engine.open_checked,
                scratch_pool=engine.heap != KEPT,  # a kept heap reuses freed memory by itself
            )
            self._asyncrl_stager_obj = stager
        return stager

    def asyncrl_stage_begin(self, path: str, version: int, wait: bool = False, replay: bool = True) -> dict:
        """Start building ``path`` (tagged ``version``) into a stage in a background thread; returns at
        once: ``{"started": True}``, or ``{"unsupported": reason}`` for a model that cannot be staged.
        ``wait``: build it inside this call and return with :meth:`asyncrl_stage_poll`'s fields too.
        ``replay``: replay the loads the first stage recorded (asyncrl.actors.stage_replay)."""
        return self._asyncrl_stager().begin(path, int(version), bool(wait), bool(replay))

    def asyncrl_stage_poll(self) -> dict:
        """``{"done", "busy", "error", "seconds", "recycled_bytes", "retired_alive", "replayed",
        "plan_refused", "plan_mismatches"}`` of the stage being built; ``retired_alive``: tensors the
        last commit replaced that are not freed yet (0 shortly after the pause)."""
        return self._asyncrl_stager().poll()

    def asyncrl_stage_commit(self, version: int) -> dict:
        """Switch the model to the stage of ``version`` (pointer moves only; call with the scheduler paused)."""
        return self._asyncrl_stager().commit(int(version))

    def asyncrl_stage_discard(self) -> None:
        """Drop a stage (built or failed) without switching."""
        self._asyncrl_stager().discard()
