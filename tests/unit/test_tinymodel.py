"""The built-in tiny model: deterministic bytes per (spec, seed), loadable by Hugging Face."""

from __future__ import annotations

import dataclasses
import json

import pytest

from asyncrl.config import TinyModelConfig
from asyncrl.tinymodel import (
    EOS,
    _spec_dict,
    build_tiny_model,
    build_tokenizer,
    cache_entry,
    tree_digest,
    vocab,
)

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def spec():
    return TinyModelConfig(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32)


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path, spec):
    a = build_tiny_model(tmp_path / "a", spec, seed=5)
    b = build_tiny_model(tmp_path / "b", spec, seed=5)
    c = build_tiny_model(tmp_path / "c", spec, seed=6)
    assert tree_digest(a) == tree_digest(b)
    assert tree_digest(a) != tree_digest(c)
    d = build_tiny_model(tmp_path / "d", dataclasses.replace(spec, intermediate_size=48), seed=5)
    assert tree_digest(d) != tree_digest(a)


def test_existing_model_is_reused_not_reinitialised(tmp_path, spec):
    out = build_tiny_model(tmp_path / "m", spec, seed=1)
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    digest = tree_digest(out)
    assert build_tiny_model(out, spec, seed=1) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime and tree_digest(out) == digest
    # A different seed for the same directory rebuilds it.
    build_tiny_model(out, spec, seed=2)
    assert tree_digest(out) != digest


def test_builder_leaves_global_rng_alone(tmp_path, spec):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m", spec, seed=9)
    assert torch.equal(torch.rand(3), expected)


def test_hf_loads_it_and_tokenizer_is_char_level(tmp_path, spec):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = build_tiny_model(tmp_path / "m", spec, seed=0)
    tok = AutoTokenizer.from_pretrained(out)  # for model_type qwen2 this is Qwen2Tokenizer
    text = "Question: it's 1,550 $?\nAnswer: copy:ab c="
    ids = tok(text)["input_ids"]
    v = vocab()
    assert ids == [v[ch] for ch in text]  # one token per character, spaces/newlines kept, no BOS
    assert tok.decode(ids) == text
    assert tok.decode([v[EOS]], skip_special_tokens=True) == ""
    assert build_tokenizer()(text)["input_ids"] == ids  # the in-memory tokenizer agrees
    assert tok.eos_token_id == v[EOS]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size)
    # No padding rows: every sampleable id is a real token (padded ids decode to "" and invited
    # reward hacking with invisible filler instead of EOS).
    assert model.config.vocab_size == len(v)
    assert torch.isfinite(logits).all()
    assert not model.config.tie_word_embeddings


def test_machine_cache_serves_the_same_bytes_without_importing_torch(tmp_path, spec):
    """model.tiny_cache_dir: a miss builds and stores; a hit copies the same bytes in a process that never
    imports torch or transformers (that import is most of the build's start-up cost)."""
    import subprocess
    import sys

    cache = tmp_path / "cache"
    fresh = tree_digest(build_tiny_model(tmp_path / "fresh", spec, seed=3))
    a = build_tiny_model(tmp_path / "a", spec, seed=3, cache_dir=cache)
    assert tree_digest(a) == fresh
    entry = cache_entry(cache, _spec_dict(spec, 3))
    assert (
        tree_digest(entry) == fresh and entry.with_name(entry.name + ".sha256").read_text().strip() == fresh
    )
    code = (
        "import sys, dataclasses, json\n"
        "from asyncrl.config import TinyModelConfig\n"
        "from asyncrl.tinymodel import build_tiny_model, tree_digest\n"
        f"spec = TinyModelConfig(**json.loads({json.dumps(json.dumps(dataclasses.asdict(spec)))!s}))\n"
        f"out = build_tiny_model({str(tmp_path / 'b')!r}, spec, 3, cache_dir={str(cache)!r})\n"
        "print(tree_digest(out), 'torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [fresh, "False", "False"]
    # Another seed is another entry, built anew.
    assert cache_entry(cache, _spec_dict(spec, 4)) != entry


def test_a_damaged_cache_entry_is_rebuilt_and_an_unwritable_cache_only_logs(tmp_path, spec, caplog):

    cache = tmp_path / "cache"
    fresh = tree_digest(build_tiny_model(tmp_path / "a", spec, seed=7, cache_dir=cache))
    entry = cache_entry(cache, _spec_dict(spec, 7))
    blob = entry / "model.safetensors"
    blob.write_bytes(blob.read_bytes()[:-8])  # truncated: the digest beside it no longer matches
    assert tree_digest(build_tiny_model(tmp_path / "b", spec, seed=7, cache_dir=cache)) == fresh
    assert tree_digest(entry) == fresh  # replaced by the rebuild
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with caplog.at_level("WARNING"):
        out = build_tiny_model(tmp_path / "c", spec, seed=7, cache_dir=not_a_dir / "cache")
    assert tree_digest(out) == fresh
    assert any("tiny-model cache" in r.getMessage() for r in caplog.records)


def test_the_run_config_points_resolve_model_path_at_the_cache(tmp_path, spec):
    from asyncrl.config import load_config
    from asyncrl.tinymodel import resolve_model_path

    cache = tmp_path / "cache"
    cfg = load_config(overrides=[f"model.tiny_cache_dir={cache}", "model.tiny.num_layers=1",
                                 "model.tiny.hidden_size=64", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
                                 "model.tiny.intermediate_size=32"])  # fmt: skip
    resolve_model_path(cfg, tmp_path / "run")
    assert (cache_entry(cache, _spec_dict(cfg.model.tiny, cfg.run.seed)) / "model.safetensors").exists()
    off = load_config(overrides=["model.tiny_cache_dir=''", "model.tiny.num_layers=1"])
    assert off.model.tiny_cache_dir == ""
    assert load_config().model.tiny_cache_dir == "~/.cache/asyncrl/tiny-models"
