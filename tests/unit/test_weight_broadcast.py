"""learner.weight_transport=nccl on CPU: config, the Redis control plane, the learner's handshake.

Real Redis, the real learner-side client/transport/publisher and the real actor-side receiver. What
cannot run here is CUDA: the NCCL data plane (vLLM's PyNccl communicator and packed broadcast) and the
vLLM engine's weight reload. In their place, ``_Plane`` carries the tensors between the threads and
``_CpuTrainer`` calls the client exactly in the order vLLM's ``NCCLTrainerWeightTransferEngine`` does
(trainer_init: init on a side thread while the endpoint opens; send_weights: start, update on a side
thread concurrently with the broadcast, finish). The CUDA path runs in tests/e2e/test_gpu.py.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch

from asyncrl.actors.nccl_receiver import NcclReceiver, check_names
from asyncrl.buffer import ReplayBuffer, WeightIntegrityError, verify
from asyncrl.buffer.broadcast import BroadcastError, BroadcastSession
from asyncrl.config import ConfigError, load_config
from asyncrl.learner.nccl_transport import NcclTransport, nccl_world_size
from asyncrl.learner.publisher import Publisher

# ---------------------------------------------------------------------------------------- config


def test_nccl_refused_for_cpu_actors_naming_key_and_allowed_values():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["learner.weight_transport=nccl"])
    msg = str(e.value)
    assert "learner.weight_transport" in msg and "actors.num_gpus_per_actor" in msg
    assert all(v in msg for v in ("'auto'", "'file'", "'shm'"))
    cfg = load_config(None, ["learner.weight_transport=nccl", "actors.num_gpus_per_actor=1"])
    assert cfg.learner.weight_transport == "nccl"
    with pytest.raises(ConfigError, match="allowed values: 'auto', 'file', 'shm', 'nccl'"):
        load_config(None, ["learner.weight_transport=gloo"])


def test_world_size_counts_every_vllm_worker_plus_the_learner():
    assert nccl_world_size(1, 1, 1) == 2
    assert nccl_world_size(8, 1, 1) == 9
    assert nccl_world_size(2, 4, 2) == 17


# ---------------------------------------------------------------------------------------- session


def test_rank_claims_are_atomic_disjoint_and_bounded(redis_client, run_name):
    s = BroadcastSession(redis_client, run_name)
    info = s.open("10.0.0.1", 29500, world_size=17)
    with ThreadPoolExecutor(8) as ex:  # 8 engines of 2 workers race for the 16 worker ranks
        offsets = list(ex.map(lambda i: s.claim(info.id, f"a{i}", 2), range(8)))
    assert sorted(offsets) == list(range(1, 17, 2))
    assert s.members(info.id) == {f"a{i}": (offsets[i], 2) for i in range(8)}
    with pytest.raises(BroadcastError, match="only ranks up to 16"):
        s.claim(info.id, "late", 1)
    with pytest.raises(BroadcastError, match="already a member"):
        s.claim(info.id, "a0", 1)
    with pytest.raises(BroadcastError, match="not the current one"):
        s.claim("old-session", "b", 1)
    assert s.session().worker_init_info(offsets[3])["rank_offset"] == offsets[3]
    # a new session forgets every member of the old one
    new = s.open("10.0.0.1", 29501, world_size=2)
    assert new.id != info.id and s.members(new.id) == {} and s.claim(new.id, "a0", 1) == 1


# ---------------------------------------------------------------------------------------- stand-ins for CUDA


class _Plane:
    """The NCCL group's data plane between threads: rendezvous of all ranks, broadcast from rank 0."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.ranks: dict[int, queue.Queue] = {}
        self.cond = threading.Condition()
        self.sent = 0
        self.on_first_send = None

    def join(self, rank: int) -> queue.Queue:
        with self.cond:
            assert rank not in self.ranks and 0 < rank < self.world_size, rank
            self.ranks[rank] = q = queue.Queue()
            self.cond.notify_all()
        return q

    def open_endpoint(self, timeout: float) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.ranks) == self.world_size - 1, timeout), "rendezvous"

    def broadcast(self, t: torch.Tensor) -> None:
        if self.sent == 0 and self.on_first_send is not None:
            self.on_first_send()
        self.sent += 1
        for q in self.ranks.values():
            q.put(t.clone())


