"""Redis key layout: the one place that names every key and channel of a run.

Every key of run ``R`` starts with ``asyncrl:{R}:``. The braces are literal: they make
``{R}`` a Redis Cluster hash tag, so all keys of one run live in the same slot and the
admission script (which touches the version, admitted and credits keys) stays a single
atomic operation on a cluster as well as on a single server.

==================================  ======  ================================================
key                                 type    contents
==================================  ======  ================================================
``asyncrl:{R}:rollouts``            stream  field ``g`` = msgpack :class:`Group` (records.py)
``asyncrl:{R}:dead``                stream  dead letters: ``id``, ``reason``, ``data``, ``time``
``asyncrl:{R}:dead_total``          string  dead letters written since the run started (int; the stream is capped)
``asyncrl:{R}:version``             string  current learner policy version V (int, unset = 0)
``asyncrl:{R}:admitted``            string  groups admitted since the run started (int)
``asyncrl:{R}:credits``             string  groups the learner dropped, returned to admission
``asyncrl:{R}:staleness_bound``     string  adaptive admission bound (int <= max_staleness; unset = off)
``asyncrl:{R}:weights``             hash    version (decimal) -> msgpack weight manifest
``asyncrl:{R}:actors``              hash    actor_id -> msgpack {version, time, groups, ...}
``asyncrl:{R}:learner``             hash    status field -> msgpack value
``asyncrl:{R}:versions``            pubsub  msgpack {schema, version, path, sha256} per publish
``asyncrl:{R}:admission``           pubsub  msgpack {schema, event}: the admission bound may have risen
``asyncrl:{R}:req:<id>``            string  dedup key of one retried write (expires, admission.py)
``asyncrl:{R}:pool:<n>``            string  lease of actor pool number n (serve-actors; actor ids)
``asyncrl:{R}:broadcast``           hash    NCCL weight-broadcast control plane (broadcast.py)
``asyncrl:{R}:prompt_seq``          string  prompt positions claimed by all actors (int; the run's one prompt order)
``asyncrl:{R}:poison_prompts``      hash    ``<max_model_len>:<prompt id>`` -> reason: prompts the engine refused (skipped after)
==================================  ======  ================================================

The consumer group on the rollouts stream is ``learner`` unless configured otherwise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["KEY_PREFIX", "ROLLOUT_FIELD", "DEFAULT_CONSUMER_GROUP", "Keys", "validate_run_name"]

KEY_PREFIX = "asyncrl"
#: Field of a rollouts stream entry that holds the encoded group.
ROLLOUT_FIELD = b"g"
DEFAULT_CONSUMER_GROUP = "learner"

# Run names end up in key names, file paths and metric labels: keep them boring.
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def validate_run_name(run: str) -> str:
    """Return ``run`` if it is a usable run name, else raise ValueError saying why."""
    if not isinstance(run, str) or not _RUN_NAME.match(run):
        raise ValueError(
            f"run name {run!r}: use 1-128 characters from [A-Za-z0-9._-], starting with a letter or digit"
        )
    return run


@dataclass(frozen=True)
class Keys:
    """All Redis key and channel names of one run."""

    run: str

    def __post_init__(self) -> None:
        validate_run_name(self.run)

    @property
    def prefix(self) -> str:
        return f"{KEY_PREFIX}:{{{self.run}}}"

    def _k(self, name: str) -> str:
        return f"{self.prefix}:{name}"

    @property
    def rollouts(self) -> str:
        return self._k("rollouts")

    @property
    def dead(self) -> str:
        return self._k("dead")

    @property
    def dead_total(self) -> str:
        """Dead letters ever written (incremented with each XADD to :attr:`dead`, which is capped)."""
        return self._k("dead_total")

    @property
    def version(self) -> str:
        return self._k("version")

    @property
    def admitted(self) -> str:
        return self._k("admitted")

    @property
    def credits(self) -> str:
        return self._k("credits")

    @property
    def inflight(self) -> str:
        """Hash actor id -> groups it was admitted for and has neither written nor credited back."""
        return self._k("inflight")

    @property
    def staleness_bound(self) -> str:
        """The admission bound the learner's adaptive controller set (read by the admission script)."""
        return self._k("staleness_bound")

    @property
    def version_skew(self) -> str:
        """Versions the learner skipped by forking on resume (admission.py, "Forks"); unset = 0."""
        return self._k("version_skew")

    @property
    def weights(self) -> str:
        return self._k("weights")

    @property
    def actors(self) -> str:
        return self._k("actors")

    @property
    def learner(self) -> str:
        return self._k("learner")

    def request(self, request_id: str) -> str:
        """Dedup key of one idempotent write (its request id); expires (admission.DEDUP_TTL_S)."""
        return self._k(f"req:{request_id}")

    def pool_lease(self, n: int) -> str:
        """Lease of actor pool number ``n``: two live actor pools of a run never share actor ids."""
        return self._k(f"pool:{int(n)}")

    @property
    def broadcast(self) -> str:
        """Control plane of the NCCL weight transport: session, members, round, states (broadcast.py)."""
        return self._k("broadcast")

    @property
    def versions_channel(self) -> str:
        return self._k("versions")

    @property
    def admission_channel(self) -> str:
        """Wake-up hints for refused admissions: a credit, a reclaim, a new version or bound (admission.py)."""
        return self._k("admission")

    @property
    def prompt_seq(self) -> str:
        """Prompt positions claimed so far by every actor of every pool (one order per run)."""
        return self._k("prompt_seq")

    @property
    def poison_prompts(self) -> str:
        """Prompts the engine refused (the request itself bad), by the ``model.max_model_len`` refused at:
        every actor of every pool skips them after (registry.RunRegistry.mark_poison_prompt)."""
        return self._k("poison_prompts")

    def all_keys(self) -> list[str]:
        """Every data key of the run (not the channel), e.g. to delete a run."""
        return [
            self.rollouts,
            self.dead,
            self.dead_total,
            self.version,
            self.admitted,
            self.credits,
            self.inflight,
            self.staleness_bound,
            self.version_skew,
            self.weights,
            self.actors,
            self.learner,
            self.broadcast,
            self.prompt_seq,
            self.poison_prompts,
        ]
