"""The correctness half of ``python -m asyncrl.bench.gpu_learner``: models, batches and engines, and
the checks of the bf16 learner path (precision, fp32 gradient accumulation, the non-finite guard).

A random-init model of a real shape is built with bf16-representable weights, so the fp32 reference
engine and the bf16 engine compute from identical values. The engines are asyncrl's own
(:func:`asyncrl.learner.engine.build_engine` + :class:`asyncrl.learner.step.Trainer`); the only
instrumentation is a wrapper that reads the full fp32 gradient DeepSpeed hands the optimizer
(``deepspeed.utils.safe_get_full_grad``) just before ``engine.step``, and, for the accumulation
check, autograd hooks that sum each micro-batch's gradient in float64 and in bf16.
"""

from __future__ import annotations

import dataclasses
import gc
import math
from pathlib import Path
from typing import Any

__all__ = ["SHAPES", "BATCHES", "LIMITS", "PEAK_BF16_TFLOPS", "Engine", "build_model", "make_groups", "config",
           "compare", "fill_behaviour_logprobs", "logprob_precision", "reference_checks", "guard_checks", "sync",
           "alloc_retries", "free"]  # fmt: skip

#: Qwen2-architecture shapes (untied embeddings, as the tiny demo model: one tensor per name).
SHAPES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=384),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936),
}  # fmt: skip
#: The gradient checks' step: groups x group_size sequences of prompt + completion tokens, cut into one
#: micro-batch and into micro-batches of ``micro_tokens`` (one sequence: the most bf16 additions). The
#: throughput step: ``tp_groups`` groups in micro-batches of ``tp_micro_tokens`` (one [tokens x vocab]
#: fp32 logits tensor of a 150k vocabulary is 4.9 GB at 8192 tokens; at 0.5B the three models of the
#: throughput section then peaked at 54-58 GB of an 80 GB H100 with no allocator retry, at 1.5B they
#: do not fit: run that shape with ``--skip gradient,guard,throughput``).
BATCHES: dict[str, dict[str, int]] = {
    "tiny": dict(
        groups=2, group_size=4, prompt=12, completion=36, micro_tokens=48, tp_groups=2, tp_micro_tokens=96
    ),
    "real": dict(
        groups=2,
        group_size=4,
        prompt=128,
        completion=896,
        micro_tokens=1024,
        tp_groups=8,
        tp_micro_tokens=8192,
    ),
}
#: Pass limits. The bf16 forward itself moves the gradient by ~1e-2 relative on a random-init model;
#: fp32 accumulation of K bf16 gradients is exact to ~K * 2^-24 (bf16 sums: ~2^-9); fp32 cut in two ways
#: agrees to ~1e-6.
LIMITS = {"bf16_grad_rel_err": 0.1, "bf16_grad_cosine": 0.99, "accumulation_rel_err": 1e-5, "fp32_cut_rel_err": 1e-4,
          "logp_fp32_vs_fp64": 1e-4}  # fmt: skip
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense bf16, SXM data sheets


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def alloc_retries() -> int:
    import torch

    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0)) if torch.cuda.is_available() else 0


