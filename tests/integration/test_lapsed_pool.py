"""A serve-actors pool killed for good (kill -9, never restarted) gives its admission slots back.

Before, only an actor starting with the same id, or its own pool's supervisor, reclaimed a dead actor's
in-flight slots: a second pool that died for good kept them taken, and at max_staleness 0 the learner
waited for data forever. Every live pool now runs a :class:`LapsedPoolReclaimer`; here two real
processes stand for pools 1 and 2 (each leases its number, renews it, holds admission slots under its
actor ids), on a real redis-server. Pool 1 is killed with SIGKILL; pool 2 lives on.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from asyncrl.actors.supervision import LapsedPoolReclaimer
from asyncrl.buffer import ReplayBuffer

TTL_S = 1.0
# A pool process: lease the number, admit one slot per actor id, then renew the lease until killed.
POOL = f"""
import sys, time
from asyncrl.buffer import ReplayBuffer
url, run, token, ids = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
buf = ReplayBuffer.connect(url, run)
n = buf.lease_pool(token, ttl_s={TTL_S})
for actor_id in ids:
    assert buf.try_admit(0, 8, owner=actor_id)
print(n, flush=True)
while True:
    buf.renew_pool(n, token, ttl_s={TTL_S})
    time.sleep({TTL_S} / 3)
"""


def _pool(redis_url: str, run: str, token: str, *ids: str) -> tuple[subprocess.Popen, int]:
    p = subprocess.Popen(
        [sys.executable, "-c", POOL, redis_url, run, token, *ids], stdout=subprocess.PIPE, text=True
    )
    return p, int(p.stdout.readline())


def _poll_until_reclaimed(reclaimer: LapsedPoolReclaimer, timeout: float = 15.0) -> list[str]:
    """The live pool's reclaimer polled until it reclaims something (its messages; [] after ``timeout``)."""
    msgs: list[str] = []
    deadline = time.monotonic() + timeout
    while not msgs and time.monotonic() < deadline:
        msgs = reclaimer.poll()
        time.sleep(0.2)
    return msgs


def test_a_pool_killed_for_good_has_its_slots_reclaimed(redis_url, redis_client, run_name) -> None:
    buf = ReplayBuffer(redis_client, run_name)
    assert buf.lease_pool("live-pool-0", ttl_s=60) == 0  # this test is pool 0, the live one
    procs = []
    try:
        dead, n1 = _pool(redis_url, run_name, "pool-a", "actor-1-0", "actor-1-1")
        procs.append(dead)
        live, n2 = _pool(redis_url, run_name, "pool-b", "actor-2-0")
        procs.append(live)
        assert (n1, n2) == (1, 2)
        dead.send_signal(signal.SIGKILL)
        dead.wait()
        reclaimer = LapsedPoolReclaimer(buf, 0, "live-pool-0", ttl_s=TTL_S)
        msgs = _poll_until_reclaimed(reclaimer)
        assert msgs and "actor pool 1" in msgs[0] and "2 admission slots reclaimed" in msgs[0]
        assert buf.stats()["credits"] == 2
        # the live pool 2 keeps its slot (its lease is renewed); the reclaiming lease is gone again
        time.sleep(3 * TTL_S)
        assert reclaimer.poll() == []
        assert buf.inflight_owners() == {"actor-2-0": 1}
        assert redis_client.get(buf.keys.pool_lease(1)) is None
        assert redis_client.get(buf.keys.pool_lease(2)) == b"pool-b"
        # a pool starting afterwards gets the free number 1 back
        assert buf.lease_pool("pool-c", ttl_s=TTL_S) == 1
    finally:
        for p in procs:
            p.kill()
            p.wait()
        buf.delete_run()


# A pool that is only frozen: lease the number, admit two slots for actor-1-0, renew from a thread;
# once told "go" (after SIGSTOP .. SIGCONT), write one group and give the other slot back (an abort).
FROZEN = f"""
import sys, threading, time
sys.path.insert(0, sys.argv[4])
from asyncrl.buffer import ReplayBuffer
from tests.conftest import small_group
url, run, token = sys.argv[1:4]
buf = ReplayBuffer.connect(url, run)
n = buf.lease_pool(token, ttl_s={TTL_S})
assert buf.try_admit(0, 8, owner="actor-1-0") and buf.try_admit(0, 8, owner="actor-1-0")
def keep():
    while True:
        buf.renew_pool(n, token, ttl_s={TTL_S})
        time.sleep({TTL_S} / 3)
threading.Thread(target=keep, daemon=True).start()
print(n, flush=True)
assert sys.stdin.readline().strip() == "go"
buf.put(small_group(group_id="late-group"), owner="actor-1-0")
buf.credit(1, owner="actor-1-0", request_id="late-abort")
print("done", flush=True)
time.sleep(60)
"""


def test_a_frozen_pool_reclaimed_then_resumed_counts_each_slot_once(
    redis_url, redis_client, run_name
) -> None:
    """SIGSTOP a pool past two lease periods: the live pool reclaims its two slots (two credits). On
    SIGCONT it writes one of the groups and aborts the other; each slot must count once. Before the
    fence both were counted again (credits 2 -> 3 with the group also in the stream, the in-flight tally
    at -2): the admission window stayed wider than max_staleness allows for good."""
    buf = ReplayBuffer(redis_client, run_name)
    assert buf.lease_pool("live-pool-0", ttl_s=60) == 0
    root = str(Path(__file__).resolve().parents[2])
    frozen = subprocess.Popen([sys.executable, "-c", FROZEN, redis_url, run_name, "pool-f", root],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert int(frozen.stdout.readline()) == 1
        frozen.send_signal(signal.SIGSTOP)
        reclaimer = LapsedPoolReclaimer(buf, 0, "live-pool-0", ttl_s=TTL_S)
        msgs = _poll_until_reclaimed(reclaimer)
        assert msgs and "2 admission slots reclaimed" in msgs[0]
        assert buf.stats()["credits"] == 2
        frozen.send_signal(signal.SIGCONT)
        frozen.stdin.write("go\n")
        frozen.stdin.flush()
        assert frozen.stdout.readline().strip() == "done"
        st = buf.stats()
        # The ledger: 2 admitted = 1 credit (the aborted slot) + 1 group in the stream, nothing in flight.
        assert (st["admitted"], st["credits"], st["depth"]) == (2, 1, 1)
        assert buf.inflight_owners().get("actor-1-0", 0) == 0
        # and the window is what the bound allows: (0 + 0 + 1) * 8 + 1 credit - 2 admitted = 7 slots
        assert sum(buf.try_admit(0, 8, owner="actor-0") for _ in range(12)) == 7
    finally:
        frozen.kill()
        frozen.wait()
        buf.delete_run()
