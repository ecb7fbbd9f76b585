"""``python -m asyncrl.learner [--config run.yaml] [--resume] [key=value ...]``: the learner alone.

The entry point for data-parallel ranks under a launcher, e.g.
``python -m torch.distributed.run --nproc_per_node 2 -m asyncrl.learner --config run.yaml
redis.url=redis://host:6379/0``. ``ASYNCRL_START_TIME`` (unix time) sets the records' time origin.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from asyncrl.config import ConfigError, load_config, run_dir
from asyncrl.console import LOG_FORMAT


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m asyncrl.learner", description=__doc__)
    p.add_argument("--config", default=None, help="YAML config (default: configs/default.yaml)")
    p.add_argument("--resume", action="store_true", help="restore the last checkpoint of the run")
    p.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. learner.lr=1e-5")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)  # as `asyncrl learn` (asyncrl.console)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"asyncrl.learner: error: {e}", file=sys.stderr)
        return 2
    if not cfg.redis.url:
        print("asyncrl.learner: error: redis.url is required", file=sys.stderr)
        return 2
    from asyncrl.learner.engine import shutdown_distributed
    from asyncrl.learner.loop import learn

    start = float(os.environ.get("ASYNCRL_START_TIME", time.time()))
    try:
        learn(cfg, run_dir(cfg), resume=args.resume, start_time=start)
    finally:
        shutdown_distributed()  # this process owns its rank: tear gloo down before the interpreter does
    return 0


if __name__ == "__main__":
    sys.exit(main())