def free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build_model(path: Path, shape: str, seed: int) -> int:
    """Save a random-init Qwen2 model of ``shape`` whose fp32 weights are bf16-representable; returns N."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    conf = Qwen2Config(**SHAPES[shape], tie_word_embeddings=False, max_position_embeddings=4096,
                       pad_token_id=0, eos_token_id=1, bos_token_id=1, use_cache=False)  # fmt: skip
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(dev):
        model = Qwen2ForCausalLM(conf)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    model.to("cpu").save_pretrained(str(path))
    return sum(p.numel() for p in model.parameters())


def make_groups(shape: str, batch: dict[str, int], seed: int) -> list:
    """Random prompts and completions ending in EOS, rewards in {0, 1}; logprobs filled in later."""
    import numpy as np

    from asyncrl.buffer import Completion, Group

    rng = np.random.default_rng(seed)
    vocab = SHAPES[shape]["vocab_size"]
    groups = []
    for g in range(batch["groups"]):
        comps = []
        for _ in range(batch["group_size"]):
            toks = rng.integers(2, vocab, batch["completion"]).astype(np.uint32)
            toks[-1] = 1  # EOS: "stop", every token carries loss
            comps.append(Completion(token_ids=toks, logprobs=np.zeros(batch["completion"], np.float32),
                                    versions=np.zeros(batch["completion"], np.uint32),
                                    reward=float(rng.integers(0, 2)), finish_reason="stop"))  # fmt: skip
        prompt = rng.integers(2, vocab, batch["prompt"]).astype(np.uint32)
        groups.append(Group(group_id=f"g{g}", prompt_id=f"p{g}", completions=comps, prompt_token_ids=prompt,
                            meta={"temperature": 1.0}))  # fmt: skip
    return groups


def config(dtype: str, zero: int, micro_tokens: int, batch: dict[str, int], **learner: Any) -> Any:
    from asyncrl.config import load_config

    over = [f"model.dtype={dtype}", f"learner.zero_stage={zero}", f"learner.micro_batch_tokens={micro_tokens}",
            "learner.epochs=1", "learner.mini_batches=1", f"buffer.groups_per_step={batch['groups']}",
            f"actors.group_size={batch['group_size']}", f"actors.max_tokens={batch['completion']}",
            # the bench's model comes from its own path; the tiny model's limits only gate the length check
            f"model.max_model_len={batch['prompt'] + batch['completion']}",
            f"model.tiny.max_position_embeddings={max(256, batch['prompt'] + batch['completion'])}",
            "learner.warmup_steps=0", "learner.entropy_metric=false"]  # fmt: skip
    over += [f"learner.{k}={v}" for k, v in learner.items()]
    return load_config(None, over)


class Engine:
    """A learner engine + Trainer on the model, with the step's full fp32 gradient captured."""

    def __init__(self, cfg: Any, model_path: Path) -> None:
        from asyncrl.learner.engine import build_engine
        from asyncrl.learner.step import Trainer

        self.cfg = cfg
        self.le = build_engine(cfg, model_path)
        self.trainer = Trainer(cfg, self.le, None, 0)
        self.grads: dict[str, Any] | None = None
        self.capture = False
        step = self.le.optimizer_step

        def optimizer_step(nonfinite: bool) -> Any:
            if self.capture:
                from deepspeed.utils import safe_get_full_grad

                self.grads = {n: safe_get_full_grad(p).detach().float().clone()
                              for n, p in self.le.module.named_parameters()}  # fmt: skip
            return step(nonfinite)

        self.le.optimizer_step = optimizer_step  # type: ignore[method-assign]

    def trainer_with(self, **learner: Any) -> Any:
        from asyncrl.learner.step import Trainer

        cfg = dataclasses.replace(self.cfg, learner=dataclasses.replace(self.cfg.learner, **learner))
        return Trainer(cfg, self.le, None, 0)

    def step_grads_lr0(self, groups: list, micro_tokens: int, sums: dict | None = None) -> dict[str, Any]:
        """The step's full gradient; at lr 0, so the weights stay put (AdamW: p -= 0 * m / d).

        ``sums``: filled with each parameter's micro-batch gradients (as autograd hands them to
        DeepSpeed, in the module dtype) summed in float64 (``"exact"``) and in bf16 (``"bf16"``).
        """
        import torch

        hooks = []
        if sums is not None:
            exact, bf = sums.setdefault("exact", {}), sums.setdefault("bf16", {})

            def hook(g: Any, n: str) -> None:
                exact[n] = exact[n] + g.double() if n in exact else g.double()
                gb = g.to(torch.bfloat16)
                bf[n] = (bf[n] + gb).to(torch.bfloat16) if n in bf else gb

            for n, p in self.le.module.named_parameters():
                hooks.append(p.register_hook(lambda g, n=n: hook(g, n)))
        self.capture = True
        try:
            self.trainer_with(micro_batch_tokens=micro_tokens, lr=0.0).train(groups, 0)
        finally:
            self.capture = False
            for h in hooks:
                h.remove()
        assert self.grads is not None
        return self.grads

    def master(self) -> dict[str, Any]:
        """fp32 master weights (ZeRO's high-precision copy; the parameter itself without one)."""
        from deepspeed.utils import safe_get_full_fp32_param

        out = {}
        for n, p in self.le.module.named_parameters():
            hp = safe_get_full_fp32_param(p)
            out[n] = (hp if hp is not None else p).detach().clone()
        return out

    def close(self) -> None:
        self.le.engine.destroy()
        del self.le, self.trainer
        free()


