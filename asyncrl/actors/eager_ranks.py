"""vLLM's sampler token ranks computed eagerly on CPU engines, without ``torch.compile``.

With every logprob it returns, vLLM's sampler returns the sampled token's rank: per sequence, how many
vocabulary entries have a logprob >= the sampled token's. It counts them with
``vllm.v1.sample.ops.logprobs.batched_count_greater_than``, a one-line reduction under
``torch.compile`` (inductor), so that on a GPU it fuses instead of materializing a batch x vocabulary
mask. On CPU the first call in each engine process traces the function, hashes torch's sources for
inductor's cache key and loads the compiled kernel: 6 s in a fresh process on the 2-core box with
inductor's on-disk cache warm, and 2-4 s of the demo's first groups, on the path to the first learner
step. The mask it avoids costs batch x vocabulary bytes (38 MB at 256 sequences x 151k tokens).

:func:`install` points the name the sampler calls at :func:`count_at_least`, the same expression run
eagerly, on CPU engines only (GPU engines keep vLLM's compiled kernel). The integers are the same:
a test compares both functions on random logprobs, ties and -inf entries.

Imported in the engine process (by asyncrl.actors.worker_ext, which vLLM loads there), never by the
actor at import time.
"""

from __future__ import annotations

import torch

__all__ = ["count_at_least", "install"]


def count_at_least(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per row of ``x`` (batch, n), the number of entries >= that row's ``values`` (batch, 1)."""
    if x.shape[0] != values.shape[0]:
        raise ValueError(f"rows: {x.shape[0]} logprob rows, {values.shape[0]} values")
    return (x >= values).sum(-1)


def install() -> bool:
    """Make vLLM's sampler use :func:`count_at_least` if this process's platform is the CPU; whether it did."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    import vllm.v1.sample.sampler as sampler

    sampler.batched_count_greater_than = count_at_least
    return True
