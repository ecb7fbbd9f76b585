"""Before an in-place reload touches the model, every tensor's name, shape and dtype is checked against
the served checkpoint (asyncrl.actors.tensor_specs), on real safetensors files in tmp dirs.

A tensor of another shape would raise inside vLLM's ``load_weights`` after the layerwise reload moved
the layers to meta and earlier layers were replaced: generation would resume on a half-reloaded model.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from asyncrl.actors.nccl_receiver import check_round, expected_names
from asyncrl.actors.tensor_specs import checkpoint_specs, open_checked


def _weights(rows: int = 8, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {
        "model.embed_tokens.weight": torch.zeros(rows, 4, dtype=dtype),
        "model.norm.weight": torch.ones(4, dtype=dtype),
        "model.pos": torch.arange(3, dtype=torch.int64),
    }


def _save(path: Path, tensors: dict[str, torch.Tensor], version: int | None = 3) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", **({"asyncrl_version": str(version)} if version is not None else {})}
    save_file(tensors, str(path), metadata=meta)
    return path


@pytest.fixture
def served(tmp_path: Path) -> Path:
    """The checkpoint the engine was started from: embedding (8, 4), float32; an int64 buffer."""
    _save(tmp_path / "model" / "model.safetensors", _weights(), version=None)
    return tmp_path / "model"


def _open(path: Path, served: Path, version: int = 3) -> dict:
    with ExitStack() as stack:
        return dict(open_checked(path, version, stack, checkpoint_specs(served)))


def test_checkpoint_specs_come_from_the_headers(served: Path) -> None:
    assert checkpoint_specs(served) == {
        "model.embed_tokens.weight": ((8, 4), "float32"),
        "model.norm.weight": ((4,), "float32"),
        "model.pos": ((3,), "int64"),
    }


def test_the_served_shapes_are_accepted(tmp_path: Path, served: Path) -> None:
    f = _save(
        tmp_path / "w" / "v3" / "model.safetensors", {**_weights(), "lm_head.weight": torch.zeros(8, 4)}
    )
    assert set(_open(f, served)) == {*_weights(), "lm_head.weight"}  # a tied head is extra, not checked


def test_a_tensor_of_another_shape_is_refused_before_loading(tmp_path: Path, served: Path) -> None:
    f = _save(tmp_path / "w" / "v3" / "model.safetensors", _weights(rows=9))  # right names and tag
    with pytest.raises(
        ValueError, match=r"model.embed_tokens.weight: \[9, 4\] float32, served \[8, 4\] float32"
    ):
        _open(f, served)


def test_floats_may_come_in_another_float_dtype_other_dtypes_may_not(tmp_path: Path, served: Path) -> None:
    # model.dtype=bfloat16 against a float32 checkpoint: vLLM casts floats on every load, the first included.
    bf16 = {**_weights(dtype=torch.bfloat16), "model.pos": torch.arange(3, dtype=torch.int64)}
    assert set(_open(_save(tmp_path / "a" / "model.safetensors", bf16), served)) == set(_weights())
    ints = {**_weights(), "model.pos": torch.arange(3, dtype=torch.int32)}
    with pytest.raises(ValueError, match=r"model.pos: \[3\] int32, served \[3\] int64"):
        _open(_save(tmp_path / "b" / "model.safetensors", ints), served)


def test_a_name_in_two_shards_is_refused(tmp_path: Path, served: Path) -> None:
    w = _weights()
    d = tmp_path / "w" / "v3"
    _save(d / "model-00001.safetensors", w)
    _save(d / "model-00002.safetensors", {"model.norm.weight": torch.full((4,), 2.0)})
    with pytest.raises(
        ValueError, match=r"'model.norm.weight' is in both model-00001.safetensors and model-00002"
    ):
        _open(d, served)


def test_shards_that_split_the_names_are_accepted(tmp_path: Path, served: Path) -> None:
    w = _weights()
    d = tmp_path / "w" / "v3"
    _save(d / "model-00001.safetensors", {k: w[k] for k in ("model.embed_tokens.weight",)})
    _save(d / "model-00002.safetensors", {k: w[k] for k in ("model.norm.weight", "model.pos")})
    assert set(_open(d, served)) == set(w)


def test_names_and_version_tags_are_still_checked(tmp_path: Path, served: Path) -> None:
    w = _weights()
    with pytest.raises(ValueError, match=r"missing \['model.pos'\]"):
        _open(
            _save(tmp_path / "a" / "m.safetensors", {k: v for k, v in w.items() if k != "model.pos"}), served
        )
    with pytest.raises(ValueError, match="holds version '4', expected 3"):
        _open(_save(tmp_path / "b" / "m.safetensors", w, version=4), served)


def test_the_worker_engine_refuses_a_wrong_shape_before_touching_the_model(
    tmp_path: Path, served: Path
) -> None:
    """The worker's own method, on real files. Its constructor needs a live vLLM worker (VllmConfig,
    device, model); open_checked reads only ``model_config.model``, so the engine is made without it."""
    pytest.importorskip("vllm")
    from asyncrl.actors.worker_ext import FileWeightTransferEngine

    eng = FileWeightTransferEngine.__new__(FileWeightTransferEngine)
    eng.model_config, eng._expected = SimpleNamespace(model=str(served)), None
    f = _save(tmp_path / "w" / "v3" / "model.safetensors", _weights(rows=9))
    with ExitStack() as stack, pytest.raises(ValueError, match="shapes/dtypes do not match"):
        eng.open_checked(str(f), 3, stack)
    d = tmp_path / "w" / "v4"
    _save(d / "a.safetensors", _weights(), version=4)
    _save(d / "b.safetensors", {"model.norm.weight": torch.ones(4)}, version=4)
    with ExitStack() as stack, pytest.raises(ValueError, match="is in both"):
        eng.open_checked(str(d), 4, stack)


def test_an_nccl_round_announcing_another_shape_is_refused(served: Path) -> None:
    specs = expected_names(served)
    w = _weights()
    info = {"names": list(w), "dtype_names": [str(t.dtype).removeprefix("torch.") for t in w.values()],
            "shapes": [list(t.shape) for t in w.values()]}  # fmt: skip
    assert check_round(specs, info) == ""
    info["shapes"][0] = [9, 4]
    assert "model.embed_tokens.weight: [9, 4] float32, served [8, 4] float32" in check_round(specs, info)
    info["shapes"].pop()
    assert "3 names, 3 dtypes and 2 shapes" in check_round(specs, info)
    assert check_round(set(specs), info) == ""  # names only when no specs are known
