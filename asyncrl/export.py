"""`asyncrl export RUN_DIR [--version N | --step S] OUT_DIR`: trained weights as a Hugging Face model dir.

The output is what ``transformers.AutoModelForCausalLM.from_pretrained`` and ``vllm.LLM`` load:

* ``config.json``, the tokenizer files and everything else of the run's base model directory
  (``model.path``, or the built tiny model in ``RUN_DIR/model``), except its weight files;
* ``model.safetensors``: the weights asked for (see :func:`weight_sources`), saved with the
  ``format: pt`` metadata transformers wants, one name per tied parameter (:func:`_untied`):

  - by default the newest weights on disk: published ``vN`` or a learner checkpoint, whichever holds
    the later learner step. A checkpoint taken ``k`` steps after the last publication
    (``learner.publish_every`` > 1, ``publish_policy=taken``, the final save on stop) holds weights
    that are no version; they are the newest when N is the newest version, and are exported as
    ``vN+k steps`` (so a run's last steps are never lost to the export);
  - ``--version N``: exactly version N: the published file (checked against its manifest) when it is
    still on disk, else a checkpoint taken right at N's publication (never one steps past it);
  - ``--step S``: the checkpoint of learner step S.

  Of several copies of the same weights the published file comes first; a damaged copy (sha256,
  truncation, unreadable DeepSpeed states) is passed over for the next with a warning, and when none is
  intact the export fails with one line naming each file (:class:`ExportError`);
* ``generation_config.json``: the base model's, or one made from the run's sampling settings;
* ``asyncrl_export.json`` (run, version, ``steps_past_version``, ``label``, ``step``: the learner step
  of the weights (a published version's: the step that published it, :func:`published_step`; null
  when no record of it is left), source and its digest, damaged copies passed over) and
  ``asyncrl_config.yaml`` (the run's config with its paths absolute where they exist, so
  ``asyncrl eval OUT_DIR`` scores the same task and eval split as the run, from any directory).

Written into a temporary sibling directory and renamed, so OUT_DIR is complete or absent; an OUT_DIR
that is a file or a non-empty directory is refused before anything is read.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

__all__ = [
    "export_version",
    "ExportError",
    "Source",
    "available_versions",
    "published_step",
    "weight_sources",
    "load_run_config",
    "EXPORT_CONFIG",
    "EXPORT_INFO",
]

log = logging.getLogger(__name__)

EXPORT_CONFIG = "asyncrl_config.yaml"
EXPORT_INFO = "asyncrl_export.json"
_WEIGHT_FILES = re.compile(
    r".*\.(safetensors|bin|pt|pth)$|.*\.safetensors\.index\.json$|.*\.bin\.index\.json$"
)


class ExportError(ValueError):
    """A request export cannot serve (damaged weights with no intact copy): a one-line user error."""


# What a run dir holds (its config, its weights on disk) is read in asyncrl.export_sources; the names
# stay importable from here. Imported after ExportError: stdlib imports only at the top of both modules.
from asyncrl.export_sources import (  # noqa: E402
    Source,
    _checkpoint_tensors,
    _published_tensors,
    available_versions,
    load_run_config,
    published_step,
    weight_sources,
)


def _generation_config(cfg: Any, model_config: dict) -> dict:
    gen = {k: model_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in model_config}
    gen.update(do_sample=True, temperature=cfg.actors.temperature, top_p=cfg.actors.top_p,
               max_new_tokens=cfg.actors.max_tokens)  # fmt: skip
    return gen


def _untied(tensors: dict, tied: bool) -> dict:
    """The tensors safetensors can store: one name per tied parameter.

    A torch checkpoint of a model with tied parameters holds one tensor under every name (GPT-2:
    ``transformer.wte.weight`` and ``lm_head.weight``), which safetensors refuses. The first name in
    module order is kept: that is the input embedding (HF models register the base model before the
    head), which the model ties the head to on load. A published file holds separate copies; with
    ``tie_word_embeddings`` its ``lm_head.weight`` is dropped when it equals another tensor, as before.
    """
    out: dict = {}
    seen: dict[tuple, str] = {}
    for name, t in tensors.items():
        if t.numel() == 0:
            # Every empty tensor has data_ptr 0: two of one shape are not a tie (safetensors, too,
            # ignores empty storages when it looks for shared ones).
            out[name] = t
            continue
        view = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)
        if view in seen:
            continue  # the same tensor as seen[view]
        seen[view] = name
        out[name] = t
    ptrs = [v[0] for v in seen]
    if len(set(ptrs)) < len(ptrs):  # other overlapping views of one storage: separate copies
        out = {k: v.clone() for k, v in out.items()}
    head = out.get("lm_head.weight")
    if (
        tied
        and head is not None
        and any(k != "lm_head.weight" and v.shape == head.shape and _equal(v, head) for k, v in out.items())
    ):
        del out["lm_head.weight"]
    return out


def _equal(a: Any, b: Any) -> bool:
    import torch

    return a.dtype == b.dtype and torch.equal(a, b)


def _pick(sources: list[Source], version: int | None, step: int | None, run_dir: Path) -> list[Source]:
    """The sources holding the requested weights, preferred first (all hold the same weights)."""
    newest_first = sorted(sources, key=lambda s: s.order, reverse=True)
    if step is not None:
        picked = [s for s in newest_first if s.kind == "checkpoint" and s.step == step]
        if not picked:
            steps = [str(s.step) for s in newest_first if s.kind == "checkpoint"]
            raise FileNotFoundError(
                f"{run_dir}: no checkpoint of step {step} on disk; checkpoints: {', '.join(steps) or 'none'}"
            )
        return picked[:1]
    if version is None:  # the newest trained weights, a version or not
        newest = newest_first[0]
        return [s for s in newest_first if s.order[:2] == newest.order[:2]]
    picked = [s for s in newest_first if s.version == version and not s.since_publish]
    if not picked:
        past = [f"--step {s.step} ({s.label})" for s in newest_first if s.since_publish]
        raise FileNotFoundError(
            f"{run_dir}: version {version} is not on disk (kept: the newest learner.keep_versions published "
            "versions with learner.weight_transport=file, and the last checkpoints); available: "
            + ", ".join(map(str, available_versions(run_dir)))
            + (f"; checkpoints past a version: {', '.join(past)}" if past else "")
        )
    return picked


def _load(picked: list[Source]) -> tuple[Source, dict, str, list[str]]:
    """The tensors of the first intact source of ``picked``; the others' failures as warnings."""
    failures: list[str] = []
    for src in picked:
        states = src.path / "mp_rank_00_model_states.pt"
        where = states if src.kind == "checkpoint" and states.exists() else src.path
        try:
            read = _published_tensors if src.kind == "published" else _checkpoint_tensors
            tensors, digest = read(src.path)
        except Exception as e:  # any damage (digest, truncation, unpickling): try the next copy
            why = (str(e).strip().splitlines() or [""])[0]
            failures.append(f"{src.kind} {src.label} at {where}: {type(e).__name__}: {why}")
            continue
        for f in failures:
            log.warning("export: %s; exported %s from %s instead", f, src.label, where)
        return src, tensors, digest, failures
    raise ExportError(
        f"no intact copy of {picked[0].label} on disk: "
        + "; ".join(failures)
        + " (other weights still on disk: --version N or --step S)"
    )


