"""`asyncrl run` keeps the Redis password off argv and out of world-readable files."""

from __future__ import annotations

import stat
import urllib.parse

from asyncrl.buffer.embedded import EmbeddedRedis
from asyncrl.config import Config, from_yaml, to_yaml
from asyncrl.launch import redact_url, redacted, write_private
from asyncrl.orchestrator import has_prior_run


def test_redact_url_drops_only_the_password() -> None:
    assert redact_url("redis://:s3cr%2Ft@10.0.0.1:6379/0") == "redis://10.0.0.1:6379/0"
    assert redact_url("rediss://alice:pw@h:6380/2") == "rediss://alice@h:6380/2"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"
    assert redact_url("") == ""


def test_config_yaml_of_a_run_holds_no_secret() -> None:
    cfg = Config()
    cfg.redis.password = "hunter2-xyz"
    cfg.redis.url = "redis://bob:hunter2-xyz@h:1/0"
    text = to_yaml(redacted(cfg))
    assert "hunter2-xyz" not in text
    back = from_yaml(text)
    assert back.redis.password == "" and back.redis.url == "redis://bob@h:1/0"
    assert cfg.redis.password == "hunter2-xyz"  # the live config keeps it


def test_private_file_is_0600(tmp_path) -> None:
    p = tmp_path / "redis.url"
    write_private(p, "redis://:pw@127.0.0.1:1/0")
    assert stat.S_IMODE(p.stat().st_mode) == 0o600 and p.read_text().endswith("/0")
    assert not list(tmp_path.glob("*.tmp"))


def test_embedded_url_encodes_the_password() -> None:
    srv = EmbeddedRedis("/nonexistent", port=6399, password="a b/c@d:e")
    url = srv.url
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname == "127.0.0.1" and parts.port == 6399
    assert urllib.parse.unquote(parts.password) == "a b/c@d:e"


def test_prior_run_is_detected_from_its_state(tmp_path) -> None:
    assert not has_prior_run(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    assert not has_prior_run(tmp_path)  # empty dir: nothing to resume
    (tmp_path / "redis").mkdir()
    (tmp_path / "redis" / "appendonlydir").mkdir()
    assert has_prior_run(tmp_path)