class _CpuTrainer:
    """Calls the client in the order of vLLM's NCCLTrainerWeightTransferEngine (see the module doc)."""

    def __init__(self, client, source, plane: _Plane) -> None:
        self.client, self.source, self.plane = client, source, plane
        payload = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                   "world_size": plane.world_size, "packed": True}  # fmt: skip
        with ThreadPoolExecutor(1) as ex:
            fut = ex.submit(client.init_weight_transfer_engine, payload)
            self.plane.open_endpoint(timeout=client.join_timeout_s + 1)
            fut.result()

    def send_weights(self) -> None:
        meta = self.source.meta()
        info = {"names": [m.name for m in meta], "dtype_names": [m.dtype for m in meta],
                "shapes": [list(m.shape) for m in meta]}  # fmt: skip
        self.client.start_weight_update()
        ex = ThreadPoolExecutor(1)
        try:
            fut = ex.submit(self.client.update_weights, info)
            for _name, t in self.source:
                self.plane.broadcast(t)
            fut.result()
        finally:
            ex.shutdown(wait=False)
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        pass


@dataclass
class _Swap:
    version: int
    mode: str
    pause_s: float = 0.0


class _Llm:
    def __init__(self, plane: _Plane, ranks: int) -> None:
        self.plane, self.ranks = plane, ranks
        self.queues: list[queue.Queue] = []
        self.received: dict[str, torch.Tensor] = {}
        self.closed_reloads = 0
        self.released = 0  # shutdown_weight_transfer_engine calls: communicators of old groups freed

    async def init_weight_transfer_engine(self, req) -> None:
        off = req.init_info["rank_offset"]
        self.queues = [self.plane.join(off + i) for i in range(self.ranks)]

    async def shutdown_weight_transfer_engine(self) -> None:
        self.queues = []
        self.released += 1

    async def update_weights(self, req) -> None:
        info = req.update_info
        for name, dt, shape in zip(info["names"], info["dtype_names"], info["shapes"], strict=True):
            for q in self.queues:  # every worker of the engine receives every tensor (TP shards on load)
                t = await asyncio.to_thread(q.get, True, 10)
                assert t.dtype == getattr(torch, dt) and list(t.shape) == shape, name
            self.received[name] = t

    async def finish_weight_update(self, weight_version=None) -> None:
        assert weight_version is None  # only the receiver's abort path calls it directly
        self.closed_reloads += 1


class _Engine:
    """The engine's swap contract: paused around ``load``, then labelled with the version."""

    def __init__(self, plane: _Plane, ranks: int) -> None:
        self.llm = _Llm(plane, ranks)
        self.version: int | None = None
        self.paused = False
        self.labels: list[int] = []

    async def swap_with(self, version, mode, load, check=None):
        self.paused = True
        try:
            await load()
            self.version = version  # finish_weight_update(weight_version=str(version))
            self.labels.append(version)
        finally:
            self.paused = False
        return _Swap(version, mode)


class _Actor:
    """An actor's weight watcher on its own event loop (thread): NcclReceiver.poll in a loop."""

    def __init__(self, redis_client, run, actor_id, plane, names, ranks=1) -> None:
        self.engine = _Engine(plane, ranks)
        self.receiver = NcclReceiver(self.engine, BroadcastSession(redis_client, run), actor_id, names, ranks,
                                     timeout_s=10, poll_s=0.001)  # fmt: skip
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=lambda: asyncio.run(self._loop()), daemon=True)
        self.thread.start()

    async def _loop(self) -> None:
        try:
            while not self.stop.is_set():
                await self.receiver.poll("in_flight")
                await asyncio.sleep(0.001)
        except BaseException as e:
            self.error = e

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed.weight": torch.randn(11, 8, generator=g), "model.layers.0.w": torch.randn(8, 8, generator=g),
            "model.norm.weight": torch.randn(8, generator=g)}  # fmt: skip


