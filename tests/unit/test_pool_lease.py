"""An actor pool's lease (``pool:<n>``) is renewed and released only while it is that pool's own, on a
real redis-server: the compare and the change are one script, so a lease that passes to another pool
between the two can be neither extended nor deleted by the pool that lost it."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from asyncrl.buffer import ReplayBuffer

OTHER_TTL_MS = 60_000


class _LeasePassesAfterFirstLook(redis.Redis):
    """A real client of the buffer under test. Right after its first command on the lease key, the
    lease passes to pool "proc-b" (as if it expired that instant and proc-b leased the number): the
    moment a GET-then-PEXPIRE/DEL renew or release would act on a lease it no longer holds."""

    lease_key = ""
    other: redis.Redis | None = None

    def execute_command(self, *args, **options):
        out = super().execute_command(*args, **options)
        keys = {a.decode() if isinstance(a, bytes) else str(a) for a in args[1:]}
        if self.other is not None and self.lease_key in keys:
            other, self.other = self.other, None  # once
            other.set(self.lease_key, "proc-b", px=OTHER_TTL_MS)
        return out


def _buffer(redis_client: redis.Redis, run_name: str) -> tuple[ReplayBuffer, _LeasePassesAfterFirstLook]:
    client = _LeasePassesAfterFirstLook(connection_pool=redis_client.connection_pool)
    buf = ReplayBuffer(client, run_name)
    client.lease_key = buf.keys.pool_lease(0)
    return buf, client


def test_renew_never_extends_a_lease_another_pool_took(redis_client: redis.Redis, run_name: str) -> None:
    buf, client = _buffer(redis_client, run_name)
    try:
        assert buf.lease_pool("proc-a", ttl_s=5.0) == 0
        client.other = redis_client  # armed: the lease passes to proc-b after proc-a's next command on it
        buf.renew_pool(0, "proc-a", ttl_s=1.0)
        # proc-b's lease keeps its own expiry (a pexpire of proc-a's 1 s would have cut it short)
        assert redis_client.get(client.lease_key) == b"proc-b"
        assert redis_client.pttl(client.lease_key) > OTHER_TTL_MS - 10_000
        assert not buf.renew_pool(0, "proc-a", ttl_s=1.0)  # and proc-a knows it lost the number
    finally:
        buf.delete_run()


def test_release_never_deletes_a_lease_another_pool_took(redis_client: redis.Redis, run_name: str) -> None:
    buf, client = _buffer(redis_client, run_name)
    try:
        assert buf.lease_pool("proc-a", ttl_s=5.0) == 0
        client.other = redis_client
        buf.release_pool(0, "proc-a")
        assert redis_client.get(client.lease_key) == b"proc-b"
    finally:
        buf.delete_run()


def test_renew_and_release_of_the_own_lease(redis_client: redis.Redis, run_name: str) -> None:
    buf = ReplayBuffer(redis_client, run_name)
    key = buf.keys.pool_lease(0)
    try:
        assert buf.lease_pool("proc-a", ttl_s=1.0) == 0
        assert buf.renew_pool(0, "proc-a", ttl_s=30.0) and redis_client.pttl(key) > 20_000
        assert not buf.renew_pool(0, "proc-x", ttl_s=30.0)  # held by proc-a
        redis_client.delete(key)  # expired, nobody took it: renewing takes it back
        assert buf.renew_pool(0, "proc-a", ttl_s=30.0) and redis_client.get(key) == b"proc-a"
        buf.release_pool(0, "proc-x")
        assert redis_client.get(key) == b"proc-a"
        buf.release_pool(0, "proc-a")
        assert redis_client.get(key) is None
    finally:
        buf.delete_run()


# ---------------------------------------------------------------- the pool's lease keeper (serve-actors)

KEEPER_TTL_S = 1.5  # the keeper renews every TTL/3: short, so the tests wait a few seconds, not 15 s


def _keeper(monkeypatch, redis_url: str, run_name: str, **kw):
    from asyncrl.actors.serve import PoolLease
    from asyncrl.config import load_config

    monkeypatch.setattr(PoolLease, "TTL_S", KEEPER_TTL_S)
    cfg = load_config(None, [f"redis.url={redis_url}", f"run.name={run_name}"])
    return PoolLease(cfg, redis_url, None, **kw), cfg


def test_lease_is_kept_while_the_pool_is_busy_starting(
    monkeypatch, redis_url, redis_client, run_name
) -> None:
    """serve-actors leases its number, then starts the pool (Ray, the model, a placement group: minutes)
    without calling anything on the lease. It must still hold the number afterwards; a lapsed lease
    hands it to the next pool, and the two run the same actor ids."""
    lease, cfg = _keeper(monkeypatch, redis_url, run_name)
    key = ReplayBuffer(redis_client, run_name).keys.pool_lease(lease.n)
    try:
        assert cfg.actors.pool_index == lease.n == 0
        time.sleep(3 * KEEPER_TTL_S)  # "pool.start()": nobody renews by hand
        assert redis_client.get(key) == lease.token.encode()
        lease.check()  # not lost
    finally:
        lease.release()
        ReplayBuffer(redis_client, run_name).delete_run()
    assert redis_client.get(key) is None


def test_a_lost_lease_stops_the_pool(monkeypatch, redis_url, redis_client, run_name) -> None:
    """Another process holds the number (this one's lease lapsed and was taken): the keeper calls
    on_lost (serve-actors: the stop event), check() raises, and release leaves the other's lease alone."""
    from asyncrl.actors.supervision import PoolLeaseLost

    stopped = threading.Event()
    lease, _ = _keeper(monkeypatch, redis_url, run_name, on_lost=stopped.set)
    key = ReplayBuffer(redis_client, run_name).keys.pool_lease(lease.n)
    try:
        redis_client.set(key, "other-pool", px=60_000)
        assert stopped.wait(3 * KEEPER_TTL_S)
        with pytest.raises(PoolLeaseLost, match="lost its Redis lease"):
            lease.check()
        lease.release()
        assert redis_client.get(key) == b"other-pool"
    finally:
        ReplayBuffer(redis_client, run_name).delete_run()
