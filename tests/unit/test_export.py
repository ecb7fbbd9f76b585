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
from asyncrl.export import EXPORT_INFO, available_versions, export_version
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
    # --step (a checkpoint, e.g. one past its version) reaches the export's own check, before an engine.
    assert main(["eval", str(rdir), "--step", "77"]) == 2
    assert "no checkpoint of step 77 on disk" in capsys.readouterr().err


def _checkpoint(rdir, step: int, version: int, since_publish: int, module: dict) -> None:
    tag = rdir / "checkpoints" / f"step{step:08d}"
    tag.mkdir(parents=True)
    torch.save({"module": module}, tag / "mp_rank_00_model_states.pt")
    state = {"step": step, "version": version, "since_publish": since_publish}
    (tag / "learner_state.json").write_text(json.dumps(state))


def _exported(out) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    return load_file(str(out / "model.safetensors")), json.loads((out / "asyncrl_export.json").read_text())


def _same(got: dict, want: dict) -> bool:
    return set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_a_checkpoint_steps_past_its_version_is_exported_as_such(run_dir, tmp_path, capsys):
    """publish_every=3: the final checkpoint (step 4) holds v3 + 1 step; published v3 is step 3's weights."""
    import shutil

    rdir, sd = run_dir
    shutil.rmtree(rdir / "checkpoints" / "step00000005")
    _checkpoint(rdir, 4, 3, 1, _perturbed(sd, 4))
    assert available_versions(rdir) == [3]  # the step-4 weights are no version
    got, info = _exported(export_version(rdir, tmp_path / "newest"))  # default: the newest trained weights
    assert _same(got, _perturbed(sd, 4))
    assert (info["version"], info["steps_past_version"], info["step"]) == (3, 1, 4)
    assert info["label"] == "v3+1 steps" and info["source"] == "checkpoint"
    got, info = _exported(export_version(rdir, tmp_path / "v3", 3))
    assert _same(got, _perturbed(sd, 3)) and info["steps_past_version"] == 0 and info["source"] == "published"
    # v3's file rotated away: the step-4 checkpoint must not pass for v3; --step names it
    shutil.rmtree(rdir / "weights" / "v3")
    assert main(["export", str(rdir), str(tmp_path / "o"), "--version", "3"]) == 2
    err = capsys.readouterr().err
    assert "version 3 is not on disk" in err and "--step 4" in err and not (tmp_path / "o").exists()
    assert main(["export", str(rdir), str(tmp_path / "o"), "--step", "4"]) == 0
    assert "v3+1 steps" in capsys.readouterr().out
    assert _same(_exported(tmp_path / "o")[0], _perturbed(sd, 4))
    assert main(["export", str(rdir), str(tmp_path / "o2"), "--step", "9"]) == 2
    assert "no checkpoint of step 9" in capsys.readouterr().err


def test_a_damaged_source_falls_back_to_an_intact_one_of_the_same_weights(run_dir, tmp_path, capsys, caplog):
    rdir, sd = run_dir
    v5 = rdir / "weights" / "v5"  # published v5 and the step-5 checkpoint (v5 exactly) hold the same weights
    v5.mkdir()
    from safetensors.torch import save_file

    save_file(_perturbed(sd, 5), str(v5 / "model.safetensors"), metadata={"format": "pt"})
    (v5 / MANIFEST_FILENAME).write_bytes(build_manifest(5, v5 / "model.safetensors", "float32").to_bytes())
    data = bytearray((v5 / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (v5 / "model.safetensors").write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="asyncrl.export"):
        got, info = _exported(export_version(rdir, tmp_path / "o"))
    assert _same(got, _perturbed(sd, 5)) and info["version"] == 5 and info["source"] == "checkpoint"
    assert any("weights/v5" in r.getMessage() and "sha256" in r.getMessage() for r in caplog.records)
    # the checkpoint damaged too: one line naming both files, no traceback, nothing written
    states = rdir / "checkpoints" / "step00000005" / "mp_rank_00_model_states.pt"
    states.write_bytes(states.read_bytes()[:100])
    assert main(["export", str(rdir), str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert "mp_rank_00_model_states.pt" in err and "v5" in err and "Traceback" not in err
    assert not (tmp_path / "o2").exists() and not list(tmp_path.glob(".o2.tmp-*"))
    assert main(["export", str(rdir), str(tmp_path / "o2"), "--version", "3"]) == 0  # v3 is intact


def test_tied_embeddings_under_any_name_export_from_a_checkpoint(tmp_path):
    """GPT-2 ties lm_head.weight to transformer.wte.weight: the checkpoint holds one tensor under both names."""
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    cfg = Config()
    rdir = tmp_path / "run"
    tiny = build_tiny_model(tmp_path / "tiny", cfg.model.tiny, cfg.run.seed)
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=99, n_embd=32, n_layer=1, n_head=2, n_positions=64,
                                      tie_word_embeddings=True)).eval()  # fmt: skip
    gpt2.save_pretrained(tmp_path / "base")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "base" / f).write_bytes((tiny / f).read_bytes())
    cfg.model.path = str(tmp_path / "base")
    rdir.mkdir()
    (rdir / "config.yaml").write_text(to_yaml(cfg))
    _checkpoint(rdir, 2, 2, 0, gpt2.state_dict())
    got, _ = _exported(export_version(rdir, tmp_path / "o"))
    assert "lm_head.weight" not in got and "transformer.wte.weight" in got
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "o").eval()
    x = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, gpt2(x).logits)