#: The actors' threads import vLLM's weight-transfer modules before they claim a rank: seconds on a
#: loaded 2-core box (10 s failed "3 of 3 worker ranks never claimed" now and then). Only a failure waits.
JOIN_S = 60.0


@pytest.fixture
def stack(redis_client, run_name):
    """(plane, actors, publisher, buffer) for 2 actors: one with 2 workers (TP=2), one with 1."""
    names = set(_weights(0))
    plane = _Plane(world_size=1 + 2 + 1)
    actors = [_Actor(redis_client, run_name, "actor-0", plane, names, ranks=2),
              _Actor(redis_client, run_name, "actor-1", plane, names, ranks=1)]  # fmt: skip
    transport = NcclTransport(
        BroadcastSession(redis_client, run_name), names, master_address="127.0.0.1", master_port=1,
        world_size=plane.world_size, timeout_s=2.0, join_timeout_s=JOIN_S,
        trainer=lambda c, s: _CpuTrainer(c, s, plane), device="cpu",
    )  # fmt: skip
    buf = ReplayBuffer(redis_client, run_name)
    yield plane, actors, Publisher(buf, transport, keep_versions=2, dtype="float32"), buf
    for a in actors:
        a.close()
    buf.delete_run()


def test_broadcast_rounds_deliver_exact_weights_then_set_v(stack, redis_client, run_name):
    plane, actors, pub, buf = stack
    session = BroadcastSession(redis_client, run_name)
    started_at_first_send: list[set[str]] = []

    def check_started() -> None:  # the broadcast must not begin before every actor paused and said so
        sid = pub.transport.client.session_id
        _m, states, _n, _w = session._snapshot(sid)
        started_at_first_send.append({a for a, s in states.items() if s.stage == "started"})
        assert all(a.engine.paused for a in actors)

    plane.on_first_send = check_started
    for v in range(4):
        w = _weights(v)
        m = pub.publish(v, w)
        # V = v is visible only now, and every actor already serves (and labels) v.
        assert buf.version() == v and [a.engine.version for a in actors] == [v, v]
        for a in actors:
            assert a.engine.llm.received.keys() == w.keys()
            assert all(torch.equal(a.engine.llm.received[n], w[n]) for n in w)
        assert m.path == f"nccl://{pub.transport.client.session_id}/v{v}" and m.digest == "none"
        assert m.size == sum(t.numel() * 4 for t in w.values()) and buf.manifest(v) == m
        plane.sent = 0
    assert started_at_first_send[0] == {"actor-0", "actor-1"}
    assert [a.engine.labels for a in actors] == [[0, 1, 2, 3]] * 2
    # ranks: actor-0's two workers and actor-1's one are disjoint and fill the group
    assert sorted(plane.ranks) == [1, 2, 3]
    claimed = {(a.receiver.rank_offset, a.receiver.ranks) for a in actors}  # claim order is a race
    assert claimed in ({(1, 2), (3, 1)}, {(1, 1), (2, 2)})
    # nothing stored: a resumed learner must re-publish (usable False), and no actor can "verify" it
    assert not pub.usable(3)
    with pytest.raises(WeightIntegrityError, match="broadcast over NCCL"):
        verify(buf.manifest(3))
    assert buf.manifest_versions() == [2, 3]  # pruned like any transport
    assert all(a.error is None for a in actors)


