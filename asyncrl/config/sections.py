"""Run-wide sections: run, redis, ray, model, task, eval, tracking, console, metrics.

Part of :mod:`asyncrl.config` (imports neither torch, vllm nor ray)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .fields import F


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
    actor_frontend_cpus: str = F(
        "auto",
        "With cpu_binding: where each actor process (vLLM's front end: request submission, output "
        "processing, rewards, Redis writes) runs once its engine is up. engine = on its engine's cores "
        "(the learner's step stays ~1.2x its speed alone); learner = on the learner's cores, leaving the "
        "engine's cores to the engine (demo, 2 cores: +13/+20% steps/s at max_staleness 1/4, but the "
        "learner's step ~1.5-1.7x alone, as both then run at once); all = every core of the plan, placed "
        "by the OS; auto = learner at buffer.max_staleness 0 (synchronous: the learner's cores idle while "
        "the actors generate, and the engine's while the learner trains; demo sync step 82 -> 76 ms, the "
        "learner's step unchanged); with overlap all for one actor (the scheduler puts it where there "
        "is slack: demo +7%/+13% steps/s at max_staleness 1/4 over engine, the learner's step "
        "~1.05x its time with engine, 1.09-1.27x alone), else engine.",
        choices=("auto", "engine", "learner", "all"),
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
    start_timeout_s: float = F(
        120.0,
        "Longest wait (s) for Ray to start or for ray.address to answer; then the command fails naming the "
        "address (Ray itself retried an unreachable one for good). A local Ray starts in seconds.",
        gt=0,
    )


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
    tiny_cache_dir: str = F(
        "~/.cache/asyncrl/tiny-models",
        "Machine-wide cache of built tiny models (keyed by spec, seed, torch/transformers versions and the "
        "builder's source): a run copies its model from there instead of importing torch and building it "
        "(~4.5 s of start-up on a 2-core box). Empty = build every time.",
    )
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
        "Task: a built-in (copy/reverse/count/addition/echo: tiny, dense reward in [0,1]; gsm8k: math), a name "
        "registered under the 'asyncrl.tasks' entry-point group, or a factory 'pkg.module:make_task' / "
        "'path/to/file.py:make_task' (see docs/custom_tasks.md).",
    )
    data_path: str = F(
        "",
        "Training data: JSONL, Parquet or a save_to_disk dataset dir (gsm8k: question/answer columns in any "
        "of these, split / eval_split honoured; empty = the shipped examples). Built-in tiny tasks read no "
        "data and refuse it.",
    )
    split: str = F(
        "train",
        "Split of a saved DatasetDict used for training. A JSONL/Parquet file has no splits: only "
        "'train' is accepted there.",
    )
    eval_data_path: str = F("", "Eval data (same formats as data_path). Empty = eval_split or eval_fraction.")
    eval_split: str = F(
        "",
        "Split of the saved DatasetDict (data_path) used for eval, e.g. test; must differ from task.split. "
        "A file has no splits: use eval_data_path or eval_fraction there.",
    )
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
    target_column: str = F(
        "",
        "Data column holding the reference answer (Prompt.target, as text: a JSON number as the file writes "
        "it, 3 -> '3', also in a column mixing ints and floats; empty = none).",
    )
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
    reward_failure_limit: int = F(
        64,
        "An actor whose reward failed for this many groups in a row stops the run with one line naming the "
        "reward and its last failure, instead of dropping every group for ever: a reward that can never work "
        "(a dict returned, an import that fails) or one that worked and then broke for good (its verifier "
        "gone). Each group whose rewards succeed restarts the count, so a reward that fails only sometimes "
        "just drops its failing groups (dead-letter stream). 0 = never stop.",
        ge=0,
    )
    reward_failure_window_s: float = F(
        300.0,
        "A reward that has worked in this actor stops the run only once its groups in a row that failed "
        "(task.reward_failure_limit) also span this many seconds: a verifier outage shorter than this, or a "
        "reward failing on some completions of most groups, only drops groups. A reward that never worked "
        "stops at the limit alone. 0 = the limit alone.",
        ge=0,
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
        "on its engine at the version boundary; training continues (see asyncrl/evaluate.py). A task without "
        "eval prompts (task.eval_data_path / eval_split / eval_fraction, tiny: task.eval_size) fails at start "
        "when N > 0. The learner "
        "copies the results into its step records only when its own config sets this too (split roles: "
        "give both the same value).",
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
