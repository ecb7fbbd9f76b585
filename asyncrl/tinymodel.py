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
TOKENIZER_FORMAT = 2  # 2 = byte-level spelled vocabulary (see build_tokenizer)


def vocab() -> dict[str, int]:
    tokens = [PAD, EOS, UNK] + CHARS
    return {t: i for i, t in enumerate(tokens)}


def _bytes_to_unicode() -> dict[int, str]:
    # The fixed GPT-2 byte -> printable-unicode table used by every byte-level BPE tokenizer.
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


_BYTE_TO_UNICODE = _bytes_to_unicode()
# Qwen2's pre-tokenizer regex (transformers' Qwen2Tokenizer), reproduced so that the saved
# tokenizer.json and the class transformers/vLLM pick for model_type "qwen2" tokenize identically.
_QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def build_tokenizer():
    """A character-level fast tokenizer: every character is one token (ids as in :func:`vocab`).

    Why byte-level BPE without merges rather than a plain word-level split: for ``model_type``
    "qwen2", transformers (and therefore vLLM) always loads ``Qwen2Tokenizer``, which rebuilds the
    pipeline as NFC + Qwen2 split regex + byte-level BPE from the saved vocab, whatever
    tokenizer.json says. A plain vocabulary then silently drops spaces and newlines (byte-level
    spells them 'Ġ'/'Ċ'). Spelling the vocabulary byte-level and saving that same pipeline makes
    every loader agree, one token per character.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = {PAD, EOS, UNK}
    bl_vocab = {(t if t in special else _BYTE_TO_UNICODE[ord(t)]): i for t, i in vocab().items()}
    tok = Tokenizer(
        models.BPE(vocab=bl_vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False)
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
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
    d["tokenizer"] = TOKENIZER_FORMAT  # a dir built with an older tokenizer layout is rebuilt
    d["vocab"] = "exact"  # and one with a padded embedding matrix
    return d


def _holds(d: Path, want: dict) -> bool:
    """``d`` is a complete model built from ``want`` (the spec file is written last, in a temp dir)."""
    marker = d / SPEC_FILE
    return marker.exists() and json.loads(marker.read_text()) == want and (d / "model.safetensors").exists()


def _cached(entry: Path, want: dict) -> bool:
    """A cache entry is served only if its bytes still hash to the digest stored beside it when it was
    built (a truncated or edited file there is rebuilt, never copied into a run)."""
    digest = entry.with_name(entry.name + ".sha256")
    try:
        return _holds(entry, want) and digest.exists() and digest.read_text().strip() == tree_digest(entry)
    except (OSError, ValueError):  # unreadable, vanishing (another run replacing it) or a bad spec file
        return False


def cache_entry(cache_dir: str | os.PathLike, want: dict) -> Path:
    """Where the machine-wide cache keeps the model of ``want``: keyed by the spec and seed, the torch and
    transformers versions that would build it, and this builder's source, so that any of them changing
    builds anew instead of serving bytes a fresh build would not give."""
    from importlib.metadata import version

    h = hashlib.sha256(json.dumps(want, sort_keys=True).encode())
    for dist in ("torch", "transformers"):
        h.update(f"{dist}={version(dist)}".encode())
    h.update(Path(__file__).read_bytes())
    return Path(cache_dir).expanduser() / h.hexdigest()[:24]


def _copy_in(src: Path, out: Path) -> None:
    """Copy a complete model dir to ``out`` through a temp dir and one rename (no half-copied ``out``)."""
    import shutil

    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def _store(built: Path, entry: Path, want: dict) -> None:
    """Put a fresh build in the cache. The cache only saves time, so a cache that cannot be written (a
    read-only home, a full disk) is logged and the run goes on; two runs storing at once: one wins."""
    import logging
    import shutil

    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_name(f"{entry.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(built, tmp)
        if entry.exists() and not _cached(entry, want):  # a damaged entry: replace it
            shutil.rmtree(entry, ignore_errors=True)
        entry.with_name(entry.name + ".sha256").write_text(tree_digest(tmp) + "\n")
        try:
            tmp.rename(entry)
        except OSError:  # another process stored the same bytes first (rename onto a non-empty dir fails)
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        logging.getLogger(__name__).warning("tiny-model cache %s not written: %s", entry.parent, e)


def build_tiny_model(
    out_dir: str | os.PathLike, spec: Any, seed: int, cache_dir: str | os.PathLike | None = None
) -> Path:
    """Write a randomly initialised tiny Qwen2 model + tokenizer to ``out_dir`` and return it.

    Deterministic: the same (spec, seed) gives byte-identical files. If ``out_dir`` already holds a
    model built from the same spec and seed it is reused (a restarted run must not re-initialise).
    ``cache_dir`` (``model.tiny_cache_dir``): a machine-wide cache of built models; a hit is copied in
    without importing torch or transformers (the build is ~4.5 s of the 2-core box's start-up, on the
    path to Redis, the learner and the actors), a miss is built and stored there.
    """
    out = Path(out_dir)
    want = _spec_dict(spec, seed)
    if _holds(out, want):
        return out
    entry = cache_entry(cache_dir, want) if cache_dir else None
    if entry is not None and _cached(entry, want):
        try:
            _copy_in(entry, out)
            return out
        except OSError as e:  # e.g. another run replacing a damaged entry under us: build instead
            import logging

            logging.getLogger(__name__).warning("tiny-model cache entry %s not copied: %s", entry, e)
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_tokenizer()
    v = vocab()
    config = Qwen2Config(
        # Exactly the tokenizer's vocabulary, no padding rows: a padded id decodes to "" and is free
        # for the reward, so the policy learned to fill completions with invisible tokens instead
        # of emitting EOS (seen in the demo: reward plateaued at the length penalty).
        vocab_size=len(v),
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
    if entry is not None:
        _store(tmp, entry, want)
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
    return build_tiny_model(Path(run_dir) / "model", cfg.model.tiny, cfg.run.seed, cfg.model.tiny_cache_dir)
