"""Helpers for the learner tests: a group producer that samples from the tiny model with HF in fp32.

The producer plays the actor: for each prompt it samples G completions at temperature T and records,
per generated token, the behaviour logprob log_softmax(logits / T)[token] in fp32 and the policy
version that sampled it. The logprobs are recomputed with one teacher-forced forward per completion
(as the learner does), so at equal weights the learner must reproduce them up to kernel rounding.
"""

from __future__ import annotations

import copy
import itertools
import os
import socket
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncrl.buffer import Completion, Group
from asyncrl.config import Config
from asyncrl.tinymodel import EOS, vocab

_ids = itertools.count()


def tiny_config(run_dir: str | Path, redis_url: str = "", run_name: str = "t", **learner: Any) -> Config:
    """A small, fast config for learner tests (fp32, ZeRO-0, tiny model in ``run_dir/model``)."""
    cfg = Config()
    cfg.run.name = run_name
    cfg.run.dir = str(run_dir)
    cfg.run.seed = 0
    cfg.run.max_steps = 0
    cfg.redis.url = redis_url
    cfg.model.tiny.hidden_size = 64
    cfg.model.tiny.num_heads = 2
    cfg.model.tiny.num_kv_heads = 1
    cfg.model.tiny.intermediate_size = 128
    cfg.model.tiny.num_layers = 2
    cfg.actors.group_size = 4
    cfg.actors.max_tokens = 8
    cfg.actors.temperature = 1.0
    cfg.buffer.groups_per_step = 2
    cfg.buffer.max_staleness = 4
    cfg.learner.lr = 1e-3
    cfg.learner.read_block_ms = 200
    cfg.learner.checkpoint_every = 1
    for k, v in learner.items():
        setattr(cfg.learner, k, v)
    return cfg


def sample_groups(
    model: torch.nn.Module,
    n_groups: int,
    group_size: int = 4,
    max_tokens: int = 8,
    temperature: float = 1.0,
    version: int = 0,
    seed: int = 0,
    prompt_len: tuple[int, int] = (3, 6),
) -> list[Group]:
    """Sample ``n_groups`` groups from ``model`` (fp32, eval) with recorded behaviour logprobs.

    Rewards: the fraction of completion characters equal to the prompt's first character (dense,
    varies inside a group so advantages are non-zero).
    """
    v = vocab()
    eos = v[EOS]
    letters = [v[c] for c in "abcd"]
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    model.eval()
    groups = []
    for _ in range(n_groups):
        plen = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        prompt = [letters[i] for i in rng.integers(0, 4, size=plen)]
        comps = []
        for _ in range(group_size):
            seq = list(prompt)
            with torch.no_grad():
                for _ in range(max_tokens):
                    logits = model(input_ids=torch.tensor([seq])).logits[0, -1].float() / temperature
                    tok = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
                    seq.append(tok)
                    if tok == eos:
                        break
                # Behaviour logprobs from one teacher-forced forward (the engine's own numbers).
                logits = model(input_ids=torch.tensor([seq])).logits[0].float() / temperature
                logp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
            toks = seq[plen:]
            lp = logp[plen - 1 :].numpy().astype(np.float32)
            reward = float(np.mean([t == prompt[0] for t in toks]))
            finish = "stop" if toks[-1] == eos else "length"
            comps.append(Completion(np.array(toks, np.uint32), np.minimum(lp, 0.0),
                                    np.full(len(toks), version, np.uint32), reward, finish))  # fmt: skip
        k = next(_ids)
        groups.append(Group(f"g{k}-{seed}", f"p{k}", np.array(prompt, np.uint32), comps, "helper",
                            meta={"temperature": float(temperature)}))  # fmt: skip
    return groups


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


ROOT = Path(__file__).resolve().parents[2]


def child_env() -> dict[str, str]:
    """The environment for a launched rank process: this one's, without a rank of its own, with the
    checkout importable."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}  # fmt: skip
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def dist_env() -> None:
    """Make this test process a single-rank torch.distributed world (idempotent)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))  # fmt: skip


def clone_cfg(cfg: Config, **learner: Any) -> Config:
    out = copy.deepcopy(cfg)
    for k, v in learner.items():
        setattr(out.learner, k, v)
    return out
