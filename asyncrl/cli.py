"""`asyncrl` command line: parse, load the config, lazy-import the role, run it.

Kept thin on purpose: importing this module must not import torch, vllm or ray, so `asyncrl status`,
`asyncrl config` and bad-config errors answer in well under a second.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from asyncrl.actors.supervision import (  # no torch, vllm or ray
    ActorSupervisionError,
    PoolLeaseLost,
    RayConnectError,
)
from asyncrl.config import (
    ConfigError,
    check_data_paths,
    check_model_dir,
    explain,
    load_config,
    run_dir,
    to_yaml,
)
from asyncrl.config.resume import check_resume
from asyncrl.export import ExportError  # stdlib imports only at the top of asyncrl.export
from asyncrl.tasks.base import TaskDataError  # asyncrl.tasks imports neither torch, vllm nor ray
from asyncrl.tasks.registry import TaskNotFound, check_task

#: What a user's mistake raises: printed as one `asyncrl: error:` line with exit status 2, no traceback.
USER_ERRORS = (ConfigError, FileNotFoundError, FileExistsError, TaskDataError, TaskNotFound, ExportError)
#: What stops a role for a reason outside it (its message says what and why): one `asyncrl: error:` line,
#: exit status 1, no traceback (serve-actors' supervision giving up names the slot and the actor's error).
ROLE_ERRORS = (PoolLeaseLost, RayConnectError, ActorSupervisionError)


def _add_config_args(
    p: argparse.ArgumentParser, help_text: str = "YAML config (default: configs/default.yaml)", **kw
) -> None:
    p.add_argument("--config", "-c", default=None, help=help_text, **kw)
    p.add_argument(
        "overrides", nargs="*", help="dotlist overrides, e.g. learner.lr=1e-5 buffer.max_staleness=2"
    )


def _add_allow_change(p: argparse.ArgumentParser) -> None:
    """--allow-config-change: resume a run dir although a key that defines the run changed (on purpose)."""
    p.add_argument(
        "--allow-config-change", dest="allow_changes", action="append", default=[], metavar="KEY",
        help="resume although KEY (or a section, e.g. learner.loss) changed from the run dir's config.yaml; "
        "the keys that define a run are refused otherwise (asyncrl.config.resume; model.*, run.seed/name, "
        "learner.zero_stage/consumer never)",
    )  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="asyncrl", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run", help="all-in-one: embedded Redis, local Ray, actor pool and learner")
    p.add_argument("-v", "--verbose", action="store_true", help="show vLLM/Ray output on the console too")
    _add_allow_change(p)
    _add_config_args(p)
    p = sub.add_parser("serve-actors", help="run the vLLM actor pool (needs redis.url)")
    p.add_argument("-v", "--verbose", action="store_true", help="show vLLM's INFO lines on the console too")
    _add_allow_change(p)
    _add_config_args(p)
    p = sub.add_parser("learn", help="run the DeepSpeed learner (needs redis.url)")
    p.add_argument("--resume", action="store_true", help="restore the latest checkpoint of the run dir")
    _add_allow_change(p)
    _add_config_args(p)
    p = sub.add_parser(
        "status",
        help="one-screen summary of a run's buffer, actors and learner (an ended run: its summary.json)",
    )
    _add_config_args(p)
    p = sub.add_parser("plot", help="reward/staleness curves of a run dir as a PNG")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="PNG path (default RUN_DIR/curve.png)")
    p = sub.add_parser("plan", help="simulate the pipeline: throughput and staleness to expect")
    p.add_argument("--plan", default=None, help="plan YAML (simulator inputs, e.g. configs/plan_*.yaml)")
    p.add_argument("--from", dest="run_dirs", action="append", default=[], help="calibrate from a run dir")
    p.add_argument("--staleness", default="0,1,2,4,8", help="comma-separated max_staleness values")
    p.add_argument("--json", action="store_true", help="print inputs, sources and results as JSON")
    p.add_argument("overrides", nargs="*", help="simulator inputs, e.g. num_actors=8 lengths.sigma=1.2")
    p = sub.add_parser("sweep", help="staleness x objective sweep")
    _add_config_args(p, "sweep YAML (grid + base config), e.g. configs/sweep_staleness.yaml", required=True)
    p = sub.add_parser("export", help="a run's policy version as a Hugging Face model directory")
    p.add_argument("run_dir")
    p.add_argument("out_dir")
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--version", type=int, default=None,
        help="policy version (default: the newest weights on disk, a checkpoint past the newest version included)",
    )  # fmt: skip
    which.add_argument(
        "--step",
        type=int,
        default=None,
        help="the learner checkpoint of this step (e.g. one labelled vN+k steps)",
    )
    p = sub.add_parser("eval", help="score a model dir or a run's version on the task's eval split (vLLM)")
    p.add_argument("target", help="model dir (e.g. from asyncrl export) or run dir")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--version", type=int, default=None, help="run dir: policy version (default: newest)")
    which.add_argument(
        "--step",
        type=int,
        default=None,
        help="run dir: the learner checkpoint of this step (e.g. vN+k steps)",
    )
    p.add_argument("--out", default=None, help="also write the result as JSON to this file")
    p.add_argument("-v", "--verbose", action="store_true", help="show vLLM's INFO lines on the console too")
    _add_config_args(
        p,
        "model dir only: YAML config (default: the export's config, else configs/default.yaml); "
        "a run dir uses its own config.yaml",
    )
    p = sub.add_parser(
        "bench", help="benchmark: one table of ratios with targets, and JSON (see asyncrl.bench)"
    )
    p.add_argument("--quick", action="store_true", help="tiny model only, few iterations (CI smoke)")
    p.add_argument(
        "--sizes",
        help="comma-separated subset of tiny,50M,300M; --iters N; --out FILE; "
        "--[no-]pipeline, --staleness 0,1,4, --pipeline-steps N (asyncrl bench -h)",
    )
    p = sub.add_parser("config", help="print the resolved config, or every field with --explain")
    p.add_argument("--explain", action="store_true")
    _add_config_args(p)
    return ap


def _parse(argv: list[str]) -> argparse.Namespace:
    """The command line, key=value overrides anywhere in it: `asyncrl learn -c f.yaml redis.url=U --resume
    run.max_steps=3000` was refused ("unrecognized arguments: run.max_steps=3000"), as argparse's ``*``
    positional takes one run of words only. The words past it join the overrides, in their order."""
    ap = _parser()
    args, extras = ap.parse_known_args(argv)
    if (
        extras
        and isinstance(getattr(args, "overrides", None), list)
        and not any(e[:1] == "-" for e in extras)
    ):
        args.overrides += extras
    elif extras:
        ap.error(f"unrecognized arguments: {' '.join(extras)}")
    return args


def _redis_url(cfg, rdir: Path) -> str:
    """The Redis URL a role connects to: the configured one, the one `asyncrl run` hands its learner in
    the environment (ASYNCRL_REDIS_URL), or the one a running `asyncrl run` wrote (0600 file)."""
    if cfg.redis.url:
        return cfg.redis.url
    if os.environ.get("ASYNCRL_REDIS_URL"):
        return os.environ["ASYNCRL_REDIS_URL"]
    url_file = rdir / "redis.url"
    if url_file.exists():
        return url_file.read_text().strip()
    raise ConfigError(
        "redis.url is empty and no embedded Redis of this run is up "
        f"({url_file} missing): start a Redis (e.g. `redis-server --port 6379 --appendonly yes`) "
        "and pass redis.url=redis://127.0.0.1:6379/0, or use `asyncrl run`"
    )


def _check_model_path(cfg, data: bool = True, shard: bool = True, eval_prompts: bool | None = None) -> None:
    """Fail before any role starts (and before minutes of engine start-up) when the model or, with
    ``data`` (roles that build the task), the task's data files are missing or do not fit the config:
    the task is built here, its data read and checked, as each actor will build it (``eval_prompts``:
    whether it must have eval prompts, see :func:`asyncrl.tasks.registry.check_task`)."""
    check_model_dir(cfg)
    if data:
        check_data_paths(cfg)
        check_task(cfg, shard=shard, eval_prompts=eval_prompts)


def _export_or_eval(args) -> int:
    import json

    from asyncrl.export import EXPORT_INFO, export_version

    if args.cmd == "export":
        out = export_version(Path(args.run_dir), Path(args.out_dir), args.version, args.step)
        info = json.loads((out / EXPORT_INFO).read_text())
        step = f", learner step {info['step']}" if info.get("step") is not None else ""
        print(f"{out}  (run {info['run']}, {info['label']}{step}, from the {info['source']} weights)")
        return 0
    from asyncrl.evaluate import quiet_engine_console

    restore_env = quiet_engine_console(args.verbose)  # before anything starts vLLM
    try:
        return _eval(args)
    finally:
        restore_env()  # main() run in-process (tests, notebooks) must not quiet what runs after it


def _eval(args) -> int:
    import json
    import tempfile

    from asyncrl.evaluate import eval_model_dir
    from asyncrl.export import EXPORT_CONFIG, EXPORT_INFO, export_version, load_run_config

    target = Path(args.target)
    with tempfile.TemporaryDirectory(prefix="asyncrl-eval-") as tmp:
        if (target / "config.yaml").exists() and not (target / "config.json").exists():  # a run dir
            if args.config:
                raise ConfigError(
                    f"--config applies to a model dir; the run dir {target} is evaluated with its own "
                    "config.yaml (change it with key=value overrides)"
                )
            cfg = load_run_config(target, args.overrides)
            check_data_paths(cfg)
            model_dir = export_version(target, Path(tmp) / "model", args.version, args.step)
        elif (target / "config.json").exists():  # a model dir: the run's config when it is an export
            if args.version is not None or args.step is not None:
                raise ConfigError("--version and --step apply to a run dir, not to a model dir")
            run_cfg = target / EXPORT_CONFIG
            # model.path = the dir under evaluation, so the model checks (chat template, max_model_len)
            # look at it rather than at the tiny model or the base model the config was written for.
            overrides = [f"model.path={target}", *args.overrides]
            cfg = load_config(args.config or (run_cfg if run_cfg.exists() else None), overrides)
            # No actors: the prompts are not split over them; the eval prompts are what it scores.
            _check_model_path(cfg, shard=False, eval_prompts=True)
            model_dir = target
        else:
            raise FileNotFoundError(
                f"{target}: neither a run dir (config.yaml) nor a model dir (config.json)"
            )
        info_file = model_dir / EXPORT_INFO
        info = json.loads(info_file.read_text()) if info_file.exists() else {}
        # weights steps past a version (asyncrl_export.json "vN+k steps") are not version N: unknown (-1)
        version = -1 if info.get("steps_past_version") else info.get("version", -1)
        result = eval_model_dir(cfg, str(model_dir), version).to_dict()
    line = json.dumps(result)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command; one whose stdout is closed early (`asyncrl status | head`) ends quietly, exit status
    141 as a shell tool killed by SIGPIPE, not in a BrokenPipeError traceback."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # what is still buffered fails here, not in the interpreter's exit
        return code
    except BrokenPipeError:
        if not _stdout_closed():
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush goes nowhere
        return 141


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader is gone (its poll reports an error): a BrokenPipeError of a
    socket (Redis) is not ours to swallow."""
    import select

    try:
        p = select.poll()
        p.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in p.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # its own flags (argparse REMAINDER cannot take leading options)
        from asyncrl.bench import main as bench_main

        return bench_main(argv[1:])
    args = _parse(argv)
    restore_env = lambda: None  # noqa: E731
    if args.cmd == "serve-actors":  # before anything starts vLLM: its INFO flood off the console, as eval's
        from asyncrl.console import quiet_engine_console

        restore_env = quiet_engine_console(args.verbose)  # undone on return (main() called in-process)
    try:
        if args.cmd in ("export", "eval"):  # their config comes from the run / export, not -c
            return _export_or_eval(args)
        if args.cmd == "plot":
            from asyncrl.plot import plot_run

            out = plot_run(Path(args.run_dir), Path(args.out) if args.out else None)
            print(out)
            return 0
        if args.cmd == "plan":  # simulator inputs, not a run config
            from asyncrl.plan.report import run_plan

            return run_plan(args.plan, args.run_dirs, args.staleness, args.overrides, args.json)
        if args.cmd == "sweep":  # its YAML is a sweep spec (grid + base config), not a run config
            from asyncrl.sweep import run_sweep

            return run_sweep(args.config, args.overrides)
        cfg = load_config(args.config, args.overrides)
        # Secrets stay off argv and out of config files: `asyncrl run` passes them in the environment.
        cfg.redis.password = cfg.redis.password or os.environ.get("ASYNCRL_REDIS_PASSWORD", "")
        rdir = run_dir(cfg)
        if args.cmd == "config":
            print("\n".join(explain(cfg)) if args.explain else to_yaml(cfg), end="\n")
            return 0
        if args.cmd in ("run", "learn", "serve-actors"):
            _check_model_path(cfg, data=args.cmd != "learn")  # the learner never reads the task's data
        if args.cmd == "run":
            from asyncrl.orchestrator import run_all

            if args.verbose:
                cfg.console.verbose = True
            else:  # no tqdm bars (model shards, weights) from any process of the run on the console
                os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
            return run_all(cfg, config_path=args.config, allow_changes=tuple(args.allow_changes))
        if args.cmd == "status":
            from asyncrl.status import print_status

            # A run that is not up (no URL: an `asyncrl run` removes its redis.url when it stops) is shown
            # from its summary.json; before, this pointed the user at starting a Redis.
            own_url = cfg.redis.url or os.environ.get("ASYNCRL_REDIS_URL")
            has_url = own_url or (rdir / "redis.url").exists()
            # The advice for a run not up follows where its URL came from: the run dir's (asyncrl run's
            # embedded Redis), or the user's (asyncrl run on it, or split roles).
            return print_status(cfg, _redis_url(cfg, rdir) if has_url else None, rdir, embedded=not own_url)
        # Both build model/ in the run dir (resolve_model_path): a resume under a changed config is refused
        # first, before redis.url is filled in (the saved config holds the one it was started with).
        changes = check_resume(cfg, rdir, args.allow_changes, data=args.cmd != "learn")
        for line in changes:
            print(f"asyncrl {args.cmd}: {line}", file=sys.stderr, flush=True)
        if args.cmd == "learn" and not args.resume:
            # A fresh start over a run that has weights or a checkpoint: refused before anything in the
            # run dir changes (config.yaml below), in a second, not after DeepSpeed loaded.
            from asyncrl.learn_role import check_fresh_start

            check_fresh_start(
                dataclasses.replace(cfg, redis=dataclasses.replace(cfg.redis, url=_redis_url(cfg, rdir))),
                rdir,
            )
        if args.cmd == "learn" and (changes or not (rdir / "config.yaml").exists()):
            # The run's config, as `asyncrl run` saves it: a learner started on its own (split roles)
            # left none, and export, eval, plan --from and the next resume's check all read it. Before
            # redis.url is filled in, so the saved config matches what `asyncrl run` writes; redacted.
            from asyncrl.launch import redacted

            rdir.mkdir(parents=True, exist_ok=True)
            (rdir / "config.yaml").write_text(to_yaml(redacted(cfg)))
        cfg.redis.url = _redis_url(cfg, rdir)
        if args.cmd == "serve-actors":
            from asyncrl.actors.serve import serve_actors
            from asyncrl.console import role_logging

            role_logging()  # the pool's own lines (an actor replaced, the lease) at INFO
            serve_actors(cfg, rdir)
            return 0
        if args.cmd == "learn":
            from asyncrl.learn_role import run_learn

            return run_learn(cfg, rdir, args.resume)
    except USER_ERRORS as e:
        print(f"asyncrl: error: {e}", file=sys.stderr)
        return 2
    except ROLE_ERRORS as e:
        print(f"asyncrl: error: {e}", file=sys.stderr)
        return 1
    finally:
        restore_env()
    raise AssertionError(args.cmd)


if __name__ == "__main__":
    sys.exit(main())
