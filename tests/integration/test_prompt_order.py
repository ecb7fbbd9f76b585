"""The run's one prompt order (real redis-server): every actor of every pool claims its next prompt
position atomically, so no position (hence no prompt of an epoch, no sampling seed) is served twice.

Before, each actor served its own shard of each epoch by its index among ``actors.num_actors``, with
a cursor saved in its heartbeat: two ``serve-actors`` pools of one run used the same shards and seeds
(every prompt generated once per pool, with identical samples), and a resume with another
``actors.num_actors`` re-served an epoch already trained (new actor ids started at the epoch's start)
and skipped part of the next (old cursors read in other shards)."""

from __future__ import annotations

import threading
from collections import Counter

from asyncrl.actors.seeding import request_seed
from asyncrl.buffer import ReplayBuffer
from asyncrl.tasks import Prompt, PromptSource


def test_concurrent_claims_from_several_clients_are_unique_and_gapless(redis_url, run_name) -> None:
    clients = [ReplayBuffer.connect(redis_url, run_name) for _ in range(3)]
    got: list[list[int]] = [[] for _ in range(6)]

    def claim(i: int) -> None:
        for _ in range(150):
            got[i].append(clients[i % 3].claim_prompt_seq())

    try:
        threads = [threading.Thread(target=claim, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        flat = sorted(q for g in got for q in g)
        assert flat == list(range(900))
        assert all(g == sorted(g) for g in got)  # each claimant's own positions rise
        assert clients[0].prompts_claimed() == 900
        # A restarted actor (a new client) goes on from the run's position, not from 0.
        fresh = ReplayBuffer.connect(redis_url, run_name)
        assert fresh.claim_prompt_seq() == 900
        fresh.delete_run()
        assert fresh.prompts_claimed() == 0
        fresh.close()
    finally:
        for c in clients:
            c.close()


def test_two_pools_and_a_changed_actor_count_serve_each_prompt_once_per_epoch(redis_url, run_name) -> None:
    """Actors as group workers use them (claim, then PromptSource.at and the seed of the position): two
    pools of 3 and 2 actors, then a "resume" with 4 actors, over 5 epochs of 11 prompts."""
    prompts = [Prompt(str(i), f"t{i}") for i in range(11)]
    lock = threading.Lock()
    served: list[tuple[int, str, int]] = []  # (position, prompt id, seed)

    def actor(n_groups: int) -> None:
        buf = ReplayBuffer.connect(redis_url, run_name)
        src = PromptSource(prompts, seed=7)
        try:
            for _ in range(n_groups):
                seq = buf.claim_prompt_seq()
                with lock:
                    served.append((seq, src.at(seq).prompt_id, request_seed(7, 0, seq)))
        finally:
            buf.close()

    for counts in ([5, 5, 5, 6, 6], [7, 7, 7, 7]):  # pools 0 (3) and 1 (2); then 4 actors
        threads = [threading.Thread(target=actor, args=(n,)) for n in counts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sorted(s[0] for s in served) == list(range(55))
    assert len({s[2] for s in served}) == 55  # no two groups share a sampling seed
    by_epoch = Counter((q // 11, pid) for q, pid, _ in served)
    assert set(by_epoch.values()) == {1} and len(by_epoch) == 55  # each prompt once in each epoch
    reference = PromptSource(prompts, seed=7).take(55)  # the synchronous reference loop's order
    assert [pid for _, pid, _ in sorted(served)] == [p.prompt_id for p in reference]
