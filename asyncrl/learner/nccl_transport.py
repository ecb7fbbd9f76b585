"""``learner.weight_transport=nccl``: weights broadcast from the learner's GPU into CUDA actors.

The data plane is vLLM's own NCCL weight-transfer engine, both sides: the learner runs vLLM's
trainer engine (``NCCLTrainerWeightTransferEngine``: rank 0 of a dedicated NCCL group, packed
broadcast, metadata checked against every tensor sent) and the actors' vLLM workers run vLLM's
``nccl`` worker engine. What asyncrl adds is the control plane: vLLM's trainer engine drives the
inference side through a ``VLLMWeightSyncClient`` (init / start / update / finish), and here that
client is :class:`RedisWeightSyncClient`, which turns each call into a round on the run's Redis
that every actor takes part in (:mod:`asyncrl.buffer.broadcast`; actor side
:mod:`asyncrl.actors.nccl_receiver`). The learner and the actors still never talk directly.

Version contract, unchanged: the actors label the new weights with
``finish_weight_update(weight_version=str(v))`` (so per-token versions stay the engine's own,
exact labels), and only after every actor reported ``done`` does :meth:`Publisher.publish` register
the manifest, which sets V. The manifest names no file (``nccl://<session>/v<N>``, digest none):
nothing is stored, so a restarted learner finds v unusable and re-publishes it, forming a new group.

Sending keeps the learner's parameters where they are (GPU); with ZeRO-3 the gathered tensors are
held on rank 0 for the duration of one broadcast (one model copy of GPU memory).

Limit (stated, not hidden): an NCCL group has a fixed size. An actor that dies makes the next
round fail on its 'started' deadline with the actor's name; the learner's supervision restarts
the learner, whose first publish forms a new group that the surviving and replaced actors join.
One that fails or dies during the broadcast fails the 'done' wait on the client's side thread, which
aborts the NCCL communicator (the broadcast would wait for the missing peer forever), so the publish
raises all the same. An actor whose receive outlasts ``learner.nccl_timeout_s`` (the learner died
mid-broadcast) fails as an engine and is restarted.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from asyncrl.buffer import WeightIntegrityError, WeightManifest, WeightTransport
from asyncrl.buffer.broadcast import BroadcastError, BroadcastSession, Round
from asyncrl.buffer.weights import BROADCAST_SCHEME

__all__ = [
    "NcclTransport",
    "RedisWeightSyncClient",
    "TensorMeta",
    "from_config",
    "nccl_world_size",
    "vllm_nccl_trainer",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str  # torch dtype name without the "torch." prefix (vLLM's wire format)
    shape: tuple[int, ...]


def nccl_world_size(num_actors: int, tensor_parallel_size: int, pipeline_parallel_size: int) -> int:
    """Ranks of the broadcast group: the learner's rank 0 plus every vLLM worker of every actor."""
    return 1 + num_actors * tensor_parallel_size * pipeline_parallel_size


class RedisWeightSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol, answered by every actor of the run through Redis.

    vLLM's trainer engine calls ``init_weight_transfer_engine`` on a side thread while it opens its
    NCCL endpoint, and ``update_weights`` on a side thread while it broadcasts; every call returns
    only when all actors reported the matching stage, or raises :class:`BroadcastError` naming the
    ones that did not. ``version`` and ``meta`` are set by :class:`NcclTransport` before each send:
    the start round carries the tensor names so an actor refuses a mismatch *before* anyone enters
    the collective (an NCCL broadcast with a missing peer would hang instead of failing).
    """

    def __init__(self, session: BroadcastSession, *, timeout_s: float, join_timeout_s: float) -> None:
        self.session = session
        self.timeout_s = timeout_s
        self.join_timeout_s = join_timeout_s
        self.session_id: str | None = None
        self.version = -1
        self.meta: list[TensorMeta] = []
        self.seq = -1
        self._formed: tuple[str, int, int] | None = None  # (address, port, world) announced by form()
        #: Called on the update thread when a round fails once the broadcast may have begun (see
        #: :meth:`update_weights`); :class:`NcclTransport` aborts the communicator there.
        self.on_update_failure: Callable[[], None] | None = None

    def _need_session(self) -> str:
        if self.session_id is None:
            raise BroadcastError("weight broadcast before init_weight_transfer_engine")
        return self.session_id

    def form(self, master_address: str, master_port: int, world_size: int, **wire: Any) -> None:
        """Announce a new group and wait until every worker rank is claimed, i.e. every actor engine is
        up and about to rendezvous. Done before the trainer opens its endpoint, whose TCPStore waits
        only ``store_timeout`` (300 s in vLLM) for the workers: engine start-up can take longer."""
        info = self.session.open(master_address, master_port, world_size, **wire)
        self.session_id, self.seq = info.id, -1
        self._formed = (master_address, int(master_port), int(world_size))
        log.info("weight broadcast: session %s (%d ranks) at %s:%d", info.id, world_size, master_address,
                 master_port)  # fmt: skip
        self.session.wait_claimed(info.id, timeout_s=self.join_timeout_s)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """The group's rendezvous (called by vLLM's trainer engine beside opening its endpoint): wait
        until every worker joined. Forms the group first unless :meth:`form` did for these addresses."""
        key = (init_info["master_address"], int(init_info["master_port"]), int(init_info["world_size"]))
        if self._formed != key:
            wire = {k: init_info[k] for k in ("packed", "packed_buffer_size_bytes", "packed_num_buffers")
                    if k in init_info}  # fmt: skip
            self.form(*key, **wire)
        self._formed = None  # one rendezvous per formed session
        self.session.wait(self._need_session(), "joined", timeout_s=self.join_timeout_s)

    def start_weight_update(self) -> None:
        """Every actor pauses generation and opens a layerwise reload (or refuses the tensor names)."""
        sid = self._need_session()
        self.seq += 1
        names = {"names": [m.name for m in self.meta], "dtype_names": [m.dtype for m in self.meta],
                 "shapes": [list(m.shape) for m in self.meta]}  # fmt: skip
        self.session.announce(Round(sid, self.version, self.seq, "start", names))
        self._wait(sid, "started")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Every actor receives (concurrently with the broadcast), finishes with the version label, resumes."""
        sid = self._need_session()
        try:
            if not isinstance(update_info, dict):
                raise BroadcastError("weight broadcast: chunked update_info is not supported")
            self.session.announce(Round(sid, self.version, self.seq, "update", dict(update_info)))
            self._wait(sid, "done")
        except BaseException:
            # The trainer's main thread is (or is about to be) inside the NCCL broadcast, which waits
            # for every peer forever: a dead or failed actor never arrives. Only an abort of the
            # communicator makes it return, so that send_weights can raise this error.
            if self.on_update_failure is not None:
                self.on_update_failure()
            raise

    def _wait(self, sid: str, stage: str) -> None:
        try:
            self.session.wait(sid, stage, seq=self.seq, timeout_s=self.timeout_s)
        except BroadcastError:
            # Release the actors already paused for this round (they close their reload and resume).
            self.session.announce(Round(sid, self.version, self.seq, "abort"))
            raise

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """The actors finished inside their update (they know the version from the round): check it."""
        self.session.wait(self._need_session(), "done", seq=self.seq, timeout_s=self.timeout_s)


class _Source:
    """A re-iterable ``WeightSource`` over the tensors of the current publish (set per version)."""

    def __init__(self) -> None:
        self.tensors: dict[str, Any] = {}

    def meta(self) -> list[TensorMeta]:
        return [
            TensorMeta(n, str(t.dtype).removeprefix("torch."), tuple(t.shape))
            for n, t in self.tensors.items()
        ]

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(self.tensors.items())


def _cuda_device() -> Any:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("learner.weight_transport='nccl' needs CUDA on the learner (none is visible)")
    return torch.device("cuda", torch.cuda.current_device())


def _settle(tensors: Iterable[Any]) -> None:
    """Wait until the work queued on the current CUDA stream (the optimizer step, the copies and
    ``contiguous()`` above) has landed. vLLM's packed producer concatenates the tensors on its own
    streams without waiting on the current one, and ZeRO-0/1/2 hand over the live parameters: a fused
    AdamW kernel the host ran ahead of could still be writing them (a torn or stale broadcast)."""
    import torch

    for t in tensors:
        if t.is_cuda:
            torch.cuda.current_stream(t.device).synchronize()
            return  # one device: the policy's


def vllm_nccl_trainer(
    client: RedisWeightSyncClient, source: _Source, *, master_address: str, master_port: int,
    world_size: int, packed: bool = True,
) -> Any:  # fmt: skip
    """vLLM's NCCL trainer engine (rank 0), rendezvoused with the actors through ``client``."""
    import torch
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    class Source(WeightSource):
        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(m.name, getattr(torch, m.dtype), m.shape) for m in source.meta()]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            return iter(source)

    info = NCCLTrainerInitInfo(master_address, master_port, world_size, packed=packed, rank=0)
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=Source())