def _check_out(out: Path) -> None:
    """Refuse an out dir that is a file, lies under one, or is a non-empty directory, before any work."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise FileExistsError(f"{out}: {parent} is a file, not a directory")
            break


def export_version(
    run_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    version: int | None = None,
    step: int | None = None,
) -> Path:
    """Write ``run_dir``'s weights to ``out_dir``: version ``version``, the checkpoint of learner step
    ``step``, or by default the newest weights on disk (a checkpoint past the newest version included)."""
    from safetensors.torch import save_file

    from asyncrl.config import to_yaml
    from asyncrl.tinymodel import resolve_model_path

    if version is not None and step is not None:
        raise ExportError("give a version or a step, not both")
    run_dir, out = Path(run_dir), Path(out_dir)
    cfg = load_run_config(run_dir, validate=False, need=("model.path",))
    sources = weight_sources(run_dir)
    if not sources:
        raise FileNotFoundError(f"{run_dir}: no published weights and no checkpoint on disk")
    picked = _pick(sources, version, step, run_dir)
    _check_out(out)
    src, tensors, digest, failures = _load(picked)
    step = src.step if src.kind == "checkpoint" else published_step(run_dir, src.version, sources)
    base = resolve_model_path(cfg, run_dir)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for f in base.iterdir():
            if f.is_file() and not _WEIGHT_FILES.match(f.name):
                shutil.copy2(f, tmp / f.name)
        model_config = json.loads((base / "config.json").read_text())
        tensors = _untied(tensors, bool(model_config.get("tie_word_embeddings")))
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if not (tmp / "generation_config.json").exists():
            (tmp / "generation_config.json").write_text(
                json.dumps(_generation_config(cfg, model_config), indent=2)
            )
        (tmp / EXPORT_CONFIG).write_text(to_yaml(cfg))  # its paths absolute where they exist
        info = {"run": cfg.run.name, "run_dir": str(run_dir.resolve()), "version": src.version,
                "steps_past_version": src.since_publish, "label": src.label, "step": step,
                "source": src.kind, "source_digest": digest, "skipped_damaged": failures,
                "exported_at": time.time()}  # fmt: skip
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=2))
        if out.exists():
            out.rmdir()
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