def compare(g: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    """Global relative L2 error and cosine of ``g`` against ``ref`` (float64)."""
    diff = sum(float((g[k].double() - ref[k].double()).pow(2).sum()) for k in ref)
    nr = sum(float(ref[k].double().pow(2).sum()) for k in ref)
    ng = sum(float(g[k].double().pow(2).sum()) for k in ref)
    dot = sum(float((g[k].double() * ref[k].double()).sum()) for k in ref)
    return {"rel_err": math.sqrt(diff / max(nr, 1e-300)), "cosine": dot / max(math.sqrt(nr * ng), 1e-300)}


def fill_behaviour_logprobs(eng: Engine, groups: list, micro_tokens: int) -> None:
    """Behaviour logprobs = this model's own (an actor at equal weights: ratios ~1, nothing masked)."""
    import torch

    from asyncrl.learner.batching import collate, plan_mini_batch
    from asyncrl.learner.logprobs import token_logprobs

    samples, _ = eng.trainer.samples(groups)
    lengths = [s.length for s in samples]
    plan = plan_mini_batch(lengths, list(range(len(samples))), 1, micro_tokens)[0]
    comps = [c for g in groups for c in g.completions]
    assert len(comps) == len(samples)
    with torch.no_grad():
        for ix in plan:
            mb = {k: v.to(eng.trainer.device) for k, v in collate(samples, ix, 0).items()}
            logp, _ = token_logprobs(eng.le.engine, mb, entropy=False)
            for row, i in enumerate(ix):
                n, start = len(comps[i].token_ids), samples[i].prompt_len
                comps[i].logprobs[:] = logp[row, start : start + n].float().cpu().numpy()


def logprob_precision(bf16: Engine, fp32: Engine, groups: list, micro_tokens: int) -> dict[str, float]:
    import torch

    from asyncrl.learner.batching import LOSS_MASK, collate, plan_mini_batch
    from asyncrl.learner.logprobs import token_logprobs

    samples, _ = bf16.trainer.samples(groups)
    ix = plan_mini_batch([s.length for s in samples], list(range(len(samples))), 1, micro_tokens)[0][0]
    mb = {k: v.to(bf16.trainer.device) for k, v in collate(samples, ix, 0).items()}
    mask = mb[LOSS_MASK].bool()
    with torch.no_grad():
        lb, _ = token_logprobs(bf16.le.engine, mb, entropy=False)
        lf, _ = token_logprobs(fp32.le.engine, mb, entropy=False)
        out = bf16.le.engine(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False)
        tgt = mb["input_ids"][:, 1:, None]
        l32 = torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, tgt)[..., 0]
        l64 = torch.log_softmax(out.logits[:, :-1].double(), -1).gather(-1, tgt)[..., 0]
        d = (lb - lf)[mask].double()
        k3 = (torch.exp(d) - 1 - d).mean()  # k3 of the log-ratio, as the learner's mismatch_kl
    return {"logp_bf16_vs_fp32_mean_abs": float(d.abs().mean()), "logp_bf16_vs_fp32_max_abs": float(d.abs().max()),
            "mismatch_kl_k3": float(k3), "logp_fp32_vs_fp64_max_abs": float((l32.double() - l64).abs().max())}  # fmt: skip


