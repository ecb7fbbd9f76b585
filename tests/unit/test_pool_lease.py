"""An actor pool's lease (``pool:<n>``) is renewed and released only while it is that pool's own, on a
real redis-server: the compare and the change are one script, so a lease that passes to another pool
between the two can be neither extended nor deleted by the pool that lost it."""

from __future__ import annotations

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
