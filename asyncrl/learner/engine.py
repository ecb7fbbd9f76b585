"""DeepSpeed setup: process group, the guarded AdamW, the engine, one optimizer step, full weights.

Choices and why:

* The optimizer is a client ``torch.optim.AdamW`` subclass passed to ``deepspeed.initialize``, so no
  DeepSpeed op is JIT-built for it (FusedAdam / CPUAdam would be). On CPU DeepSpeed still JIT-builds
  its small shared-memory comm op once (cached in ~/.cache/torch_extensions).
* The AdamW is torch's fused kernel (``fused=True``; CPU and CUDA): the same update as the per-tensor
  loop to ~1 ulp (2.4e-7 on the demo's weights after 50 steps), a third of its time. With one rank and
  ZeRO-0 fp32 DeepSpeed's backward all-reduce is switched off: over one rank it is a flatten, an
  identity reduction and a copy back, bitwise the same gradients.
* Gradient accumulation is driven explicitly: ``gradient_accumulation_steps = 1`` in the config,
  ``engine.set_gradient_accumulation_boundary(k == last)`` before each micro-batch and
  ``engine.backward(loss, scale_wrt_gas=False)``. A step can then have any number of micro-batches
  (it varies with the data); the loss is scaled by ``deepspeed_loss_scale(1, world_size)`` to undo
  DeepSpeed's data-parallel gradient averaging (see asyncrl.learner.reduction).
* bf16: fp32 master weights, and fp32 gradient accumulation and data-parallel reduction
  (``data_types.grad_accum_dtype`` / ``communication_data_type``), which DeepSpeed provides through its
  ZeRO optimizers; a configured ZeRO-0 therefore runs as ZeRO-1 under bf16 (see :func:`ds_config`).
* Non-finite skip, one rule for every ZeRO stage and dtype: before ``engine.step()`` every rank
  all-reduces (MAX) its "saw a non-finite loss" flag and sets :attr:`GuardedAdamW.veto`; the base
  optimizer's ``step`` then returns without touching weights or optimizer state. Non-finite
  *gradients* are caught by DeepSpeed's own global overflow check where it has one (ZeRO 1-3, bf16)
  and by the guard itself for ZeRO-0 fp32, where DeepSpeed hands it the full (all-reduced,
  identical on every rank) gradients. In all cases every rank decides the same way.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.learner.host_stage import HostStage
from asyncrl.learner.logprobs import DTYPES, load_hf_model

__all__ = [
    "init_distributed",
    "GuardedAdamW",
    "LearnerEngine",
    "build_engine",
    "ds_config",
    "StepOutcome",
    "pad_id",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(timeout_s: float = 7200.0) -> tuple[int, int]:
    """Initialise torch.distributed via DeepSpeed (gloo on CPU, nccl on CUDA); returns (rank, world).

    A process started without launcher variables becomes a single rank (RANK=0, WORLD_SIZE=1 on a
    free local port). Already initialised (tests, an embedding program): reused as is. The long
    timeout covers data-parallel ranks waiting in a broadcast while rank 0 waits for rollouts.
    """
    import deepspeed

    from .ext_locks import clear_stale_extension_locks

    # DeepSpeed loads its CPU ops under a torch build lock that a learner stopped during the load
    # leaves behind; every later load would wait on it for ever (asyncrl.learner.ext_locks).
    clear_stale_extension_locks()
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        kw: dict[str, Any] = {}
        if os.environ.get("WORLD_SIZE") == "1":
            # One rank: its store binds port 0 (the kernel's choice) instead of MASTER_PORT, a port found
            # free earlier and bound only now, which another process can take in between (EADDRINUSE:
            # a CI failure of the learner bench). Nobody else connects to a one-rank group.
            kw = {"init_method": "tcp://127.0.0.1:0", "rank": 0, "world_size": 1}
        deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=timeout_s), **kw)
    return dist.get_rank(), dist.get_world_size()


def shutdown_distributed() -> None:
    """Destroy the process group before the interpreter exits (a no-op when there is none).

    A process that owns its ranks (``python -m asyncrl.learner``, ``asyncrl learn``) calls this last.
    Without it gloo's worker threads are torn down during interpreter finalisation, and a rank that
    exits while its peer still runs can die with ``terminate called without an active exception``
    (SIGABRT; pytorch/pytorch#190489): seen once in CI on a 2-rank ZeRO-3 run after its last step.
    Local only (no collective), so it is safe on an error path whatever the peers are doing.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class GuardedAdamW(torch.optim.AdamW):
    """AdamW whose ``step`` can be vetoed, and which guards/clips full gradients when asked.

    ``veto`` (set by :meth:`LearnerEngine.optimizer_step` from an all-reduced flag) makes ``step``
    a no-op: weights and optimizer state (moments, step counts) stay bitwise unchanged.
    ``check_grads`` (only where this optimizer sees full, replicated gradients: ZeRO-0 fp32):
    computes the global norm, skips on a non-finite one, and clips to ``clip`` (0 = off).
    ``stepped`` tells the caller whether any update was applied since it was reset.
    """

    def __init__(self, params: Any, *, check_grads: bool = False, clip: float = 0.0, **kw: Any) -> None:
        super().__init__(params, **kw)
        self.veto = False
        self.check_grads = check_grads
        self.clip = clip
        self.stepped = False
        self.last_grad_norm: float | None = None

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if self.veto:
            return None
        if self.check_grads:
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            # One foreach call for the per-tensor norms (the same per-tensor kernel as a loop of
            # vector_norm, so the same values; on CPU the loop runs in C++ instead of Python).
            norm = float(torch.linalg.vector_norm(torch.stack(grad_norms(grads)))) if grads else 0.0
            self.last_grad_norm = norm
            if not math.isfinite(norm):
                return None
            if self.clip > 0 and norm > self.clip:
                coef = self.clip / (norm + 1e-6)  # same rule as torch.nn.utils.clip_grad_norm_
                torch._foreach_mul_(grads, coef)
        out = super().step(closure)
        self.stepped = True
        return out


def grad_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-tensor L2 norms in fp32 (``vector_norm(g.float())`` of each), one foreach call per dtype."""
    fp32 = all(g.dtype == torch.float32 for g in grads)
    return list(torch._foreach_norm(grads if fp32 else [g.float() for g in grads]))


@dataclass
class StepOutcome:
    applied: bool  # the optimizer update happened
    vetoed: bool  # some rank saw a non-finite loss
    grad_norm: float  # pre-clip global norm (inf/nan when non-finite; nan if unknown)


def ds_config(cfg: Any, guard_clips: bool) -> dict[str, Any]:
    """The DeepSpeed config of the learner (see the module docstring for why it looks like this)."""
    lc = cfg.learner
    conf: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0 if guard_clips else float(lc.grad_clip),
        "zero_optimization": {"stage": int(lc.zero_stage)},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if cfg.model.dtype == "bfloat16":
        # bf16 compute weights, fp32 master weights and optimizer state; skip steps on overflow.
        conf["bf16"] = {"enabled": True, "check_grad_overflow": True}
        # Gradients accumulate over micro-batches and are all-reduced over ranks in fp32: bf16 sums
        # lose ~3 significant digits per add, which swamps small per-token contributions.
        conf["data_types"] = {"grad_accum_dtype": "fp32"}
        conf["communication_data_type"] = "fp32"
        # DeepSpeed (0.19) implements fp32 accumulation for bf16 only in its ZeRO optimizers (stage 1:
        # BF16_Optimizer); ZeRO-0 bf16 would accumulate in bf16. Stage 1 on one rank is stage 0's memory.
        conf["zero_optimization"]["stage"] = max(1, int(lc.zero_stage))
    return conf


class LearnerEngine:
    """The DeepSpeed engine of the policy plus what the step and the publisher need from it."""

    def __init__(self, engine: Any, optimizer: GuardedAdamW, cfg: Any) -> None:
        self.engine = engine
        self.optimizer = optimizer
        self.cfg = cfg
        self.zero_stage = int(cfg.learner.zero_stage)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.dtype = next(engine.module.parameters()).dtype
        self.dtype_name = {v: k for k, v in DTYPES.items()}[self.dtype]
        #: Rank 0's host buffer for a CUDA policy's published weights (allocated on first publish).
        self.host_stage = HostStage(pin=True)

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def device(self) -> torch.device | str:
        """Where the policy's micro-batches go (a reference model must sit there too)."""
        return getattr(self.engine, "device", "cpu")

    def set_lr(self, lr: float) -> None:
        # The base optimizer's param_groups are the ones every ZeRO wrapper steps with.
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def optimizer_step(self, local_nonfinite: bool) -> StepOutcome:
        """End of an accumulation: agree on the veto across ranks, then ``engine.step()``."""
        # On the engine's device: NCCL only reduces device tensors (gloo: CPU).
        vetoed = local_nonfinite
        if self.world_size > 1:
            flag = torch.tensor(
                [1.0 if local_nonfinite else 0.0], device=getattr(self.engine, "device", "cpu")
            )
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            vetoed = bool(flag.item() > 0)
        self.optimizer.veto = vetoed
        self.optimizer.stepped = False
        self.optimizer.last_grad_norm = None
        try:
            self.engine.step()
        finally:
            self.optimizer.veto = False
        applied = self.optimizer.stepped
        if self.optimizer.check_grads:
            norm = self.optimizer.last_grad_norm
        else:
            norm = self.engine.get_global_grad_norm()
        norm = float("nan") if norm is None else float(norm)
        return StepOutcome(applied=applied, vetoed=vetoed, grad_norm=norm)

    def named_weights(self, device: str | None = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
        """Full ``(HF name, tensor)`` pairs of the policy in the module dtype.

        ``device="cpu"``: host copies (what the file and shm transports write). A CUDA policy's are
        views of :attr:`host_stage`, one pinned buffer reused by every publish: valid until the next
        call (the transports write them out before they return). ``None``: on the module's own
        device, for a transport that reads them at once (NCCL): ZeRO 0-2 yield the live parameters
        themselves (no copy; valid until the next optimizer step), ZeRO-3 a device copy of each
        gathered parameter (its gathered storage is freed when the gather ends). Either way a CUDA
        policy never makes the GPU -> host -> GPU round trip the NCCL path once paid.

        Every rank must iterate it to the end (ZeRO-3 all-gathers one parameter at a time);
        tensors are only materialised on rank 0 (other ranks get empty tensors).
        """
        module = self.module
        where = next(module.parameters()).device
        staged = device == "cpu" and where.type == "cuda"
        if self.zero_stage < 3:
            if self.rank != 0:
                yield from ((k, torch.empty(0)) for k in module.state_dict())
            elif staged:
                sd = module.state_dict()
                views = self.host_stage.views([(k, v.shape, v.dtype) for k, v in sd.items()])
                for k, v in sd.items():  # queued on the stream; the host waits once, below
                    views[k].copy_(v.detach(), non_blocking=True)
                torch.cuda.current_stream(where).synchronize()  # the policy's device, whichever is current
                yield from views.items()
            else:
                yield from (
                    (k, _placed(v.detach(), device, live=True)) for k, v in module.state_dict().items()
                )
            return
        import deepspeed

        params = dict(module.named_parameters())
        # A persistent buffer, or a tied alias of a parameter yielded already, is left out.
        names = [n for n in module.state_dict() if n in params]
        if staged and self.rank == 0:
            views = self.host_stage.views([(n, params[n].ds_shape, params[n].dtype) for n in names])
        for name in names:
            p = params[name]
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                if self.rank != 0:
                    t = torch.empty(0)
                elif staged:
                    # Synchronous: the gathered storage is freed when the gather ends, and ZeRO-3's
                    # next all-gather may reuse it from another stream. Pinned, the copy is DMA.
                    t = views[name]
                    t.copy_(p.detach())
                else:
                    t = _placed(p.detach(), device, live=False)
            yield name, t


def _placed(t: torch.Tensor, device: str | None, *, live: bool) -> torch.Tensor:
    """``t`` on ``device`` (None: where it is), never sharing storage with ``t`` unless ``live`` and
    ``device`` is None. A copy to another device is already a new tensor: no second copy (a CUDA
    policy's ``.to("cpu").clone()`` copied every byte twice)."""
    if device is None:
        return t if live else t.clone()
    if t.device == torch.device(device):
        return t.clone()
    return t.to(device)


def pad_id(model_config: Any) -> int:
    """The token id the learner pads micro-batches with (masked out everywhere, so any id of the vocabulary
    does): the model's pad id, else its end-of-sequence id, else 0. ``eos_token_id`` may be a list
    (Llama-3-Instruct's config.json lists three and has no pad id): its first entry."""
    pad = getattr(model_config, "pad_token_id", None)
    if pad is None:
        pad = getattr(model_config, "eos_token_id", None)
    if isinstance(pad, list | tuple):
        pad = pad[0] if pad else None
    return int(pad or 0)


def build_engine(cfg: Any, model_path: str | Path) -> LearnerEngine:
    """Load the policy (fp32 from disk; DeepSpeed casts to bf16 when configured) and wrap it."""
    import deepspeed

    init_distributed()
    lc = cfg.learner
    model = load_hf_model(model_path, torch.float32)
    model.train()
    # Decay matrices only: decaying norms and biases hurts and is not what AdamW recipes do.
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": lc.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    guard_clips = int(lc.zero_stage) == 0 and cfg.model.dtype == "float32"
    opt = GuardedAdamW(
        groups,
        lr=lc.lr,
        betas=(lc.adam_beta1, lc.adam_beta2),
        eps=lc.adam_eps,
        check_grads=guard_clips,
        clip=float(lc.grad_clip) if guard_clips else 0.0,
        fused=True,  # one kernel over all tensors: 0.66 -> 0.19 ms per demo step (per-tensor loop)
    )
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(cfg, guard_clips))
    if guard_clips and dist.get_world_size() == 1:
        # One rank, ZeRO-0 fp32: DeepSpeed's gradient all-reduce would flatten every gradient, reduce
        # it over one rank, scale it by 1 and copy it back (~1 ms per demo step): an exact identity.
        engine.enable_backward_allreduce = False
    engine.train()
    return LearnerEngine(engine, opt, cfg)
