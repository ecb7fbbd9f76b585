"""The learner's pad id (asyncrl.learner.engine.pad_id) for the model configs users bring.

Llama-3-Instruct's config.json lists three end-of-sequence ids and no pad id: the learner crashed at
start (``int()`` of a list) and was restarted until run.max_restarts failed the run."""

from __future__ import annotations

import json

from transformers import AutoConfig, Qwen2Config

from asyncrl.learner.engine import pad_id


def test_pad_id_of_a_multi_eos_config_without_pad(tmp_path) -> None:
    model = tmp_path / "m"
    Qwen2Config(vocab_size=64, eos_token_id=5, pad_token_id=4).save_pretrained(
        model
    )  # read back as users' are
    cfg = json.loads((model / "config.json").read_text())
    base_eos, base_pad = cfg["eos_token_id"], cfg["pad_token_id"]
    assert pad_id(AutoConfig.from_pretrained(model)) == base_pad  # the pad id when there is one
    cfg["eos_token_id"] = [base_eos, 2, 3]  # Llama-3-Instruct style
    cfg.pop("pad_token_id")
    (model / "config.json").write_text(json.dumps(cfg))
    mc = AutoConfig.from_pretrained(model)
    assert mc.pad_token_id is None and mc.eos_token_id == [base_eos, 2, 3]
    assert pad_id(mc) == base_eos and isinstance(pad_id(mc), int)
    cfg["eos_token_id"] = 7
    (model / "config.json").write_text(json.dumps(cfg))
    assert pad_id(AutoConfig.from_pretrained(model)) == 7
    cfg.pop("eos_token_id")
    (model / "config.json").write_text(json.dumps(cfg))
    assert pad_id(AutoConfig.from_pretrained(model)) == 0
