"""What a run dir holds for `asyncrl export` and `asyncrl eval RUN_DIR`: its saved config (paths resolved
from here, or a clear error) and every set of weights still on disk (:class:`Source`), with the learner
step a published version came from. See asyncrl.export for how they are chosen and written out.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "EVAL_PATHS",
    "Source",
    "available_versions",
    "load_run_config",
    "published_step",
    "weight_sources",
]

log = logging.getLogger("asyncrl.export")  # one logger for the export's messages (tests and users filter it)


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
