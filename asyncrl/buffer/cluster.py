"""Redis Cluster: the ``redis+cluster://`` URL scheme and the client it selects.

    redis.url=redis+cluster://10.0.0.5:7000/0      # any node of the cluster; rediss+cluster:// for TLS

Why it works unchanged: every key of a run carries the hash tag ``{run}`` (layout.py), so the whole
run lives in one slot, on one master. The admission and put scripts, the MULTI blocks and the
consumer-group reads therefore stay single-node operations: redis-py's :class:`RedisCluster` routes
each of them to the master that owns the slot, follows MOVED/ASK redirections, and refreshes its map
of the cluster when a node goes away. A run is as available as that one master (and its replicas).

Outages: the cluster client gets the same :class:`asyncrl.buffer.connection.DeadlineRetry` as a
single-server client, as its cluster-level retry (redis-py re-reads the topology between tries), so a
master that is killed and restarted on its data dir costs the roles time, not their processes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from redis.cluster import RedisCluster
from redis.exceptions import (
    ClusterDownError,
    ClusterError,
    ConnectionError,
    SlotNotCoveredError,
    TimeoutError,
)
from redis.retry import Retry

__all__ = ["CLUSTER_SCHEMES", "split_cluster_url", "cluster_client", "connection_kwargs"]

#: URL scheme selecting a Redis Cluster client -> the plain scheme redis-py parses.
CLUSTER_SCHEMES = {"redis+cluster://": "redis://", "rediss+cluster://": "rediss://"}

# Keyword arguments of a single-server client that RedisCluster does not take (it keeps its own
# health checks per node connection and retries at the cluster level).
_NOT_FOR_CLUSTER = ("health_check_interval", "retry_on_error", "db")


def _NoBackoff() -> Any:  # noqa: N802 - reads as the class it returns
    from redis.backoff import NoBackoff

    return NoBackoff()


def split_cluster_url(url: str) -> tuple[bool, str]:
    """(is a cluster URL, the URL with a plain redis:// / rediss:// scheme)."""
    for scheme, plain in CLUSTER_SCHEMES.items():
        if url.startswith(scheme):
            return True, plain + url[len(scheme) :]
    return False, url


#: Errors of a cluster in motion (a master down or restarting, slots briefly uncovered).
CLUSTER_RETRY_ERRORS = (ConnectionError, TimeoutError, ClusterDownError, SlotNotCoveredError, ClusterError)


class BudgetedCluster(RedisCluster):
    """RedisCluster whose commands (and transactions) retry over a time budget.

    redis-py's cluster client retries a failed command a fixed number of times, re-reading the
    topology in between, with no pause: a master that takes seconds to come back exhausts it at once.
    Here the whole routed command runs under ``budget`` (a :class:`DeadlineRetry`: exponential backoff
    with jitter until its time budget is spent), so each try re-resolves the slot's master.
    """

    budget: Retry | None = None

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        if self.budget is None:
            return super().execute_command(*args, **kwargs)
        return self.budget.call_with_retry(lambda: super(BudgetedCluster, self).execute_command(*args, **kwargs),
                                           _reset_topology(self))  # fmt: skip

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> Any:
        pipe = super().pipeline(transaction=transaction, shard_hint=shard_hint)
        if self.budget is not None:
            execute, budget = pipe.execute, self.budget

            def run(raise_on_error: bool = True) -> Any:
                # A transaction either ran or did not (MULTI/EXEC); redis-py resends the queued commands.
                return budget.call_with_retry(lambda: execute(raise_on_error), _reset_topology(self))

            pipe.execute = run
        return pipe


def _reset_topology(client: RedisCluster) -> Callable[[Exception], None]:
    def fail(_error: Exception) -> None:
        try:
            client.nodes_manager.initialize()
        except Exception:  # the cluster is still moving: the next try re-reads it again
            pass

    return fail


def cluster_client(url: str, opts: dict[str, Any]) -> Any:
    """A :class:`BudgetedCluster` on ``url`` (plain scheme) with ``redis_options`` options.

    The URL's database must be 0 (a cluster has only one). ``opts["retry"]`` (a DeadlineRetry)
    becomes the budget around each routed command.
    """
    path = url.split("://", 1)[1].split("?", 1)[0]
    db = path.split("/", 1)[1] if "/" in path else ""
    if db not in ("", "0"):
        raise ValueError(f"a Redis Cluster has only database 0; got {url.split('@')[-1]!r}")
    kwargs = {k: v for k, v in opts.items() if k not in _NOT_FOR_CLUSTER and k != "retry"}
    budget = opts.get("retry")
    if budget is not None:
        budget.update_supported_errors(list(CLUSTER_RETRY_ERRORS))
    # The cluster's own loop: a few immediate re-routes (MOVED after a topology change).
    client = BudgetedCluster.from_url(url, retry=Retry(_NoBackoff(), 3), **kwargs)
    client.budget = budget
    return client


def connection_kwargs(client: Any) -> dict[str, Any]:
    """The per-connection settings (socket_timeout, decode_responses, ...) of a single-server or a
    cluster client."""
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        return dict(pool.connection_kwargs)
    return dict(client.get_connection_kwargs())
