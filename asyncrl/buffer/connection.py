"""Building redis-py connection options (AUTH, TLS) from asyncrl's settings."""

from __future__ import annotations

from typing import Any

__all__ = ["redis_options"]


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
) -> tuple[str, dict[str, Any]]:
    """(url, keyword arguments) for ``redis.Redis.from_url``; ``tls`` upgrades the scheme."""
    opts: dict[str, Any] = {"socket_timeout": socket_timeout, "socket_keepalive": True, **extra}
    if password is not None:
        opts["password"] = password
    if username is not None:
        opts["username"] = username
    if tls and url.startswith("redis://"):
        url = "rediss://" + url[len("redis://") :]
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"redis url must start with redis://, rediss:// or unix://, got {url!r}")
    if tls and not url.startswith("rediss://"):
        raise ValueError(f"tls=True needs a redis:// or rediss:// url, got {url!r}")
    if (tls_ca or tls_cert or tls_key) and not url.startswith("rediss://"):
        raise ValueError("tls_ca/tls_cert/tls_key need tls=True or a rediss:// url")
    if url.startswith("rediss://"):
        if tls_ca:
            opts["ssl_ca_certs"] = tls_ca
        if tls_cert:
            opts["ssl_certfile"] = tls_cert
        if tls_key:
            opts["ssl_keyfile"] = tls_key
    return url, opts
