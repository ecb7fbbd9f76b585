"""A serve-actors whose pool number passes to another process stops, non-zero, with one clear line.

Its lease is renewed from a thread from the moment it is taken; should it be lost anyway (here: the
key is overwritten with another pool's token), two pools would run the same actor ids. The pool is
kept in its start-up (a placement group asking for a resource no node has), the phase that used to let
the lease lapse: it must not wait out the placement timeout, nor spawn actors under those ids.
"""

from __future__ import annotations

import subprocess
import time
import uuid

import pytest

from asyncrl.buffer import EmbeddedRedis, ReplayBuffer
from tests.e2e.procs import ROOT, asyncrl_cmd, marked_env, wait_for, wait_no_orphans

pytestmark = pytest.mark.slow


def test_serve_actors_exits_when_its_lease_is_taken(tmp_path):
    marker = uuid.uuid4().hex
    name = f"lease-{marker[:8]}"
    log = tmp_path / "actors.log"
    with EmbeddedRedis(tmp_path / "redis") as srv:
        cmd = asyncrl_cmd("serve-actors", "--config", str(ROOT / "configs" / "default.yaml"), f"redis.url={srv.url}",
                          f"run.name={name}", f"run.dir={tmp_path / 'run'}", "ray.num_cpus=1",
                          "actors.resources={no_such_node: 1}")  # fmt: skip
        proc = subprocess.Popen(cmd, env=marked_env(marker), stdout=log.open("wb"), stderr=subprocess.STDOUT)
        try:
            buf = ReplayBuffer.connect(srv.url, name)
            key = buf.keys.pool_lease(0)
            wait_for(lambda: buf.client.get(key), 60, "the pool's lease", proc, log)
            buf.client.set(key, "another-pool", px=600_000)
            t0 = time.monotonic()
            rc = proc.wait(timeout=60)
            out = log.read_text()
            assert rc == 1, out[-3000:]
            assert "asyncrl: error: actor pool 0 lost its Redis lease" in out, out[-3000:]
            assert time.monotonic() - t0 < 30, "waited for the placement group instead of stopping"
            assert buf.client.get(key) == b"another-pool"  # its release left the other's lease alone
            assert not buf.actors()  # no actor ever ran under the shared ids
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert not wait_no_orphans(marker)
