"""The learner's half of the pipeline simulator (:mod:`asyncrl.plan.simulate`): reading groups,
training, publishing and checkpointing, as event handlers mixed into its simulation class.

Invariants: the learner reads groups in arrival order and drops those staler than eta at the version
its step starts with (crediting their slots); V is bumped when a publish phase ends, and only then do
the actors start their hand-offs; a learner phase's remaining work is re-timed whenever the engines'
state changes (co-location slows it while they decode). Imports neither torch, vllm nor ray.
"""

from __future__ import annotations

from asyncrl.buffer.admission import admission_bound_formula

from .inputs import PlanInputs
from .results import StepTrace

__all__ = ["LearnerEvents"]


class LearnerEvents:
    """Learner event handlers of ``asyncrl.plan.simulate._Sim`` (state lives there)."""

    # Set by the simulation class: its inputs, clock, engines, buffer and bookkeeping.
    p: PlanInputs

    def decoding(self) -> bool:
        """Some engine is working (decoding, or reloading weights: that is compute too)."""
        return any(e.swapping or e.rate() > 0 for e in self.engines)

    def engines_changed(self) -> None:
        """Call after any engine's decoding state may have changed: the learner's speed may too."""
        if self.phases and self.decoding() != self.l_decoding:
            self.advance_learner()
            self.l_decoding = not self.l_decoding
            self.schedule_learner()

    def advance_learner(self) -> None:
        rate = 1.0 / self.p.learner_slowdown if self.l_decoding else 1.0
        self.phases[0][1] -= (self.t - self.l_t) * rate
        self.l_t = self.t

    def schedule_learner(self) -> None:
        self.l_epoch += 1
        rate = 1.0 / self.p.learner_slowdown if self.l_decoding else 1.0
        self.at(self.t + max(self.phases[0][1], 0.0) / rate, "phase_done", self.l_epoch)

    def set_learner_busy(self, busy: bool) -> None:
        """The engines slow down while the learner works (co-location); re-time them."""
        slow = self.p.gen_slowdown if busy else 1.0
        for e in self.engines:
            if e.slow != slow:
                e.advance(self.t)
                e.slow = slow
                self.schedule_finish(e)

    def saturated(self) -> bool:
        """Admission is at its bound: no worker can take a slot before the learner's next step."""
        p = self.p
        gps = p.groups_per_step * p.publish_every
        return self.admitted >= admission_bound_formula(self.V, p.max_staleness, gps, self.credits)

    def unread_changed(self) -> None:
        """A group reached the buffer, or the learner started waiting: fill_window's quiet period restarts."""
        self.fill_epoch += 1
        self.fill_changed_t = self.t

    def arm_fill_check(self) -> None:
        """fill_window: under saturated admission, end the wait once the unread count has not changed
        for fill_saturated_s (the real learner's SATURATED_S; asyncrl.learner.feed.Rank0.fill_window)."""
        if self.filling and self.learner_waiting and self.saturated():
            t = max(self.t, self.fill_changed_t + self.p.fill_saturated_s)
            self.at(t, "fill_check", self.fill_epoch)

    def on_fill_check(self, epoch: int) -> None:
        if self.filling and self.learner_waiting and epoch == self.fill_epoch and self.saturated():
            self.filling = False
            self.gather()

    def gather(self) -> None:
        p = self.p
        if self.filling:
            # learner.fill_window: wait for a full admission window of unread groups (or saturation).
            if len(self.buffer) < (p.max_staleness + 1) * p.groups_per_step * p.publish_every:
                return
            self.filling = False
        dropped = 0
        while self.buffer and len(self.batch) < p.groups_per_step:
            g = self.buffer.popleft()
            if self.V - g.oldest > p.max_staleness:
                dropped += 1
            else:
                self.batch.append(g)
        if dropped:
            self.dropped += dropped
            self.credits += dropped
            self.wake(self.engines)
        if len(self.batch) < p.groups_per_step:
            return
        self.learner_waiting = False
        hist: dict[int, float] = {}
        tokens = 0.0
        for g in self.batch:
            for v, n in g.versions.items():
                hist[self.V - v] = hist.get(self.V - v, 0.0) + n
                tokens += n
        self.pending = (self.t - self.wait_since, tokens, len(self.batch) * p.group_size, hist, self.dropped)
        self.dropped = 0
        self.batch = []
        step = self.step + 1
        if p.learner_work:
            f = p.learner_work[(step - 1) % len(p.learner_work)]
        else:
            f = self.jitter.lognormvariate(self.jit_mu, self.jit_sigma) if self.jit_sigma > 0 else 1.0
        self.work_factor = f
        self.phases = [["train", f * (p.learner_step_s + p.learner_token_s * tokens)]]
        if p.publish_policy == "steps" and step % p.publish_every == 0:  # taken: decided after the train
            self.phases.append(["publish", f * p.publish_s])
        if step % p.checkpoint_every == 0:
            self.phases.append(["checkpoint", f * p.checkpoint_s])
        self.l_t, self.l_decoding = self.t, self.decoding()
        self.train_start = self.t
        self.set_learner_busy(True)
        self.schedule_learner()

    def decide_publish(self) -> None:
        """publish_policy=taken, at the end of a step's train phase (as the real learner decides after
        its update): publish if every engine serves V (its swap of V has ended; the real learner reads
        the actors' heartbeats, written after each swap) or after publish_max_steps steps without a
        publication (this one included). Otherwise the step returns groups_per_step credits (the
        learner lowers the version skew, which wakes the refused workers): the window advances per step."""
        self.since_publish += 1
        if self.since_publish >= self.p.publish_max_steps or all(e.version >= self.V for e in self.engines):
            self.since_publish = 0
            self.phases.insert(0, ["publish", self.work_factor * self.p.publish_s])  # before a checkpoint
            return
        self.credits += self.p.groups_per_step  # publish_every is 1: groups per version = per step
        self.wake(self.engines)

    def on_phase_done(self, epoch: int) -> None:
        if epoch != self.l_epoch:
            return
        kind, _ = self.phases.pop(0)
        if kind == "train":
            self.train_s = self.t - self.train_start
            if self.p.publish_policy == "taken":
                self.decide_publish()
        if kind == "publish":
            self.V += 1
            for e in self.engines:
                if e.staging is None and not e.swapping and self.swap_due(e):  # else: at its hand-off's end
                    self.start_handoff(e)
            self.wake(self.engines)
        if self.phases:
            self.l_t = self.t
            self.schedule_learner()
            return
        self.step += 1
        wait, tokens, seqs, hist, dropped = self.pending
        for e in self.engines:
            e.advance(self.t)
        self.trace.append(
            StepTrace(self.step, self.t, wait, tokens, seqs, hist, dropped,
                      sum(e.blocked_s for e in self.engines), sum(e.busy_s for e in self.engines),
                      self.train_s, self.decoded, self.decode_total, self.V, self.decode_sq)
        )  # fmt: skip
        self.set_learner_busy(False)
        self.learner_waiting = True
        self.wait_since = self.t
        if self.p.fill_window:
            self.filling = True
            self.unread_changed()
            self.arm_fill_check()
        self.gather()
