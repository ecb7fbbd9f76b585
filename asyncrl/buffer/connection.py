"""Redis connections of every role: AUTH/TLS options and the retry policy that rides out outages.

Outage policy (issue 12): a Redis that is unreachable (restarting, network cut) or frozen (SIGSTOP,
a long fork) must cost a role time, never its process. Every client built here therefore gets

* ``socket_connect_timeout`` and ``socket_timeout``: a frozen server accepts TCP connections (the
  kernel does) but never answers; without a timeout a command would wait forever;
* :class:`DeadlineRetry`: redis-py's ``Retry`` with ``ExponentialWithJitterBackoff`` (bounded cap),
  retrying ``ConnectionError``/``TimeoutError`` until a time budget (``redis.retry_budget_s``,
  default 120 s) has passed since the first failure, instead of a fixed try count (redis-py's
  default gives up after ~10 tries in a couple of seconds);
* ``health_check_interval``: an idle pooled connection is PINGed before reuse, so a connection the
  restarted server dropped is replaced before a command is sent on it;
* one log line when Redis goes away and one when it is back (:class:`OutageMonitor`, shared by all
  connections of a client), never one per retry.

A retried *write* may run twice: when the server executed it but the reply was lost (connection cut
after the write, or a frozen server that processes the request after the client timed out and
resent it). Every non-idempotent write of the buffer is therefore made idempotent at the server
(request-id dedup keys, or credits counted from what XACK actually acknowledged); see
``admission.py`` and ``replay.py``.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from redis.backoff import AbstractBackoff, ExponentialWithJitterBackoff
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    ConnectionError,
    ExternalAuthProviderError,
    TimeoutError,
)
from redis.retry import Retry

__all__ = [
    "DEFAULT_RETRY_BUDGET_S",
    "DEFAULT_SOCKET_TIMEOUT_S",
    "DEFAULT_CONNECT_TIMEOUT_S",
    "BACKOFF_BASE_S",
    "BACKOFF_CAP_S",
    "HEALTH_CHECK_INTERVAL_S",
    "OutageMonitor",
    "DeadlineRetry",
    "redis_options",
    "url_with_auth",
]

log = logging.getLogger(__name__)

#: Seconds of retrying before a command gives up. >= 60 s rides out a Redis restart or a minute-long freeze.
DEFAULT_RETRY_BUDGET_S = 120.0
DEFAULT_SOCKET_TIMEOUT_S = 10.0
DEFAULT_CONNECT_TIMEOUT_S = 5.0
#: Backoff between tries: uniform in [0, min(cap, base * 2**failures)] (full jitter).
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 2.0
HEALTH_CHECK_INTERVAL_S = 15

# The first failure time of the outermost retry running on this thread (see DeadlineRetry).
_clock = threading.local()

RETRY_ERRORS: tuple[type[Exception], ...] = (ConnectionError, TimeoutError, socket.timeout)
#: ConnectionError subclasses that no amount of waiting fixes (wrong password, ACL): fail at once.
NEVER_RETRY: tuple[type[Exception], ...] = (
    AuthenticationError,
    AuthorizationError,
    ExternalAuthProviderError,
)


class OutageMonitor:
    """Logs 'Redis unreachable' once when the first command fails and 'Redis is back' once when one
    succeeds again. Shared by every connection of a client (``copy.deepcopy`` returns the same one,
    because redis-py deep-copies the retry object into each connection). Thread-safe."""

    def __init__(self, where: str, budget_s: float) -> None:
        self.where = where
        self.budget_s = budget_s
        self.down_since: float | None = None
        self.outages = 0  # completed or ongoing outages seen by this client
        self._lock = threading.Lock()

    def __deepcopy__(self, memo: dict) -> OutageMonitor:
        return self

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def failed(self, error: BaseException) -> None:
        with self._lock:
            if self.down_since is not None:
                return
            self.down_since = time.monotonic()
            self.outages += 1
        log.warning(
            "Redis at %s unreachable (%s: %s); retrying with backoff for up to %.0f s",
            self.where, type(error).__name__, error, self.budget_s,
        )  # fmt: skip

    def succeeded(self) -> None:
        with self._lock:
            if self.down_since is None:
                return
            since, self.down_since = self.down_since, None
        log.warning("Redis at %s is back after %.1f s", self.where, time.monotonic() - since)

    def gave_up(self, error: BaseException, elapsed: float) -> None:
        log.error(
            "Redis at %s still unreachable after %.0f s (%s): giving up on this command",
            self.where, elapsed, error,
        )  # fmt: skip


class _DeadlineBackoff(AbstractBackoff):
    """A backoff that never sleeps past the retry budget of the outermost retry on this thread: the
    last try comes at the deadline, not up to one backoff cap (2 s) after it."""

    def __init__(self, inner: AbstractBackoff, budget_s: float) -> None:
        self.inner = inner
        self.budget_s = budget_s

    def reset(self) -> None:
        self.inner.reset()

    def compute(self, failures: int) -> float:
        wait = self.inner.compute(failures)
        first = getattr(_clock, "first_failure", None)
        if first:
            wait = min(wait, max(self.budget_s - (time.monotonic() - first[0]), 0.0))
        return wait


class DeadlineRetry(Retry):
    """redis-py ``Retry`` that retries for a time budget (since the first failure) rather than a count.

    It reuses redis-py's retry loop and backoff: ``retries=-1`` (unbounded) and the failure callback
    raises once the budget is spent. redis-py nests retries (a command's retry around its reconnect's
    retry): nested calls on one thread share the outermost call's clock, so a command gives up after
    one budget, not one per nesting level.
    """

    def __init__(
        self,
        budget_s: float = DEFAULT_RETRY_BUDGET_S,
        *,
        base_s: float = BACKOFF_BASE_S,
        cap_s: float = BACKOFF_CAP_S,
        monitor: OutageMonitor | None = None,
    ) -> None:
        if budget_s <= 0 or cap_s <= 0 or base_s <= 0:
            raise ValueError("retry budget, backoff base and cap must be > 0")
        backoff = _DeadlineBackoff(ExponentialWithJitterBackoff(cap=cap_s, base=base_s), float(budget_s))
        super().__init__(backoff, -1, RETRY_ERRORS)
        self.budget_s = float(budget_s)
        self.monitor = monitor or OutageMonitor("?", budget_s)

    def call_with_retry(
        self,
        do: Callable[[], Any],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> Any:
        outer = getattr(_clock, "first_failure", None)
        first_failure: list[float] = outer if outer is not None else []
        if outer is None:
            _clock.first_failure = first_failure

        def _do() -> Any:
            result = do()
            # Only a whole command counts as "back": an inner reconnect also succeeds against a frozen
            # server (the kernel accepts the TCP connection).
            if outer is None and self.monitor.down:
                self.monitor.succeeded()
            return result

        def _fail(error: Exception, *count: int) -> None:
            fail(error, *count)
            if isinstance(error, NEVER_RETRY):
                raise error
            now = time.monotonic()
            if not first_failure:
                first_failure.append(now)
                self.monitor.failed(error)
            elif now - first_failure[0] >= self.budget_s:
                self.monitor.gave_up(error, now - first_failure[0])
                raise error

        try:
            return super().call_with_retry(_do, _fail, is_retryable, with_failure_count)
        finally:
            if outer is None:
                _clock.first_failure = None


def url_with_auth(scheme_host_port_db: str, password: str | None, username: str | None = None) -> str:
    """``redis://[user:password@]host...`` with the credentials percent-encoded (a password holding
    ``@``, ``:`` or ``/`` would otherwise be parsed as part of the host); redis-py unquotes them."""
    if not password and not username:
        return scheme_host_port_db
    scheme, rest = scheme_host_port_db.split("://", 1)
    user = quote(username or "", safe="")
    auth = f"{user}:{quote(password or '', safe='')}@"
    return f"{scheme}://{auth}{rest}"


def redis_options(
    url: str,
    password: str | None,
    username: str | None,
    tls: bool,
    tls_ca: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    socket_timeout: float | None,
    extra: dict[str, Any],
    *,
    retry_budget_s: float = DEFAULT_RETRY_BUDGET_S,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
) -> tuple[str, dict[str, Any]]:
    """(url, keyword arguments) for ``redis.Redis.from_url``; ``tls`` upgrades the scheme.

    ``socket_timeout`` None means :data:`DEFAULT_SOCKET_TIMEOUT_S` (never "wait forever": a frozen
    server would hang the role). ``extra`` overrides anything, including ``retry``.
    """
    if tls and url.startswith("redis://"):
        url = "rediss://" + url[len("redis://") :]
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"redis url must start with redis://, rediss:// or unix://, got {url!r}")
    if tls and not url.startswith("rediss://"):
        raise ValueError(f"tls=True needs a redis:// or rediss:// url, got {url!r}")
    if (tls_ca or tls_cert or tls_key) and not url.startswith("rediss://"):
        raise ValueError("tls_ca/tls_cert/tls_key need tls=True or a rediss:// url")
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("a TLS client certificate needs both tls_cert and tls_key")
    where = url.split("@", 1)[-1].split("://", 1)[-1]  # host:port/db, never the credentials
    opts: dict[str, Any] = {
        "socket_timeout": DEFAULT_SOCKET_TIMEOUT_S if socket_timeout is None else socket_timeout,
        "socket_connect_timeout": connect_timeout,
        "socket_keepalive": True,
        "health_check_interval": HEALTH_CHECK_INTERVAL_S,
        "retry": DeadlineRetry(retry_budget_s, monitor=OutageMonitor(where, retry_budget_s)),
        # Also makes PubSub reconnect (and resubscribe) instead of raising on the first error.
        "retry_on_error": list(RETRY_ERRORS),
        **extra,
    }
    if password is not None:
        opts["password"] = password
    if username is not None:
        opts["username"] = username
    if url.startswith("rediss://"):
        if tls_ca:
            opts["ssl_ca_certs"] = tls_ca
        if tls_cert:
            opts["ssl_certfile"] = tls_cert
        if tls_key:
            opts["ssl_keyfile"] = tls_key
    return url, opts
