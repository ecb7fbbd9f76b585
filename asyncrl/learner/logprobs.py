"""Per-token logprobs and entropies of sampled tokens, and the frozen reference model.

The one numerical path for every logprob the learner computes (policy with grad, exact proximal
policy, reference policy): model forward in the model's own dtype -> logits cast to fp32 ->
divided by the sampling temperature -> fp32 log_softmax -> gathered at the sampled token. The
actors' behaviour logprobs are log_softmax(logits / T) of the same model, so at equal weights and
fp32 the ratio pi/mu is 1 up to kernel rounding.

Seed lesson kept here as an invariant: the reference model runs in exactly the policy's dtype and
through this same function. A bf16 reference beside an fp32-master policy once overflowed on long
sequences and made the loss NaN; :class:`ReferenceModel` refuses a dtype other than the policy's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from asyncrl.learner.objectives.kl import entropy_from_logp

__all__ = ["load_hf_model", "token_logprobs", "ReferenceModel", "DTYPES"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_hf_model(path: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A Hugging Face causal LM from a local directory, in ``dtype``, never downloaded, dropout off.

    Dropout off: the learner's logprobs must be those of the policy that sampled (vLLM never drops).
    With a config's dropout in train mode (the policy trains in train mode), log pi was random: the
    on-policy ratio was not 1, and the policy and the eval-mode reference no longer shared one
    precision path. Every numeric ``*dropout*`` / ``*pdrop*`` field of the config is set to 0 before
    the modules are built (HF attention reads its rate from there), and every ``nn.Dropout`` gets
    p = 0 after. An export copies the base model's own config.json, so the user's rates stay there.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    for key, value in config.to_dict().items():
        if (
            ("dropout" in key or "pdrop" in key)
            and isinstance(value, int | float)
            and not isinstance(value, bool)
        ):
            setattr(config, key, 0.0)
    model = AutoModelForCausalLM.from_pretrained(str(path), config=config, dtype=dtype, local_files_only=True)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    # Generation caches are useless (and costly) for teacher-forced training forwards.
    model.config.use_cache = False
    return model


def token_logprobs(
    model: Any, mb: dict[str, Tensor], *, entropy: bool = True, entropy_grad: bool = False
) -> tuple[Tensor, Tensor | None]:
    """``(logp, entropy)``, each ``[B, L]`` fp32, aligned with ``mb["input_ids"]`` positions.

    ``logp[:, j]`` = log softmax(logits[:, j-1] / T)[input_ids[:, j]]; column 0 (no prediction) is 0.
    ``entropy[:, j]`` is the entropy of that same distribution; it is detached unless
    ``entropy_grad``, and its value and gradient stay finite when a probability underflows to 0
    (:func:`~asyncrl.learner.objectives.entropy_from_logp`; xlogy's backward is NaN there).
    ``model`` is a DeepSpeed engine or a plain module (anything callable like a HF causal LM).
    Values outside the loss mask are meaningful but unused; the objectives mask them with torch.where.
    """
    out = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False)
    temp = mb["temperature"].to(torch.float32)
    # fp32 BEFORE dividing: a bf16 logit / T rounds again, and log_softmax must be fp32.
    logits = out.logits[:, :-1].float() / temp[:, None, None]
    logp_all = torch.log_softmax(logits, dim=-1)
    target = mb["input_ids"][:, 1:].unsqueeze(-1)
    logp = F.pad(logp_all.gather(-1, target).squeeze(-1), (1, 0))
    ent = None
    if entropy:
        src = logp_all if entropy_grad else logp_all.detach()
        ent = F.pad(entropy_from_logp(src), (1, 0))
    return logp, ent


class ReferenceModel:
    """A frozen copy of the initial policy for the reference-KL term (no grad, eval mode).

    Built in the policy module's dtype and run through :func:`token_logprobs`, i.e. exactly the
    policy's precision path (see the module docstring). It is a full replica on every rank, also
    under ZeRO-3 (fine for the model sizes a reference KL is used with here; document if not).
    """

    def __init__(
        self, path: str | Path, policy_dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> None:
        self.module = load_hf_model(path, policy_dtype).to(device)
        self.module.eval()
        self.module.requires_grad_(False)
        self.dtype = policy_dtype
        got = {p.dtype for p in self.module.parameters()}
        if got != {policy_dtype}:
            raise RuntimeError(f"reference model parameters are {got}, policy runs in {policy_dtype}")

    @torch.no_grad()
    def logprobs(self, mb: dict[str, Tensor]) -> Tensor:
        logp, _ = token_logprobs(self.module, mb, entropy=False)
        return logp