def test_export_onto_a_file_is_refused_and_the_file_kept(run_dir, tmp_path, capsys):
    rdir, _ = run_dir
    f = tmp_path / "afile"
    f.write_text("keep me")
    for out in (f, f / "sub"):
        assert main(["export", str(rdir), str(out)]) == 2
        assert "not a directory" in capsys.readouterr().err
    assert f.read_text() == "keep me" and not list(tmp_path.glob(".afile.tmp-*"))


def test_a_run_whose_saved_config_fails_todays_checks_still_exports(run_dir, tmp_path):
    """A finished run's config passed the checks of its day; a later, stricter check (here group_size >= 2,
    added after runs with 1 existed) must not make its weights unexportable."""
    rdir, _ = run_dir
    text = (rdir / "config.yaml").read_text()
    assert "group_size: 8" in text
    (rdir / "config.yaml").write_text(text.replace("group_size: 8", "group_size: 1"))
    out = export_version(rdir, tmp_path / "out", 3)
    assert json.loads((out / EXPORT_INFO).read_text())["version"] == 3


def test_empty_tensors_of_one_shape_are_not_taken_for_tied_ones() -> None:
    """Every empty tensor's storage has data_ptr 0: two of one shape looked like one tensor under two
    names, and the second was dropped from the export."""
    from safetensors.torch import save

    from asyncrl.export import _untied

    w = torch.ones(2, 3)
    got = _untied({"a.bias": torch.zeros(0), "b.bias": torch.zeros(0), "w": w, "tied": w}, False)
    assert sorted(got) == ["a.bias", "b.bias", "w"]
    save(got)  # safetensors accepts the result


def test_an_old_checkpoint_is_not_mislabelled_when_the_run_config_does_not_load(tmp_path, caplog):
    """A checkpoint of an older asyncrl records no since_publish; its label comes from the run's
    publish_every. A config.yaml that exists but did not load (a renamed key) was taken as absent
    and the checkpoint (v1 + 1 step) offered as v1 itself."""
    from asyncrl.export import weight_sources

    tag = tmp_path / "checkpoints" / "step00000003"
    tag.mkdir(parents=True)
    (tag / "learner_state.json").write_text(json.dumps({"step": 3, "version": 1}))
    (tmp_path / "config.yaml").write_text("learner:\n  publish_every: 2\n")
    assert [(s.version, s.since_publish) for s in weight_sources(tmp_path)] == [(1, 1)]
    (tmp_path / "config.yaml").write_text("learner:\n  publish_every: 2\n  some_renamed_key: 1\n")
    with caplog.at_level("WARNING", logger="asyncrl.export"):
        assert weight_sources(tmp_path) == []
    assert "config.yaml does not load" in caplog.text and "some_renamed_key" in caplog.text
    assert "steps since publication unknown" in caplog.text


def test_the_exported_config_finds_the_tasks_files_from_any_directory(run_dir, tmp_path, monkeypatch):
    """The run's config keeps task paths as typed (relative to where `asyncrl run` ran): the exported
    asyncrl_config.yaml made `asyncrl eval OUT_DIR` fail from any other directory ("not found")."""
    from asyncrl.config import load_config

    rdir, _ = run_dir
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    (work / "data" / "d.jsonl").write_text(json.dumps({"prompt": "q"}) + "\n")
    (work / "t.py").write_text("def make_task(cfg, seed):\n    raise NotImplementedError\n")
    cfg = load_config(None, ["run.name=exp", "task.name=t.py:make_task", "task.data_path=data/d.jsonl",
                             "task.eval_data_path=missing.jsonl"], validate=False)  # fmt: skip
    (rdir / "config.yaml").write_text(to_yaml(cfg))
    monkeypatch.chdir(work)  # where the run was started, and the export is made
    out = export_version(rdir, tmp_path / "out", 3)
    monkeypatch.chdir(tmp_path)
    task = load_config(str(out / "asyncrl_config.yaml"), validate=False).task
    assert task.data_path == str(work / "data" / "d.jsonl") and task.name == f"{work / 't.py'}:make_task"
    assert task.eval_data_path == "missing.jsonl"  # not found from the export's directory: left as typed
    assert "data_path: data/d.jsonl" in (rdir / "config.yaml").read_text()  # the run's own: untouched
