"""The learner's models have dropout off (asyncrl.learner.logprobs.load_hf_model): the policy trains in
train mode, and a config's dropout made log pi random there (the on-policy ratio not 1, the policy and
the eval-mode reference on different paths). The user's config.json on disk keeps its rates."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from asyncrl.learner.logprobs import load_hf_model, token_logprobs  # noqa: E402


def _models():
    yield transformers.GPT2LMHeadModel(  # resid/embd/attn pdrop as nn.Dropout modules
        transformers.GPT2Config(
            vocab_size=64,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=32,
            resid_pdrop=0.3,
            embd_pdrop=0.3,
            attn_pdrop=0.3,
        )  # fmt: skip
    )
    yield transformers.Qwen2ForCausalLM(  # attention_dropout read from the config by the attention
        transformers.Qwen2Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            attention_dropout=0.5,
        )  # fmt: skip
    )


@pytest.mark.parametrize("index", [0, 1])
def test_train_mode_forwards_are_deterministic_and_equal_eval(tmp_path, index) -> None:
    torch.manual_seed(0)
    src = list(_models())[index]
    src.save_pretrained(tmp_path)
    on_disk = json.loads((tmp_path / "config.json").read_text())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (3, 9), generator=g)
    mb = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "temperature": torch.tensor([1.0, 0.7, 1.3]),
    }
    # The model as saved does drop in train mode (so this test can fail): two forwards differ.
    src.train()
    with torch.no_grad():
        a, _ = token_logprobs(src, mb, entropy=False)
        b, _ = token_logprobs(src, mb, entropy=False)
    assert (a - b).abs().max() > 1e-3
    model = load_hf_model(tmp_path)
    model.train()
    with torch.no_grad():
        a, _ = token_logprobs(model, mb, entropy=False)
        b, _ = token_logprobs(model, mb, entropy=False)
        model.eval()
        c, _ = token_logprobs(model, mb, entropy=False)
    assert torch.equal(a, b) and torch.equal(a, c)
    assert json.loads((tmp_path / "config.json").read_text()) == on_disk