def test_name_mismatch_is_refused_before_the_collective(redis_client, run_name):
    names = set(_weights(0))
    plane = _Plane(world_size=3)
    good = _Actor(redis_client, run_name, "actor-0", plane, names)
    bad = _Actor(redis_client, run_name, "actor-1", plane, names | {"model.extra"})
    transport = NcclTransport(BroadcastSession(redis_client, run_name), names, master_address="127.0.0.1", master_port=1,
                              world_size=3, timeout_s=60.0, join_timeout_s=60.0,
                              trainer=lambda c, s: _CpuTrainer(c, s, plane), device="cpu")  # fmt: skip
    buf = ReplayBuffer(redis_client, run_name)
    try:
        t0 = time.monotonic()
        with pytest.raises(
            BroadcastError, match=r"actor-1: tensor names do not match.*missing \['model.extra'\]"
        ):
            Publisher(buf, transport, 2, "float32").publish(0, _weights(0))
        # Refused at once, not at the 60 s deadline (a cold first run spends several seconds importing).
        assert time.monotonic() - t0 < 30.0, "refused at once, not at the deadline"
        assert plane.sent == 0 and buf.manifest_versions() == [] and buf.version() == 0
        assert good.engine.version is None and bad.engine.version is None
        assert good.error is None and bad.error is None
    finally:
        good.close()
        bad.close()
        buf.delete_run()


def test_shape_mismatch_is_refused_before_the_collective(redis_client, run_name, tmp_path):
    """Right names, one tensor of another shape: the actor refuses at the start round (a wrong shape would
    raise inside load_weights after earlier layers were replaced), before anyone pauses or receives."""
    from safetensors.torch import save_file

    from asyncrl.actors.nccl_receiver import expected_names

    w = _weights(0)
    names = set(w)
    for d, served in (("good", w), ("bad", {**w, "model.embed.weight": torch.zeros(12, 8)})):
        (tmp_path / d).mkdir()
        save_file(served, str(tmp_path / d / "model.safetensors"))
    plane = _Plane(world_size=3)
    good = _Actor(redis_client, run_name, "actor-0", plane, expected_names(tmp_path / "good"))
    bad = _Actor(redis_client, run_name, "actor-1", plane, expected_names(tmp_path / "bad"))
    transport = NcclTransport(BroadcastSession(redis_client, run_name), names, master_address="127.0.0.1", master_port=1,
                              world_size=3, timeout_s=60.0, join_timeout_s=60.0,
                              trainer=lambda c, s: _CpuTrainer(c, s, plane), device="cpu")  # fmt: skip
    buf = ReplayBuffer(redis_client, run_name)
    try:
        with pytest.raises(BroadcastError, match=r"actor-1: tensor shapes/dtypes do not match.*\[11, 8\] float32, "
                           r"served \[12, 8\] float32"):  # fmt: skip
            Publisher(buf, transport, 2, "float32").publish(0, w)
        assert plane.sent == 0 and buf.manifest_versions() == [] and buf.version() == 0
        assert good.engine.version is None and bad.engine.version is None and not bad.engine.llm.received
        assert good.error is None and bad.error is None
    finally:
        good.close()
        bad.close()
        buf.delete_run()


def test_dead_actor_fails_the_round_by_name_and_v_stays(stack):
    plane, actors, pub, buf = stack
    pub.publish(0, _weights(0))
    assert plane.sent == 3
    plane.sent = 0
    actors[1].close()  # an actor that died after joining
    t0 = time.monotonic()
    with pytest.raises(BroadcastError, match=r"no 'started' after 2 s from \['actor-1'\]"):
        pub.publish(1, _weights(1))
    assert 1.9 < time.monotonic() - t0 < 6.0
    assert buf.version() == 0 and buf.manifest_versions() == [0] and plane.sent == 0
    assert pub.transport._engine is None  # the group is never reused after a failed round
    # the surviving actor was paused for the round: released at once, old weights, reload closed
    deadline = time.monotonic() + 5
    while actors[0].engine.llm.closed_reloads == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert actors[0].engine.llm.closed_reloads == 1 and not actors[0].engine.paused
    assert actors[0].engine.version == 0 and actors[0].error is None


