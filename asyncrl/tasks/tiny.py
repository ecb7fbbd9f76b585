"""Built-in tiny tasks a randomly initialised character-level model can learn on a CPU in minutes.

Every tiny task maps a prompt ``"<name>:<input>="`` (``echo``: the bare input) to a short target string and scores a
completion with the same dense reward, :func:`char_reward`:

    reward = char_score * length_factor, in [0, 1]

* ``char_score``: mean over target positions ``i`` of 1 when ``completion[i] == target[i]``,
  ``VALID_SYMBOL_CREDIT`` when ``completion[i]`` is at least a symbol the target could contain
  (the task alphabet, or digits for the numeric tasks), else 0. Missing positions score 0.
* ``length_factor = 1 / (1 + |len(completion) - len(target)| / len(target))``: 1 at the right
  length, smoothly smaller for rambling or truncated answers (a completion ends at EOS).

Why this shape: a random model over the ~100-symbol vocabulary runs to ``max_tokens`` and scores
about 0.005, while a model that only learned "emit a few task symbols, then stop" already scores
about 0.4, and exact copies score 1. The reward therefore starts low, has variance inside a group
from the first step, and rises in stages (symbols, length, content) that GRPO picks up quickly.

All functions here are pure.
"""

from __future__ import annotations

import random
import string

from .base import Prompt, Task

__all__ = [
    "VALID_SYMBOL_CREDIT",
    "char_reward",
    "TinyTask",
    "CopyTask",
    "ReverseTask",
    "CountTask",
    "AdditionTask",
    "EchoTask",
]

#: Credit for a wrong character that is at least a symbol the target could contain.
VALID_SYMBOL_CREDIT = 0.25


def char_reward(completion: str, target: str, symbols: str) -> float:
    """Dense per-character reward of ``completion`` against ``target`` (see the module doc)."""
    if not target:
        return 1.0 if not completion else 0.0
    score = 0.0
    for i, want in enumerate(target):
        if i >= len(completion):
            break
        got = completion[i]
        if got == want:
            score += 1.0
        elif got in symbols:
            score += VALID_SYMBOL_CREDIT
    char_score = score / len(target)
    length_factor = 1.0 / (1.0 + abs(len(completion) - len(target)) / len(target))
    return char_score * length_factor


class TinyTask(Task):
    """A generated prompt set: ``num_prompts`` prompts drawn from ``seed``."""

    name = "tiny"
    symbols: str = ""

    def __init__(self, num_prompts: int, seed: int, alphabet: str, min_len: int, max_len: int,
                 eval_size: int = 0) -> None:  # fmt: skip
        if not alphabet:
            raise ValueError("task.alphabet must not be empty")
        if min_len > max_len:
            raise ValueError(f"task.min_len={min_len} > task.max_len={max_len}")
        bad = [c for c in alphabet if c in ":=+\n" or c not in string.printable]
        if bad:
            raise ValueError(f"task.alphabet: characters {bad!r} are reserved or not printable ASCII")
        self.alphabet = "".join(dict.fromkeys(alphabet))  # de-duplicated, order kept
        self.min_len, self.max_len = min_len, max_len
        # A task-specific stream so that two tasks with the same seed do not share prompts.
        rng = random.Random(f"{self.name}:{seed}")
        prompts = [self._prompt(rng, f"{self.name}-{i}") for i in range(num_prompts)]
        # The eval split is drawn from its own stream: fresh draws from the same distribution (with
        # small alphabets the train set already holds every string, so "held out" means "not these
        # draws", and the eval set does not change when num_prompts does).
        eval_rng = random.Random(f"{self.name}:eval:{seed}")
        evals = [self._prompt(eval_rng, f"{self.name}-eval-{i}") for i in range(eval_size)]
        super().__init__(prompts, evals)

    def _prompt(self, rng: random.Random, prompt_id: str) -> Prompt:
        inp, target = self.make(rng)
        return Prompt(prompt_id, f"{self.name}:{inp}=", target, {"task": self.name})

    def random_string(self, rng: random.Random) -> str:
        n = rng.randint(self.min_len, self.max_len)
        return "".join(rng.choice(self.alphabet) for _ in range(n))

    def make(self, rng: random.Random) -> tuple[str, str]:
        """One (input, target) pair."""
        raise NotImplementedError

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        return char_reward(completion_text, prompt.target, self.symbols or self.alphabet)


class CopyTask(TinyTask):
    """``copy:abc=`` -> ``abc``."""

    name = "copy"

    def make(self, rng: random.Random) -> tuple[str, str]:
        s = self.random_string(rng)
        return s, s


class ReverseTask(TinyTask):
    """``reverse:abc=`` -> ``cba``."""

    name = "reverse"

    def make(self, rng: random.Random) -> tuple[str, str]:
        s = self.random_string(rng)
        return s, s[::-1]


class CountTask(TinyTask):
    """``count:abca=`` -> ``4`` (the length of the string, in decimal)."""

    name = "count"
    symbols = string.digits

    def make(self, rng: random.Random) -> tuple[str, str]:
        s = self.random_string(rng)
        return s, str(len(s))


class AdditionTask(TinyTask):
    """``addition:12+7=`` -> ``19``; operands have 1 .. max(1, max_len // 2) digits."""

    name = "addition"
    symbols = string.digits

    def make(self, rng: random.Random) -> tuple[str, str]:
        max_digits = max(1, self.max_len // 2)
        a = rng.randrange(10 ** rng.randint(1, max_digits))
        b = rng.randrange(10 ** rng.randint(1, max_digits))
        return f"{a}+{b}", str(a + b)


class EchoTask(TinyTask):
    """``c`` -> ``ccc``: the prompt is the bare input, the target is it repeated :attr:`REPEATS` times.

    The staleness sweep's task (configs/sweep_staleness.yaml: alphabet ``abcd``, length 1,
    ``actors.max_tokens=3``), chosen because a randomly initialised tiny model learns it with RL in
    ~100-150 on-policy steps, so degradation under staleness has room to show:

    * The answer depends on the prompt and a constant scores low: over ``abcd`` any constant answer
      (or a uniformly random letter) averages (1 + 3 x 0.25) / 4 = 0.4375, the task maximum is 1.
      With copy over ``ab`` the constant ``ab`` scored 0.625 and the policy settled there.
    * No framing: the prompt's last token *is* the input, so the answer is a function of the token
      the model conditions on directly (no attention to learn first). In an offline on-policy GRPO
      screen of the same model (plain torch, 3 seeds) the framed prompt ``echo:c=`` left a prompt
      stuck on a wrong letter in 2 of 3 seeds (reward ~0.8); the bare prompt reached ~1.0.
    * Three answer positions: each completion samples the prompt's letter three times, so a group
      keeps reward variance (and a gradient) for longer before the policy sharpens; with a
      one-letter answer the same screen stalled at ~0.4-0.8 (a prompt stuck on a wrong letter).
    * ``max_tokens`` equal to the answer length: nothing to learn about stopping.
    """

    name = "echo"
    REPEATS = 3

    def _prompt(self, rng: random.Random, prompt_id: str) -> Prompt:
        inp, target = self.make(rng)
        return Prompt(prompt_id, inp, target, {"task": self.name})

    def make(self, rng: random.Random) -> tuple[str, str]:
        s = self.random_string(rng)
        return s, s * self.REPEATS
