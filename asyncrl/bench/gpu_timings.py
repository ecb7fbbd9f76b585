"""The timing half of ``python -m asyncrl.bench.gpu_learner``: step throughput beside bare DeepSpeed and bare
torch, the ZeRO rows with their full-weight publish, and the copy floors (CUDA for meaningful numbers; the
``tiny`` shape runs them on the CPU in the test suite). The models, engines and checks are in
:mod:`asyncrl.bench.gpu_checks`; the sections are run by :mod:`asyncrl.bench.gpu_learner`.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Any

from asyncrl.bench.gpu_checks import Engine, alloc_retries, free, sync

__all__ = ["throughput", "zero_row", "publish_breakdown", "floors"]


def _minis(eng: Engine, groups: list, micro_tokens: int) -> tuple[list, int]:
    """The Trainer's own micro-batches of the step, on the device; and the loss-token count."""
    from asyncrl.learner.batching import collate, plan_mini_batch

    samples, _ = eng.trainer.samples(groups)
    plan = plan_mini_batch([s.length for s in samples], list(range(len(samples))), 1, micro_tokens)[0]
    dev = eng.trainer.device
    return [{k: v.to(dev) for k, v in collate(samples, ix, 0).items()} for ix in plan], sum(
        s.length for s in samples
    )