class _Comm:
    """vLLM's PyNcclCommunicator as far as an abort goes: ``destroy`` (ncclCommAbort) releases a broadcast
    blocked on a missing peer."""

    def __init__(self) -> None:
        self.aborted = threading.Event()

    def destroy(self) -> None:
        self.aborted.set()


def test_an_actor_failing_mid_broadcast_aborts_the_blocked_send(stack):
    """NCCL waits for a peer that fails after 'started' forever: the failed 'done' wait (update thread)
    aborts the communicator, so the broadcast returns and the publish raises instead of hanging."""
    plane, actors, pub, buf = stack
    pub.publish(0, _weights(0))
    plane.sent = 0
    comm = pub.transport._engine.model_update_group = _Comm()
    plane.on_first_send = lambda: comm.aborted.wait(20)  # the broadcast, blocked until an abort

    async def dies(req) -> None:
        raise RuntimeError("worker died")

    actors[1].engine.llm.update_weights = dies
    t0 = time.monotonic()
    with pytest.raises(BroadcastError, match=r"actor-1: RuntimeError: worker died"):
        pub.publish(1, _weights(1))
    assert comm.aborted.is_set() and time.monotonic() - t0 < 10
    assert buf.version() == 0 and pub.transport._engine is None


def test_a_receive_outlasting_the_deadline_fails_the_engine(redis_client, run_name):
    """The learner died mid-broadcast: the receive (vLLM: a collective RPC, engine paused) would wait
    forever. Past timeout_s the actor raises an engine failure (its supervision restarts the engine)."""
    from asyncrl.actors.nccl_receiver import ReceiveStalled
    from asyncrl.actors.swap_prepare import EngineError
    from asyncrl.buffer.broadcast import Round

    names = set(_weights(0))
    actor = _Actor(redis_client, run_name, "actor-0", _Plane(world_size=2), names)
    actor.receiver.timeout_s = 1.0
    s = BroadcastSession(redis_client, run_name)
    try:
        sid = s.open("127.0.0.1", 1, world_size=2).id
        s.wait(sid, "joined", timeout_s=30)
        meta = {"names": sorted(names), "dtype_names": ["float32"] * 3,
                "shapes": [list(_weights(0)[n].shape) for n in sorted(names)]}  # fmt: skip
        s.announce(Round(sid, 0, 0, "start", meta))
        s.wait(sid, "started", seq=0, timeout_s=10)
        s.announce(Round(sid, 0, 0, "update", meta))  # ... and the learner dies: nothing is sent
        actor.thread.join(6)
        assert isinstance(actor.error, ReceiveStalled) and isinstance(actor.error, EngineError)
        with pytest.raises(
            BroadcastError, match="actor-0: ReceiveStalled: no weights of v0 received within 1 s"
        ):
            s.wait(sid, "done", seq=0, timeout_s=1)
    finally:
        actor.close()


def test_join_timeout_names_the_missing_ranks(redis_client, run_name):
    names = set(_weights(0))
    plane = _Plane(world_size=3)
    only = _Actor(redis_client, run_name, "actor-0", plane, names)
    transport = NcclTransport(BroadcastSession(redis_client, run_name), names, master_address="127.0.0.1", master_port=1,
                              world_size=3, timeout_s=1.0, join_timeout_s=1.0,
                              trainer=lambda c, s: _CpuTrainer(c, s, plane), device="cpu")  # fmt: skip
    try:
        t0 = time.monotonic()
        with pytest.raises(
            BroadcastError, match=r"1 of 2 worker ranks never claimed after 1 s \(joined: \['actor-0'\]"
        ):
            transport.publish(0, _weights(0), "float32")
        assert time.monotonic() - t0 < 5 and transport._engine is None  # no rendezvous was attempted
        with pytest.raises(BroadcastError, match="1 of 2 worker ranks never claimed"):
            transport.client.session.wait(transport.client.session_id, "joined", timeout_s=0.2)
    finally:
        only.close()


