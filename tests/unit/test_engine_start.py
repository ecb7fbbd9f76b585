"""asyncrl.actors.engine_start: what decides whether the standby may run an engine process (the
load-time variables compared, and the ones a spawned engine core is predicted to get). The standby
itself, on real processes: tests/unit/test_engine_standby.py."""

from __future__ import annotations

import os

import pytest

from asyncrl.actors.engine_start import load_time_diff, predicted_env


def test_load_time_diff_compares_load_time_variables_and_existing_search_path_entries(tmp_path):
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "1", "LD_PRELOAD": "/x/libgomp.so.1"}
    assert load_time_diff(base, dict(base)) is None
    assert (
        load_time_diff({**base, "PATH": "/usr/bin", "RAY_ADDRESS": "a"}, base) is None
    )  # read later: restored
    assert "LD_PRELOAD" in load_time_diff({**base, "LD_PRELOAD": ""}, base)
    assert "MALLOC_ARENA_MAX" in load_time_diff({**base, "MALLOC_ARENA_MAX": "2"}, base)
    # An import may prepend a directory that does not exist (opencv's cv2/../../lib64): nothing changes.
    missing, real = str(tmp_path / "nope"), str(tmp_path)
    assert load_time_diff({**base, "LD_LIBRARY_PATH": f"{missing}:"}, base) is None
    assert "LD_LIBRARY_PATH" in load_time_diff({**base, "LD_LIBRARY_PATH": f"{real}:{missing}"}, base)


@pytest.mark.parametrize(("bind", "cpus"), [("0", "0"), ("2", "2"), ("0-2,5", "0 1 2 5"), ("1,3", "1 3")])
def test_predicted_environment_is_vllms_gnu_openmp_binding_with_torchs_libgomp(bind, cpus):
    env = predicted_env(bind)
    torch_lib = os.path.join(os.path.dirname(__import__("importlib").util.find_spec("torch").origin), "lib")
    assert env is not None
    assert env["GOMP_CPU_AFFINITY"] == cpus and env["OMP_NUM_THREADS"] == str(len(cpus.split()))
    assert env["LD_PRELOAD"].split(":")[-1].startswith(os.path.join(torch_lib, "libgomp"))


@pytest.mark.parametrize("bind", [None, "", "auto", "nobind", "0|1", "0,x"])
def test_no_prediction_where_vllm_decides_at_run_time(bind):
    assert predicted_env(bind) is None
    assert predicted_env("0", ld_preload="/opt/intel/libiomp5.so") is None