def throughput(
    eng: Engine,
    model_path: Path,
    groups: list,
    micro_tokens: int,
    steps: int,
    small_tokens: int | None = None,
) -> dict[str, Any]:
    """Trainer step vs bare DeepSpeed (same DeepSpeed config) vs bare torch (bf16 autocast), in blocks.

    ``small_tokens``: also the Trainer, bare DeepSpeed and bare torch at that micro-batch budget (one
    sequence): the same tokens in many more micro-batches, which measures the cost per micro-batch on
    each side. Bare torch accumulates in the parameters' own fp32 ``.grad`` with no DeepSpeed hooks, so
    if its per-micro-batch cost matches bare DeepSpeed's the cost is the model's (small GEMMs, the
    vocabulary head), and if it is far below, it is DeepSpeed's per-parameter accumulation.
    """
    import deepspeed
    import torch

    from asyncrl.bench.learner import _bare_loss, _param_groups
    from asyncrl.learner.engine import ds_config
    from asyncrl.learner.logprobs import load_hf_model

    lc = eng.cfg.learner
    adam = dict(lr=lc.lr, betas=(lc.adam_beta1, lc.adam_beta2), eps=lc.adam_eps)
    mbs, tokens = _minis(eng, groups, micro_tokens)
    ds_model = load_hf_model(model_path, torch.float32).train()
    ds_opt = torch.optim.AdamW(_param_groups(ds_model, lc.weight_decay), fused=True, **adam)
    ds_engine, _, _, _ = deepspeed.initialize(
        model=ds_model, optimizer=ds_opt, config=ds_config(eng.cfg, False)
    )
    dev = eng.trainer.device
    pt_model = load_hf_model(model_path, torch.float32).to(dev).train()
    pt_opt = torch.optim.AdamW(_param_groups(pt_model, lc.weight_decay), fused=True, **adam)
    # The Trainer at the same micro-batch budget as the bare loops (the engine's config holds the
    # gradient section's one-sequence budget: with it the step measured 5x, 32 micro-batches for 4).
    alone = eng.trainer_with(micro_batch_tokens=micro_tokens)
    entropy = eng.trainer_with(micro_batch_tokens=micro_tokens, entropy_metric=True)

    def bare_ds(cut: list | None = None) -> None:
        cut = mbs if cut is None else cut
        for k, mb in enumerate(cut):
            ds_engine.set_gradient_accumulation_boundary(k == len(cut) - 1)
            ds_engine.backward(_bare_loss(ds_engine, mb), scale_wrt_gas=False)
        ds_engine.step()

    def bare_torch(cut: list | None = None) -> None:
        for mb in mbs if cut is None else cut:
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = _bare_loss(pt_model, mb)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(pt_model.parameters(), lc.grad_clip)
        pt_opt.step()
        pt_opt.zero_grad(set_to_none=True)

    last: dict[str, Any] = {}

    def alone_step() -> None:
        last["alone"] = alone.train(groups, 0)

    fns = {"alone": alone_step, "alone_entropy_metric": lambda: entropy.train(groups, 0),
           "bare_deepspeed": bare_ds, "bare_torch_autocast": bare_torch}  # fmt: skip
    small_mbs: list = []
    if small_tokens:
        small_mbs = _minis(eng, groups, small_tokens)[0]
        small = eng.trainer_with(micro_batch_tokens=small_tokens)

        def alone_small() -> None:
            last["alone_small"] = small.train(groups, 0)

        fns.update(alone_small_micro=alone_small, bare_deepspeed_small_micro=lambda: bare_ds(small_mbs),
                   bare_torch_autocast_small_micro=lambda: bare_torch(small_mbs))  # fmt: skip
    eng.grads = None  # the gradient section's capture: 4 bytes/parameter of device memory
    times: dict[str, list[float]] = {k: [] for k in fns}
    retries = dict.fromkeys(fns, 0)  # caching-allocator retries (free everything, malloc again): thrash
    peak = dict.fromkeys(fns, 0)
    rounds, warm = 3, 1
    block = max(1, -(-steps // rounds))
    for _ in range(rounds):
        for k, fn in fns.items():
            for i in range(warm + block):
                sync()
                r0 = alloc_retries()
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()
                t = time.perf_counter()
                fn()
                sync()
                if i >= warm:
                    times[k].append(time.perf_counter() - t)
                    retries[k] += alloc_retries() - r0
                    if torch.cuda.is_available():
                        peak[k] = max(peak[k], torch.cuda.max_memory_allocated())
    ds_engine.destroy()
    free()
    out: dict[str, Any] = {f"{k}_s": statistics.median(v) for k, v in times.items()}
    out["times"] = times
    out["alloc_retries"] = retries
    out["peak_bytes"] = peak
    out["tokens"] = tokens
    out["micro_batches"] = len(mbs)
    out["alone_micro_batches"] = last["alone"].micro_batches
    if out["alone_micro_batches"] != len(mbs):  # the sides must do the same work
        raise AssertionError(
            f"Trainer ran {out['alone_micro_batches']} micro-batches, the bare loops {len(mbs)}"
        )
    out["ratio_alone_vs_deepspeed"] = out["alone_s"] / out["bare_deepspeed_s"]
    out["ratio_alone_vs_torch_autocast"] = out["alone_s"] / out["bare_torch_autocast_s"]
    if small_mbs:
        out["small_micro_batches"] = len(small_mbs)
        if last["alone_small"].micro_batches != len(small_mbs):
            raise AssertionError("the small-cut Trainer and bare loops ran different micro-batches")
        out["ratio_alone_vs_deepspeed_small_micro"] = (
            out["alone_small_micro_s"] / out["bare_deepspeed_small_micro_s"]
        )
        # Seconds per extra micro-batch on each side (same tokens, more micro-batches).
        extra = len(small_mbs) - len(mbs)
        for side in ("alone", "bare_deepspeed", "bare_torch_autocast"):
            out[f"{side}_per_extra_micro_batch_s"] = (out[f"{side}_small_micro_s"] - out[f"{side}_s"]) / max(
                extra, 1
            )
    return out


def zero_row(cfg: Any, model_path: Path, groups: list, steps: int, root: Path) -> dict[str, Any]:
    """Step time of one ZeRO stage and its full-weight publish (file and shm) against the floors."""
    from asyncrl.learner.publisher import FilesystemTransport, ShmTransport

    eng = Engine(cfg, model_path)
    times = []
    for i in range(1 + steps):
        sync()
        t = time.perf_counter()
        r = eng.trainer.train(groups, 0)
        sync()
        if i:
            times.append(time.perf_counter() - t)
    finite = r.skipped == 0 and all(math.isfinite(g) for g in r.grad_norms)
    row: dict[str, Any] = {
        "step_s": statistics.median(times),
        "finite": finite,
        "grad_norm": r.grad_norms[-1],
    }
    for name, cls, where in (("file", FilesystemTransport, root / "weights"),
                             ("shm", ShmTransport, Path("/dev/shm") / f"asyncrl-gpu-bench-{root.name}")):  # fmt: skip
        tr = cls(where)
        try:
            pub = []
            for v in range(3):
                sync()
                t = time.perf_counter()
                m = tr.publish(v, eng.le.named_weights, eng.le.dtype_name)
                pub.append(time.perf_counter() - t)
                tr.delete(v - 1) if v else None
            row[f"publish_{name}_s"] = min(pub)
            row["bytes"] = m.size
            row[f"publish_{name}_bitwise"] = _file_matches(m.path, eng)
        finally:
            tr.delete(2)
            if isinstance(tr, ShmTransport):
                tr.cleanup()
    row.update(publish_breakdown(eng, root))
    row.update(nccl_source(eng))
    row["tokens"] = sum(len(c.token_ids) + len(g.prompt_token_ids) for g in groups for c in g.completions)
    eng.close()
    del eng
    free()
    return row


def nccl_source(eng: Engine) -> dict[str, Any]:
    """What the NCCL transport broadcasts from (``named_weights(None)``, ``weights_device = None``): every
    tensor on the policy's own device, bitwise the weights a host publish writes, and at ZeRO 0-2 the
    live parameters themselves (no copy), at ZeRO-3 a copy of each gathered parameter."""
    import torch

    host = {k: v.clone() for k, v in eng.le.named_weights()}  # the host stage's views: valid until reused
    live = {n: p.data_ptr() for n, p in eng.le.module.named_parameters()}
    sync()
    t = time.perf_counter()
    for _n, _v in eng.le.named_weights(None):  # what a broadcast iterates (ZeRO-3: gather + copy each)
        pass
    sync()
    out: dict[str, Any] = {"nccl_source_s": time.perf_counter() - t}
    devices, equal, shared, n = set(), True, 0, 0
    for k, v in eng.le.named_weights(None):
        devices.add(str(v.device))
        equal = equal and k in host and v.dtype == host[k].dtype and torch.equal(v.to("cpu"), host[k])
        shared += int(v.data_ptr() == live.get(k))
        n += 1
    zero = eng.le.zero_stage
    out.update(nccl_source_devices=sorted(devices), nccl_source_bitwise=equal and n == len(host),
               nccl_source_shared=shared, nccl_source_tensors=n)  # fmt: skip
    out["nccl_source_ok"] = (devices == {str(eng.le.device)} and out["nccl_source_bitwise"]
                             and shared == (n if zero < 3 else 0))  # fmt: skip
    return out


def publish_breakdown(eng: Engine, root: Path) -> dict[str, float]:
    """Where a file publish goes: gather to host, write (no hash, no fsync), sha256 alone, fsync."""
    import hashlib
    import os

    import torch

    from asyncrl.learner.publisher import write_safetensors

    sync()
    t = time.perf_counter()
    pageable = {k: v.to("cpu") for k, v in eng.le.named_weights(None)}  # a .to("cpu") per tensor
    out = {"gather_pageable_s": time.perf_counter() - t}
    del pageable
    sync()
    t = time.perf_counter()
    tensors = {k: v.contiguous() for k, v in eng.le.named_weights()}  # what a publish gathers
    out.update(gather_s=time.perf_counter() - t, tensors=len(tensors), staged_pinned=eng.le.host_stage.pinned)
    path = root / "breakdown.safetensors"
    t = time.perf_counter()
    write_safetensors(path, tensors, {}, digest=False, fsync=False)
    out["write_s"] = time.perf_counter() - t
    t = time.perf_counter()
    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(memoryview(tensors[k].reshape(-1).view(torch.uint8).numpy()))
    out["sha256_s"] = time.perf_counter() - t
    t = time.perf_counter()
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    out["fsync_s"] = time.perf_counter() - t
    path.unlink()
    return out


def _file_matches(path: str, eng: Engine) -> bool:
    """Is the published file bitwise the policy's weights (every name, shape, dtype and byte)?"""
    import torch
    from safetensors.torch import load_file

    on_file = load_file(path)
    live = {k: v.to("cpu") for k, v in eng.le.named_weights(None) if k in on_file}
    return on_file.keys() == live.keys() and all(
        on_file[k].dtype == v.dtype and on_file[k].shape == v.shape and torch.equal(on_file[k], v)
        for k, v in live.items()
    )


def floors(nbytes: int) -> dict[str, float]:
    """Copy floors for ``nbytes``: host memcpy, and device-to-host into pinned memory (CUDA only)."""
    import torch

    from asyncrl.bench.weights import copy_bandwidth

    out = {"host_copy_s": nbytes / copy_bandwidth()}
    if torch.cuda.is_available():
        n = min(nbytes, 1 << 30)
        src = torch.empty(n, dtype=torch.uint8, device="cuda")
        dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        best = float("inf")
        for _ in range(5):
            sync()
            t = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            sync()
            best = min(best, time.perf_counter() - t)
        out["d2h_s"] = nbytes / (n / best)
        del src, dst
        free()
    return out
