"""`asyncrl export`: published weights (manifest-checked) or a learner checkpoint -> a loadable HF model dir.

Built from a hand-made run dir (tiny model, a published version, a checkpoint-shaped version), no engines.
The whole path (a real run, vLLM loading the export, `asyncrl eval`) is tests/e2e/test_custom_task.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from asyncrl.buffer.weights import MANIFEST_FILENAME, build_manifest
from asyncrl.cli import main
from asyncrl.config import Config, to_yaml
from asyncrl.export import available_versions, export_version
from asyncrl.tinymodel import build_tiny_model


def _perturbed(sd: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: (v + 0.05 * torch.randn(v.shape, generator=g)).contiguous() for k, v in sd.items()}


@pytest.fixture
def run_dir(tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    cfg = Config()
    cfg.run.name = "exp"
    rdir = tmp_path / "run"
    rdir.mkdir()
    (rdir / "config.yaml").write_text(to_yaml(cfg))
    base = build_tiny_model(rdir / "model", cfg.model.tiny, cfg.run.seed)
    sd = AutoModelForCausalLM.from_pretrained(base).state_dict()
    v3 = rdir / "weights" / "v3"
    v3.mkdir(parents=True)
    save_file(
        _perturbed(sd, 3), str(v3 / "model.safetensors"), metadata={"format": "pt", "asyncrl_version": "3"}
    )
    (v3 / MANIFEST_FILENAME).write_bytes(build_manifest(3, v3 / "model.safetensors", "float32").to_bytes())
    tag = rdir / "checkpoints" / "step00000005"
    tag.mkdir(parents=True)
    torch.save({"module": _perturbed(sd, 5)}, tag / "mp_rank_00_model_states.pt")
    (tag / "learner_state.json").write_text(json.dumps({"step": 5, "version": 5}))
    return rdir, sd


def _logprobs(model_dir, ids):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return torch.log_softmax(m(torch.tensor([ids])).logits[0], -1)


def test_export_each_source_loads_with_its_weights(run_dir, tmp_path):
    rdir, sd = run_dir
    assert available_versions(rdir) == [3, 5]
    ids = [3, 10, 20, 30, 1]
    for v in (3, 5):
        out = export_version(rdir, tmp_path / f"out{v}", v)
        names = {p.name for p in out.iterdir()}
        assert {"config.json", "tokenizer.json", "model.safetensors", "generation_config.json",
                "asyncrl_config.yaml", "asyncrl_export.json"} <= names  # fmt: skip
        info = json.loads((out / "asyncrl_export.json").read_text())
        assert info["version"] == v and info["source"] == ("published" if v == 3 else "checkpoint")
        gen = json.loads((out / "generation_config.json").read_text())
        assert gen["eos_token_id"] == 1  # the base model's generation config (the tiny model's has one)
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
        want = _perturbed(sd, v)
        assert all(torch.equal(loaded[k], want[k]) for k in want)
    assert not torch.equal(_logprobs(tmp_path / "out3", ids), _logprobs(tmp_path / "out5", ids))


def test_export_refuses_bad_requests(run_dir, tmp_path, capsys):
    rdir, _ = run_dir
    assert main(["export", str(rdir), str(tmp_path / "o"), "--version", "4"]) == 2
    err = capsys.readouterr().err
    assert "version 4 is not on disk" in err and "available: 3, 5" in err
    assert main(["export", str(rdir), str(tmp_path / "o")]) == 0  # newest: 5
    assert json.loads((tmp_path / "o" / "asyncrl_export.json").read_text())["version"] == 5
    assert main(["export", str(rdir), str(tmp_path / "o")]) == 2  # not over an existing export
    # tampered published weights are refused (the manifest's sha256)
    f = rdir / "weights" / "v3" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(Exception, match="sha256|digest|mismatch"):
        export_version(rdir, tmp_path / "t", 3)
    assert not (tmp_path / "t").exists() and not list(tmp_path.glob(".t.tmp-*"))


def test_eval_of_a_missing_version_fails_before_starting_an_engine(run_dir, capsys):
    rdir, _ = run_dir
    assert main(["eval", str(rdir), "--version", "9"]) == 2
    assert "version 9 is not on disk" in capsys.readouterr().err
    assert main(["eval", str(rdir / "nothing-here")]) == 2
    assert "neither a run dir" in capsys.readouterr().err
