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
from dataclasses import dataclass
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


#: The path keys whose files `asyncrl eval RUN_DIR` reads (the model's, the task's); an export reads only
#: model.path.
EVAL_PATHS = ("model.path", "task.name", "task.data_path", "task.eval_data_path")


def load_run_config(
    run_dir: Path,
    overrides: list[str] | None = None,
    validate: bool = True,
    need: tuple[str, ...] = EVAL_PATHS,
) -> Any:
    """The run's saved config.yaml (+ overrides). ``validate=False`` (export): read as saved, without the
    value checks, which were passed when the run started; a later, stricter check must not make a
    finished run's weights unexportable.

    config.yaml holds its paths absolute (asyncrl.launch.redacted); one saved by an older asyncrl holds
    them as typed, relative to the directory the run was started in. Such a relative path is made
    absolute when it exists from the working directory (as the run read it); one of the keys in
    ``need`` that does not is a :class:`ConfigError` naming the key, the path tried and what to pass
    (never another directory's file, silently). A key given in ``overrides`` is the caller's."""
    from asyncrl.config import ConfigError, load_config
    from asyncrl.config.loading import validate_config
    from asyncrl.config.paths import PATH_KEYS, path_text, with_path

    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        raise ConfigError(f"{run_dir}: not a run directory (config.yaml missing)")
    cfg = load_config(path, overrides, validate=False)  # validated once its paths are (a task file's)
    given = {o.partition("=")[0].strip() for o in overrides or []}
    for key in PATH_KEYS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        rel = path_text(key, value)
        if not rel or rel.startswith("~") or os.path.isabs(rel):
            continue
        full = os.path.abspath(rel)
        if os.path.exists(full):
            setattr(getattr(cfg, section), name, with_path(key, value, full))
        elif key in need and key not in given:
            raise ConfigError(_relative_missing(path, key, value, rel, full))
    if validate:
        validate_config(cfg)
    return cfg


def _relative_missing(saved: Path, key: str, value: str, rel: str, full: str) -> str:
    """What to do about a relative path of an old run's config.yaml that is not found from here: run from
    the run's start directory, or write the absolute path into config.yaml (`asyncrl export` takes no
    overrides, and `asyncrl eval RUN_DIR` exports with the saved model.path)."""
    from asyncrl.config.paths import with_path

    msg = (f"{saved}: {key}={value!r} is a relative path (a run started by an older asyncrl, which saved "
           f"paths as typed, relative to the directory the run was started in) and is not found from here "
           f"(tried {full}): run this command from that directory, or write the absolute path into "
           f"{saved} ({key}: ABSOLUTE_PATH)")  # fmt: skip
    for parent in list(saved.resolve().parents)[1:4]:  # the run dir's parent (runs/), its parent, ...
        if os.path.exists(parent / rel):
            found = with_path(key, value, str(parent / rel))
            return msg + f"; {parent / rel} exists: '{key}: {found}' if that is the run's"
    return msg


@dataclass(frozen=True)
class Source:
    """Weights on disk: a published file (``kind="published"``) or a learner checkpoint's tag dir.

    A checkpoint taken ``since_publish`` > 0 steps after the last publication (``learner.publish_every``
    > 1, ``publish_policy=taken``, the final save on stop) holds weights that are no version: they are
    ``version`` plus that many steps, labelled ``vN+k steps``.
    """

    kind: str
    path: Path
    version: int
    since_publish: int = 0
    step: int = -1  # the learner step of a checkpoint (-1 for a published file: see published_step)

    @property
    def label(self) -> str:
        return f"v{self.version}+{self.since_publish} steps" if self.since_publish else f"v{self.version}"

    @property
    def order(self) -> tuple[int, int, int, int]:
        """Newest weights last; of equal weights the published file (what the actors served) first."""
        return (self.version, self.since_publish, self.kind == "published", self.step)


def weight_sources(run_dir: Path) -> list[Source]:
    """Every set of weights still on disk, oldest first (see :attr:`Source.order`).

    Published weights (``weights/vN``, or the shared-memory transport's directory while a local run is
    live) are exactly what the actors served; a learner checkpoint holds version N's weights only when it
    was taken right at a publication (``since_publish`` 0), else N plus ``since_publish`` steps.
    """
    from asyncrl.learner.checkpoint import CHECKPOINT_DIR, STATE_FILE
    from asyncrl.learner.publisher import shm_root

    run_dir = Path(run_dir)
    from asyncrl.config import ConfigError

    try:
        cfg = load_run_config(run_dir, validate=False, need=())
    except ConfigError as e:  # no readable run config: published files and recorded since_publish only
        if (run_dir / "config.yaml").exists():
            log.warning("%s: config.yaml does not load (%s); listing published weights and checkpoints "
                        "that record their steps since publication only", run_dir, e)  # fmt: skip
        cfg = None
    found: list[Source] = []
    for tag in sorted((run_dir / CHECKPOINT_DIR).glob("step*")):
        try:
            state = json.loads((tag / STATE_FILE).read_text())
            step, version = int(state.get("step", -1)), int(state["version"])
            since = int(state.get("since_publish", -1))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # an uncommitted or damaged tag
        if since < 0:  # a checkpoint of an older asyncrl: what its learner assumed (asyncrl.learner.loop)
            if cfg is None or step < 0:
                # Without publish_every its weights cannot be labelled: assuming 0 offered weights k
                # steps past vN as vN itself.
                log.warning("%s: steps since publication unknown without the run's config: not listed", tag)
                continue
            since = step % cfg.learner.publish_every
        found.append(Source("checkpoint", tag, version, since, step))
    roots = [run_dir / "weights"]
    if cfg is not None:
        roots.append(shm_root(run_dir, cfg.run.name))
    for root in roots:
        for d in root.glob("v*"):
            if d.name[1:].isdigit() and (d / "model.safetensors").exists():
                found.append(Source("published", d / "model.safetensors", int(d.name[1:])))
    return sorted(found, key=lambda s: s.order)


def published_step(run_dir: Path, version: int, sources: list[Source] | None = None) -> int | None:
    """The learner step whose weights were published as ``version`` (None: no record of it left).

    A weight manifest records no step. Version 0 is the initial weights (step 0). Otherwise: a checkpoint
    of that version (its step less its steps since publication), else metrics.jsonl, read from its end:
    the first record holding ``version`` published it at its step, or, not published by a step, it was
    published (a resume's fork) right before that step. Versions a resume discarded (their records were
    cut) have none."""
    from asyncrl.learner.records import METRICS_FILE, lines_from_end

    if version == 0:
        return 0
    for s in sources if sources is not None else weight_sources(run_dir):
        if s.kind == "checkpoint" and s.version == version and s.step >= s.since_publish >= 0:
            return s.step - s.since_publish
    first = None
    for _, line in lines_from_end(Path(run_dir) / METRICS_FILE):
        try:
            rec = json.loads(line)
            v, step = rec["version"], rec["step"]
        except (ValueError, KeyError, TypeError):
            continue  # an empty or torn line
        if not isinstance(v, int) or not isinstance(step, int):
            continue
        if v < version:
            break  # versions only grow along the file
        if v == version:
            first = (step, bool(rec.get("published")))
    if first is None:
        return None
    return first[0] if first[1] else first[0] - 1


def available_versions(run_dir: Path) -> list[int]:
    """Versions :func:`export_version` can write with ``version=N``, ascending."""
    return sorted({s.version for s in weight_sources(run_dir) if not s.since_publish})


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