def reference_checks(eng: Engine, model_path: Path, groups: list, micro_tokens: int) -> dict[str, Any]:
    """The reference model on the policy's device and precision path (learn()'s ReferenceModel).

    At equal weights (``eng`` has only taken lr-0 steps) the reference logprobs must equal the
    policy's: same dtype, device and :func:`token_logprobs`, so any difference is a second precision
    path. Then one Trainer step with the reference-KL term on (lr 0): finite, nothing skipped, and
    its KL 0 up to the difference measured.
    """
    import torch

    from asyncrl.learner.batching import LOSS_MASK, collate, plan_mini_batch
    from asyncrl.learner.logprobs import ReferenceModel, token_logprobs
    from asyncrl.learner.step import Trainer

    ref = ReferenceModel(model_path, eng.le.dtype, eng.le.device)
    samples, _ = eng.trainer.samples(groups)
    plan = plan_mini_batch([s.length for s in samples], list(range(len(samples))), 1, micro_tokens)[0]
    diff, tokens = 0.0, 0
    with torch.no_grad():
        for ix in plan:
            mb = {k: v.to(eng.trainer.device) for k, v in collate(samples, ix, 0).items()}
            mask = mb[LOSS_MASK].bool()
            lp, _ = token_logprobs(eng.le.engine, mb, entropy=False)
            lr = ref.logprobs(mb)
            diff = max(diff, float((lp - lr)[mask].abs().max()))
            tokens += int(mask.sum())
    lc = eng.cfg.learner
    cfg = dataclasses.replace(eng.cfg, learner=dataclasses.replace(
        lc, lr=0.0, loss=dataclasses.replace(lc.loss, ref_kl_coef=0.1)))  # fmt: skip
    r = Trainer(cfg, eng.le, ref, 0).train(groups, 0)
    out = {"device": str(next(ref.module.parameters()).device), "policy_device": str(eng.le.device),
           "dtype": str(ref.dtype), "logp_max_abs_vs_policy": diff, "tokens": tokens, "skipped": r.skipped,
           "applied": r.optimizer_steps, "ref_kl": r.metrics.get("ref_kl"), "loss": r.metrics.get("loss")}  # fmt: skip
    out["ok"] = (out["device"] == out["policy_device"] and diff == 0.0 and r.skipped == 0 and r.optimizer_steps == 1
                 and out["ref_kl"] is not None and abs(out["ref_kl"]) <= 1e-6 and math.isfinite(out["loss"]))  # fmt: skip
    del ref
    free()
    return out


def guard_checks(eng: Engine, groups: list) -> dict[str, Any]:
    """NaN loss and inf gradient each skip the step with every weight bitwise unchanged; then one applies."""
    import copy

    import torch

    def weights() -> tuple[dict, dict]:
        return eng.master(), {n: p.detach().clone() for n, p in eng.le.module.named_parameters()}

    def same(a: tuple[dict, dict], b: tuple[dict, dict]) -> bool:
        return all(torch.equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in x)

    out: dict[str, Any] = {}
    before = weights()
    bad = copy.deepcopy(groups)
    bad[0].completions[0].logprobs[3] = float("nan")
    r = eng.trainer.train(bad, 0)
    out["nan_loss"] = {
        "skipped": r.skipped,
        "applied": r.optimizer_steps,
        "unchanged": same(before, weights()),
    }
    p = next(p for n, p in eng.le.module.named_parameters() if n.endswith("mlp.down_proj.weight"))
    h = p.register_hook(lambda g: torch.full_like(g, float("inf")))
    try:
        r = eng.trainer.train(groups, 0)
    finally:
        h.remove()
    out["inf_grad"] = {"skipped": r.skipped, "applied": r.optimizer_steps, "unchanged": same(before, weights()),
                       "grad_norm": r.grad_norms[-1] if r.grad_norms else None}  # fmt: skip
    r = eng.trainer.train(groups, 0)
    after = weights()
    out["clean"] = {"skipped": r.skipped, "applied": r.optimizer_steps, "changed": not same(before, after),
                    "finite": all(bool(torch.isfinite(t).all()) for d in after for t in d.values())}  # fmt: skip
    out["ok"] = (out["nan_loss"]["skipped"] == 1 and out["nan_loss"]["unchanged"] and out["inf_grad"]["skipped"] == 1
                 and out["inf_grad"]["unchanged"] and out["clean"]["applied"] == 1 and out["clean"]["changed"]
                 and out["clean"]["finite"])  # fmt: skip
    return out