def test_check_names():
    assert check_names({"a", "b"}, ["b", "a"]) == ""
    assert check_names({"a", "b"}, ["a", "b", "lm_head.weight"]) == ""  # tied head: vLLM skips it
    assert "missing ['b']" in check_names({"a", "b"}, ["a"])
    assert "unexpected ['c']" in check_names({"a"}, ["a", "c"])
    assert "duplicate" in check_names({"a"}, ["a", "a"])


def test_a_restarted_actor_waits_for_the_next_group(stack, redis_client, run_name):
    """A new engine of an actor already in the group cannot take its old ranks (that group is broken):
    it stays out without erroring, the learner's next round fails naming it, and the group the learner
    forms next (its restart) has everyone in it again."""
    plane, actors, pub, buf = stack
    pub.publish(0, _weights(0))
    actors[1].close()
    names = set(_weights(0))
    plane2 = _Plane(world_size=plane.world_size)
    reborn = _Actor(redis_client, run_name, "actor-1", plane2, names, ranks=1)
    try:
        time.sleep(0.3)
        assert reborn.error is None and reborn.receiver.joined is None  # stayed out, kept polling
        with pytest.raises(BroadcastError, match=r"\['actor-1'\]"):
            pub.publish(1, _weights(1))
        # The learner's restart: a new transport forms a new group; both actors join it.
        actors[0].engine.llm.plane = plane2
        pub2 = Publisher(buf, NcclTransport(
            BroadcastSession(redis_client, run_name), names, master_address="127.0.0.1", master_port=1,
            world_size=plane2.world_size, timeout_s=2.0, join_timeout_s=JOIN_S,
            trainer=lambda c, s: _CpuTrainer(c, s, plane2), device="cpu"), 2, "float32")  # fmt: skip
        pub2.publish(1, _weights(1))
        assert buf.version() == 1 and actors[0].engine.version == reborn.engine.version == 1
        assert all(torch.equal(reborn.engine.llm.received[n], t) for n, t in _weights(1).items())
        # The survivor released the old group's communicator before joining (vLLM overwrites it unfreed).
        assert actors[0].engine.llm.released == 1 and reborn.engine.llm.released == 0
    finally:
        reborn.close()


@pytest.mark.gpu
def test_publish_waits_for_the_current_stream_before_a_side_stream_reads(redis_client, run_name):
    """vLLM's packed producer concatenates on its own streams without waiting on the current one; the
    live ZeRO-0 parameters may still be written there by an optimizer kernel the host ran ahead of."""

    class SideStreamReader:  # what the packed producer does, minus NCCL
        def __init__(self, source) -> None:
            self.source, self.got = source, None

        def send_weights(self) -> None:
            with torch.cuda.stream(torch.cuda.Stream()):
                self.got = torch.cat([t.flatten() for _n, t in self.source]).cpu()

        def shutdown(self) -> None:
            pass

    w = torch.zeros(1 << 20, device="cuda")
    torch.cuda._sleep(2_000_000_000)  # a long kernel queued ahead of the write: the optimizer step
    w.fill_(1.0)
    t = NcclTransport(BroadcastSession(redis_client, run_name), None, master_address="127.0.0.1", master_port=1,
                      world_size=2, timeout_s=1.0, join_timeout_s=1.0, device=w.device)  # fmt: skip
    t._engine = reader = SideStreamReader(t.source)  # a formed group: no actors needed
    t.publish(0, {"w": w}, "float32")
    assert bool((reader.got == 1.0).all())


def test_the_vllm_calls_the_receiver_makes_exist_with_these_signatures():
    import inspect

    from vllm.v1.engine.async_llm import AsyncLLM

    for name, params in (("init_weight_transfer_engine", ["self", "request"]), ("update_weights", ["self", "request"]),
                         ("finish_weight_update", ["self", "weight_version"]),
                         ("shutdown_weight_transfer_engine", ["self"])):  # fmt: skip
        fn = getattr(AsyncLLM, name)
        assert inspect.iscoroutinefunction(fn) and list(inspect.signature(fn).parameters) == params, name
