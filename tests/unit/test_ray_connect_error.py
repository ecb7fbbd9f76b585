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
