"""`asyncrl export RUN_DIR [--version N] OUT_DIR`: a trained policy version as a Hugging Face model dir.

The output is what ``transformers.AutoModelForCausalLM.from_pretrained`` and ``vllm.LLM`` load:

* ``config.json``, the tokenizer files and everything else of the run's base model directory
  (``model.path``, or the built tiny model in ``RUN_DIR/model``), except its weight files;
* ``model.safetensors``: the weights of version N: the published file (``RUN_DIR/weights/vN``, checked
  against its manifest first) when it is still on disk, else the learner checkpoint taken at version N
  (see :func:`weight_sources`); saved with the ``format: pt`` metadata transformers wants; a tied
  ``lm_head.weight`` is left out (the model ties it to the embeddings on load);
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

__all__ = [
    "export_version",
    "available_versions",
    "weight_sources",
    "load_run_config",
    "EXPORT_CONFIG",
    "EXPORT_INFO",
]

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


def weight_sources(run_dir: Path) -> dict[int, tuple[str, Path]]:
    """version -> ("published", weights file) or ("checkpoint", tag dir), for every version still on disk.

    Published weights (``weights/vN``, or the shared-memory transport's directory while a local run is
    live) are exactly what the actors served and are preferred; a learner checkpoint holds the weights of
    the version it was taken at (the final one always is: the learner checkpoints at its last step).
    """
    from asyncrl.learner.checkpoint import CHECKPOINT_DIR, STATE_FILE
    from asyncrl.learner.publisher import shm_root

    run_dir = Path(run_dir)
    found: dict[int, tuple[str, Path]] = {}
    for tag in sorted((run_dir / CHECKPOINT_DIR).glob("step*")):
        try:
            version = int(json.loads((tag / STATE_FILE).read_text())["version"])
        except (OSError, ValueError, KeyError):
            continue  # an uncommitted or damaged tag
        found[version] = ("checkpoint", tag)
    roots = [run_dir / "weights"]
    try:
        roots.append(shm_root(run_dir, load_run_config(run_dir).run.name))
    except Exception:  # no readable run config: published files only
        pass
    for root in roots:
        for d in root.glob("v*"):
            if d.name[1:].isdigit() and (d / "model.safetensors").exists():
                found[int(d.name[1:])] = ("published", d / "model.safetensors")
    return dict(sorted(found.items()))


def available_versions(run_dir: Path) -> list[int]:
    """Versions :func:`export_version` can write, ascending."""
    return list(weight_sources(run_dir))


def _published_tensors(weights: Path) -> tuple[dict, str]:
    """The tensors of a published file, checked against its manifest (sha256, or sizes for shm)."""
    from safetensors.torch import load_file

    from asyncrl.buffer import WeightManifest, verify
    from asyncrl.buffer.weights import MANIFEST_FILENAME

    manifest_file = weights.parent / MANIFEST_FILENAME
    if not manifest_file.exists():
        raise FileNotFoundError(f"{weights.parent}: no {MANIFEST_FILENAME}; cannot check the weights")
    manifest = WeightManifest.from_bytes(manifest_file.read_bytes())
    verify(manifest, weights if Path(manifest.path).name == weights.name else weights.parent)
    return load_file(str(weights)), manifest.sha256


def _checkpoint_tensors(tag_dir: Path) -> tuple[dict, str]:
    """The module weights of a learner checkpoint (DeepSpeed files of the learner's own run dir).

    ZeRO 0-2 keep the whole module in ``mp_rank_00_model_states.pt``; ZeRO-3 shards it, and DeepSpeed's
    ``zero_to_fp32`` reassembles it (fp32).
    """
    import torch

    states = tag_dir / "mp_rank_00_model_states.pt"
    zero3 = sorted(tag_dir.glob("zero_pp_rank_*_mp_rank_00_model_states.pt"))  # ZeRO-3: one per rank
    if not states.exists() and not zero3:
        raise FileNotFoundError(f"{tag_dir}: no DeepSpeed model states")
    module = {}
    if states.exists():
        module = torch.load(states, map_location="cpu", weights_only=False).get("module") or {}
    if not module or any(t.numel() == 0 for t in module.values()):  # ZeRO-3 shards or placeholders
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        module = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    return {k: v.detach().contiguous() for k, v in module.items()}, f"checkpoint:{tag_dir.name}"


def _generation_config(cfg: Any, model_config: dict) -> dict:
    gen = {k: model_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in model_config}
    gen.update(do_sample=True, temperature=cfg.actors.temperature, top_p=cfg.actors.top_p,
               max_new_tokens=cfg.actors.max_tokens)  # fmt: skip
    return gen


def export_version(
    run_dir: str | os.PathLike, out_dir: str | os.PathLike, version: int | None = None
) -> Path:
    """Write version ``version`` (default: the newest on disk) of ``run_dir`` to ``out_dir``."""
    from safetensors.torch import save_file

    from asyncrl.config import to_yaml
    from asyncrl.tinymodel import resolve_model_path

    run_dir, out = Path(run_dir), Path(out_dir)
    cfg = load_run_config(run_dir)
    sources = weight_sources(run_dir)
    if not sources:
        raise FileNotFoundError(f"{run_dir}: no published weights and no checkpoint on disk")
    if version is None:
        version = max(sources)
    if version not in sources:
        raise FileNotFoundError(
            f"{run_dir}: version {version} is not on disk (kept: the newest learner.keep_versions published "
            "versions with learner.weight_transport=file, and the last checkpoints); available: "
            + ", ".join(map(str, sources))
        )
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    kind, where = sources[version]
    tensors, digest = _published_tensors(where) if kind == "published" else _checkpoint_tensors(where)
    base = resolve_model_path(cfg, run_dir)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for f in base.iterdir():
            if f.is_file() and not _WEIGHT_FILES.match(f.name):
                shutil.copy2(f, tmp / f.name)
        model_config = json.loads((base / "config.json").read_text())
        if model_config.get("tie_word_embeddings") and "embed_tokens" in "".join(tensors):
            tensors.pop("lm_head.weight", None)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if not (tmp / "generation_config.json").exists():
            (tmp / "generation_config.json").write_text(
                json.dumps(_generation_config(cfg, model_config), indent=2)
            )
        (tmp / EXPORT_CONFIG).write_text(to_yaml(cfg))
        info = {"run": cfg.run.name, "run_dir": str(run_dir.resolve()), "version": version, "source": kind,
                "source_digest": digest, "exported_at": time.time()}  # fmt: skip
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=2))
        if out.exists():
            out.rmdir()
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
