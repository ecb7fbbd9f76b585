"""The built-in tiny model: deterministic bytes per (spec, seed), loadable by Hugging Face."""

from __future__ import annotations

import dataclasses

import pytest

from asyncrl.config import TinyModelConfig
from asyncrl.tinymodel import EOS, build_tiny_model, build_tokenizer, tree_digest, vocab

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
