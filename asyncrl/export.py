"""`asyncrl export RUN_DIR [--version N] OUT_DIR`: a trained policy version as a Hugging Face model dir.

The output is what ``transformers.AutoModelForCausalLM.from_pretrained`` and ``vllm.LLM`` load:

* ``config.json``, the tokenizer files and everything else of the run's base model directory
  (``model.path``, or the built tiny model in ``RUN_DIR/model``), except its weight files;
* ``model.safetensors``: the published weights of version N (``RUN_DIR/weights/vN``), checked against
  their manifest (sha256 or sizes) first, re-saved with the ``format: pt`` metadata transformers wants;
  a tied ``lm_head.weight`` is left out (the model ties it to the embeddings on load);
* ``generation_config.json``: the base model's, or one made from the run's sampling settings;
* ``asyncrl_export.json`` (run, version, source digest) and ``asyncrl_config.yaml`` (the run's config,
  so ``asyncrl eval OUT_DIR`` scores the same task and eval split as the run).

Written into a temporary sibling directory and renamed, so OUT_DIR is complete or absent.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

__all__ = ["export_version", "available_versions", "load_run_config", "EXPORT_CONFIG", "EXPORT_INFO"]

EXPORT_CONFIG = "asyncrl_config.yaml"
EXPORT_INFO = "asyncrl_export.json"
_WEIGHT_FILES = re.compile(
    r".*\.(safetensors|bin|pt|pth)$|.*\.safetensors\.index\.json$|.*\.bin\.index\.json$"
)


def load_run_config(run_dir: Path, overrides: list[str] | None = None) -> Any:
    from asyncrl.config import ConfigError, load_config

    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        raise ConfigError(f"{run_dir}: not a run directory (config.yaml missing)")
    return load_config(path, overrides)


def available_versions(run_dir: Path) -> list[int]:
    """Published versions whose weights are still on disk (file transport), ascending."""
    root = Path(run_dir) / "weights"
    found = []
    for d in root.glob("v*"):
        if d.name[1:].isdigit() and (d / "model.safetensors").exists():
            found.append(int(d.name[1:]))
    return sorted(found)


def _verified_weights(run_dir: Path, version: int) -> tuple[Path, str]:
    from asyncrl.buffer import WeightManifest, verify
    from asyncrl.buffer.weights import MANIFEST_FILENAME

    vdir = Path(run_dir) / "weights" / f"v{version}"
    weights = vdir / "model.safetensors"
    manifest_file = vdir / MANIFEST_FILENAME
    if not manifest_file.exists():
        raise FileNotFoundError(f"{vdir}: no {MANIFEST_FILENAME}; cannot check the weights")
    manifest = WeightManifest.from_bytes(manifest_file.read_bytes())
    verify(manifest, weights if Path(manifest.path).name == weights.name else vdir)
    return weights, manifest.sha256


def _generation_config(cfg: Any, model_config: dict) -> dict:
    gen = {k: model_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in model_config}
    gen.update(do_sample=True, temperature=cfg.actors.temperature, top_p=cfg.actors.top_p,
               max_new_tokens=cfg.actors.max_tokens)  # fmt: skip
    return gen


def export_version(
    run_dir: str | os.PathLike, out_dir: str | os.PathLike, version: int | None = None
) -> Path:
    """Write version ``version`` (default: the newest on disk) of ``run_dir`` to ``out_dir``."""
    from safetensors.torch import load_file, save_file

    from asyncrl.config import to_yaml
    from asyncrl.tinymodel import resolve_model_path

    run_dir, out = Path(run_dir), Path(out_dir)
    cfg = load_run_config(run_dir)
    versions = available_versions(run_dir)
    if not versions:
        raise FileNotFoundError(f"{run_dir}/weights: no published versions on disk")
    if version is None:
        version = versions[-1]
    if version not in versions:
        raise FileNotFoundError(
            f"{run_dir}: version {version} is not on disk (learner.keep_versions keeps the newest few); "
            f"available: {', '.join(map(str, versions))}"
        )
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    weights, digest = _verified_weights(run_dir, version)
    base = resolve_model_path(cfg, run_dir)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for f in base.iterdir():
            if f.is_file() and not _WEIGHT_FILES.match(f.name):
                shutil.copy2(f, tmp / f.name)
        model_config = json.loads((base / "config.json").read_text())
        tensors = load_file(str(weights))
        if model_config.get("tie_word_embeddings") and "embed_tokens" in "".join(tensors):
            tensors.pop("lm_head.weight", None)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if not (tmp / "generation_config.json").exists():
            (tmp / "generation_config.json").write_text(
                json.dumps(_generation_config(cfg, model_config), indent=2)
            )
        (tmp / EXPORT_CONFIG).write_text(to_yaml(cfg))
        info = {"run": cfg.run.name, "run_dir": str(run_dir.resolve()), "version": version,
                "source_sha256": digest, "exported_at": time.time()}  # fmt: skip
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=2))
        if out.exists():
            out.rmdir()
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
