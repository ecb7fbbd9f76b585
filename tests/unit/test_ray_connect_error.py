"""Ray refusing the connection (token auth on a `ray start --head` cluster, the default when
~/.ray/auth_token exists) is reported as one `asyncrl: error:` line that names the fix."""

from __future__ import annotations

import pytest

from asyncrl import cli
from asyncrl.actors.supervision import RayConnectError


def test_auth_error_message_names_the_token_mode() -> None:
    ray = pytest.importorskip("ray")
    from asyncrl.actors.pool import ray_connect_message

    e = ray.exceptions.AuthenticationError("Authentication failed: missing token\nmore detail")
    msg = ray_connect_message("10.0.0.1:6379", e)
    assert "\n" not in msg
    assert "10.0.0.1:6379" in msg and "AuthenticationError" in msg
    assert "RAY_AUTH_MODE=token" in msg and "auth_token" in msg
    assert RayConnectError in cli.ROLE_ERRORS  # printed as `asyncrl: error: ...`, exit 1, no traceback


def test_messages_name_ray_address_from_the_environment_when_the_key_is_empty(monkeypatch) -> None:
    """ray.init reaches for RAY_ADDRESS when ray.address is empty: the timeout and connect errors named
    'the local Ray' / 'a new local cluster' instead, sending the user to the wrong logs."""
    from asyncrl.actors.ray_setup import ray_connect_message, ray_start_timeout_message

    monkeypatch.setenv("RAY_ADDRESS", "10.1.2.3:6379")
    msg = ray_start_timeout_message("", 120)
    assert (
        "RAY_ADDRESS=10.1.2.3:6379" in msg and "unset RAY_ADDRESS" in msg and "local Ray did not" not in msg
    )
    assert "10.1.2.3:6379 (RAY_ADDRESS" in ray_connect_message(None, ConnectionError("refused"))
    # The key wins over the environment, as in ray.init.
    msg = ray_start_timeout_message("10.9.9.9:6379", 120)
    assert "ray.address=10.9.9.9:6379" in msg and "set ray.address= (empty)" in msg
    monkeypatch.delenv("RAY_ADDRESS")
    assert "the local Ray did not come up" in ray_start_timeout_message("", 120)
    assert "a new local cluster" in ray_connect_message("", ConnectionError("refused"))