class NcclTransport(WeightTransport):
    """Broadcast each version into every actor; see the module doc.

    ``trainer``: builds the sending engine from (client, source); default vLLM's NCCL trainer
    engine (CUDA). It is built at the first publish, which is when the group is formed.
    """

    digest = "none"

    #: NCCL broadcasts from the GPU: take the policy's tensors where they are (no host round trip).
    weights_device = None

    def __init__(
        self,
        session: BroadcastSession,
        expected_names: set[str] | None,
        *,
        master_address: str,
        master_port: int,
        world_size: int,
        timeout_s: float,
        join_timeout_s: float,
        trainer: Callable[[RedisWeightSyncClient, _Source], Any] | None = None,
        device: Any = None,
    ) -> None:
        self.expected_names = expected_names or None
        self.client = RedisWeightSyncClient(session, timeout_s=timeout_s, join_timeout_s=join_timeout_s)
        self.source = _Source()
        self.group = (master_address, int(master_port), int(world_size))
        self.device = device  # where the broadcast reads from (None: the current CUDA device)
        self._trainer = trainer or (
            lambda c, s: vllm_nccl_trainer(
                c, s, master_address=master_address, master_port=master_port, world_size=world_size
            )
        )
        self._engine: Any = None
        self._lock = threading.Lock()
        self.client.on_update_failure = self._abort_group

    def publish(self, version: int, state_dict: Any, dtype: str) -> WeightManifest:
        """Broadcast ``state_dict`` (mapping, or callable yielding pairs: always consumed) as ``version``."""
        items: Iterable = state_dict.items() if isinstance(state_dict, Mapping) else state_dict()
        device = self.device if self.device is not None else _cuda_device()
        # weights_device None: LearnerEngine.named_weights yields the GPU tensors themselves (ZeRO-3:
        # device copies), so .to() below is a no-op on a CUDA learner; host tensors (a mapping a caller
        # built, the CPU tests) are moved here.
        tensors = {
            n: t.detach().to(device)
            for n, t in items
            if self.expected_names is None or n in self.expected_names
        }
        if self.expected_names is not None and (missing := sorted(self.expected_names - tensors.keys())):
            raise ValueError(
                f"weights v{version}: model has no tensor(s) {missing[:5]} of the served checkpoint"
            )
        bad = sorted(n for n, t in tensors.items() if str(t.dtype).removeprefix("torch.") != dtype)
        if bad:
            raise ValueError(f"weights v{version}: tensors {bad[:3]} are not {dtype}")
        with self._lock:
            self.source.tensors = {n: t if t.is_contiguous() else t.contiguous() for n, t in tensors.items()}
            self.client.version, self.client.meta = int(version), self.source.meta()
            _settle(self.source.tensors.values())
            try:
                if self._engine is None:  # a new group: every actor up first, then the rendezvous
                    self.client.form(*self.group)
                    self._engine = self._trainer(self.client, self.source)
                self._engine.send_weights()
            except BaseException:
                # The group may be half-way through a collective: never reuse it (a restarted
                # learner forms a new one).
                self._shutdown_engine()
                raise
            finally:
                self.source.tensors = {}  # do not pin a model copy between publishes
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        return WeightManifest(
            int(version),
            f"{BROADCAST_SCHEME}{self.client.session_id}/v{version}",
            "",
            size,
            dtype,
            digest="none",
        )

    def fetch(self, manifest: WeightManifest) -> str:
        raise WeightIntegrityError(
            f"weights v{manifest.version} were broadcast ({manifest.path}); nothing stored"
        )

    def _abort_group(self) -> None:
        """Abort the group's communicator (vLLM's ``PyNcclCommunicator.destroy``: ``ncclCommAbort``) from
        the update thread: the broadcast blocked in NCCL on the main thread returns, later ones are no-ops
        (a destroyed communicator is disabled), and send_weights raises the round's error. The group is
        shut down for good in :meth:`publish` (destroy is idempotent)."""
        group = getattr(self._engine, "model_update_group", None)
        if group is not None:
            log.warning("weight broadcast v%d failed during the broadcast: aborting the NCCL group",
                        self.client.version)  # fmt: skip
            try:
                group.destroy()
            except Exception as e:  # the main thread must still get the round's error
                log.warning("weight broadcast: abort of the NCCL group: %s", e)

    def _shutdown_engine(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            try:
                engine.shutdown()
            except Exception as e:  # already broken: nothing more to release
                log.warning("weight broadcast: shutdown of the failed group: %s", e)

    def close(self) -> None:
        self._shutdown_engine()


def from_config(cfg: Any, redis_client: Any, expected_names: set[str] | None) -> NcclTransport:
    """The NCCL transport ``cfg.learner`` describes, on the run's Redis (rank 0 of the learner only)."""
    from vllm.utils.network_utils import get_ip, get_open_port

    lc, a = cfg.learner, cfg.actors
    world = lc.nccl_world_size or nccl_world_size(
        a.num_actors, a.tensor_parallel_size, a.pipeline_parallel_size
    )
    return NcclTransport(
        BroadcastSession(redis_client, cfg.run.name),
        expected_names,
        master_address=lc.nccl_master_address or get_ip(),
        master_port=lc.nccl_master_port or get_open_port(),
        world_size=world,
        timeout_s=lc.nccl_timeout_s,
        join_timeout_s=lc.nccl_join_timeout_s,
    )
