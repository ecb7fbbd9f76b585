"""The built-in tiny policy: a Qwen2-style causal LM with a character-level tokenizer, built offline.

Both roles load the policy from a Hugging Face directory; this module makes one when no model path is
configured, deterministically from a seed (same seed and spec -> same bytes), so the demo and the tests
run without a model hub. Shared by the actors and the learner, so it lives outside both.

Constraints that shape the spec: vLLM's CPU attention needs head_dim >= 32 (16 is unsupported), and
untied embeddings keep the safetensors file free of shared tensors (the weight transport writes every
parameter under its own name).
"""

from __future__ import annotations

import hashlib
import json
import os
import string
from pathlib import Path
from typing import Any

PAD, EOS, UNK = "<pad>", "</s>", "<unk>"
# Printable ASCII without the vertical whitespace; one token per character.
CHARS = [c for c in string.printable if c not in "\r\x0b\x0c\t"]
SPEC_FILE = "asyncrl_tiny_spec.json"


def vocab() -> dict[str, int]:
    tokens = [PAD, EOS, UNK] + CHARS
    return {t: i for i, t in enumerate(tokens)}


def build_tokenizer():
    """A character-level fast tokenizer (``tokenizers``): every character is one token, no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=vocab(), unk_token=UNK))
    # Split into single characters, keeping every one (spaces included) as its own token.
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        bos_token=None,
        model_max_length=4096,
    )


def _spec_dict(spec: Any, seed: int) -> dict:
    d = {k: getattr(spec, k) for k in (
        "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "max_position_embeddings")}  # fmt: skip
    d["seed"] = seed
    return d


def build_tiny_model(out_dir: str | os.PathLike, spec: Any, seed: int) -> Path:
    """Write a randomly initialised tiny Qwen2 model + tokenizer to ``out_dir`` and return it.

    Deterministic: the same (spec, seed) gives byte-identical files. If ``out_dir`` already holds a
    model built from the same spec and seed it is reused (a restarted run must not re-initialise).
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    want = _spec_dict(spec, seed)
    marker = out / SPEC_FILE
    if marker.exists() and json.loads(marker.read_text()) == want and (out / "model.safetensors").exists():
        return out
    tok = build_tokenizer()
    v = vocab()
    config = Qwen2Config(
        vocab_size=64 * ((len(v) + 63) // 64),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        torch_dtype="float32",
        bos_token_id=None,
        eos_token_id=v[EOS],
        pad_token_id=v[PAD],
        use_sliding_window=False,
    )
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = Qwen2ForCausalLM(config)
    finally:
        torch.random.set_rng_state(state)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    # generation_config.json carries a transformers version string only; keep it, it is deterministic.
    (tmp / SPEC_FILE).write_text(json.dumps(want, sort_keys=True))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out


def tree_digest(path: str | os.PathLike) -> str:
    """sha256 over every file (name and bytes) of a model directory, for determinism checks."""
    h = hashlib.sha256()
    root = Path(path)
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def resolve_model_path(cfg: Any, run_dir: str | os.PathLike) -> Path:
    """The model directory for a run: ``cfg.model.path`` when set (it must exist), else the tiny model."""
    if cfg.model.path:
        p = Path(cfg.model.path).expanduser()
        if not (p / "config.json").exists():
            raise FileNotFoundError(
                f"model.path={cfg.model.path!r}: no Hugging Face model directory there "
                f"(expected {p / 'config.json'}); models are never downloaded at run time"
            )
        return p
    return build_tiny_model(Path(run_dir) / "model", cfg.model.tiny, cfg.run.seed)
