"""Weight swaps through vLLM's weight-transfer API (engine ``asyncrl_file``) on the real CPU engine.

One vLLM engine (module fixture), no Ray, no Redis: weights published by the learner's
shared-memory transport are swapped in, and what the engine then samples is checked against an
fp32 HF recompute under exactly those weights (on CPU every linear layer is repacked into a
oneDNN handle after loading, so an update that skipped the re-processing would still sample
from the old weights). Bad files are refused before the pause, and a refusal inside the worker
leaves the model serving its old weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncrl.learner.publisher import ShmTransport, checkpoint_tensor_names, shm_root
from tests.integration.swap_helpers import perturbed

pytestmark = pytest.mark.timeout(300)

TEMPERATURE, TOL = 0.8, 1e-4
BUSY_MS = 100.0  # actors.engine_busy_loop_ms of the engine under test
PROMPT = [5, 17, 29, 41, 53]


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from asyncrl.actors.engine import Engine
    from asyncrl.config import Config
    from asyncrl.tinymodel import build_tiny_model

    # torch (inductor, pulled in by the engine) raises the recursion limit; CPython 3.11.7's ast.parse
    # then fails on files pytest rewrites later in the session (gh-106905): put it back afterwards.
    limit = sys.getrecursionlimit()
    root = tmp_path_factory.mktemp("swap")
    model_dir = build_tiny_model(root / "model", Config().model.tiny, 0)
    base = load_file(str(model_dir / "model.safetensors"))
    transport = ShmTransport(shm_root(root, "swaptest"), checkpoint_tensor_names(model_dir))
    loop = asyncio.new_event_loop()
    # The default executor on CPU: the worker inside the engine core (asyncrl.actors.inproc_executor);
    # the multiprocess one (asyncrl.actors.quiet_executor, busy_loop_ms) has its own test below.
    engine = Engine(
        model_dir, dtype="float32", kv_cache_bytes=32 << 20, max_model_len=128, busy_loop_ms=BUSY_MS
    )

    weights = perturbed(base)

    def hf(state: dict[str, torch.Tensor]):
        m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        m.load_state_dict(state, strict=False)
        return m.eval()

    try:
        yield {"engine": engine, "loop": loop, "transport": transport, "weights": weights, "hf": hf}
    finally:
        engine.shutdown()
        transport.cleanup()
        pending = asyncio.all_tasks(loop)  # the engine's output handler, cancelled by shutdown
        for t in pending:
            t.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()
        sys.setrecursionlimit(limit)


def _sample(rig, rid: str, max_tokens: int = 12):
    eng = rig["engine"]
    return rig["loop"].run_until_complete(eng.generate_group(PROMPT, 2, TEMPERATURE, 1.0, max_tokens, rid))


def _max_err(model, seqs) -> float:
    worst = 0.0
    for s in seqs:
        ids = torch.tensor([PROMPT + s.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(PROMPT) - 1 : -1].float()
        lp = torch.log_softmax(logits / TEMPERATURE, -1).gather(1, torch.tensor(s.token_ids)[:, None])[:, 0]
        worst = max(worst, float((lp - torch.tensor(s.logprobs)).abs().max()))
    return worst


def test_shm_swap_serves_exactly_the_new_weights(rig) -> None:
    eng, tr, run = rig["engine"], rig["transport"], rig["loop"].run_until_complete
    m0 = tr.publish(0, rig["weights"](0), "float32")
    assert m0.digest == "none" and m0.path.startswith(str(tr.root))
    run(eng.load_weights(m0.path, 0))
    s0 = _sample(rig, "a")
    assert all(set(s.versions) == {0} for s in s0)
    hf0 = rig["hf"](rig["weights"](0))
    assert _max_err(hf0, s0) < TOL
    w1 = rig["weights"](1)
    m1 = tr.publish(1, w1, "float32")
    res = run(eng.swap_weights(m1.path, 1, "in_flight"))
    assert eng.version == 1 and 0 < res.reload_s <= res.pause_s < 5.0
    s1 = _sample(rig, "b")
    assert all(set(s.versions) == {1} for s in s1)
    hf1 = rig["hf"](w1)
    assert _max_err(hf1, s1) < TOL  # the repacked kernels hold v1 ...
    assert _max_err(hf0, s1) > 100 * TOL  # ... and not v0 (the check can tell them apart)
    rig["hf1"] = hf1


def test_bad_files_are_refused_and_the_old_weights_keep_serving(rig, tmp_path: Path) -> None:
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    eng, tr, run = rig["engine"], rig["transport"], rig["loop"].run_until_complete
    assert eng.version == 1, "runs after the swap test"
    w2 = rig["weights"](2)
    m2 = tr.publish(2, w2, "float32")
    with pytest.raises(ValueError, match="expected 3"):  # the file says v2
        run(eng.swap_weights(m2.path, 3, "in_flight"))
    partial = ShmTransport(tmp_path / "partial")  # no expected names: writes what it is given
    mp = partial.publish(4, {k: v for k, v in list(w2.items())[1:]}, "float32")
    with pytest.raises(ValueError, match="missing"):
        run(eng.swap_weights(mp.path, 4, "in_flight"))
    assert eng.version == 1
    # Past the front-end check, inside the worker: the engine refuses before touching the model and
    # puts the current tensors back, so the next samples are still exactly v1's.
    llm = eng.llm

    async def worker_side_refusal() -> None:
        await llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)
        try:
            await llm.start_weight_update()
            await llm.update_weights(WeightTransferUpdateRequest(update_info={"path": m2.path, "version": 5}))
        finally:
            await llm.resume_generation()

    with pytest.raises(Exception, match="expected 5"):
        run(worker_side_refusal())
    s = _sample(rig, "c")
    assert all(set(x.versions) == {1} for x in s)
    assert _max_err(rig["hf1"], s) < TOL
    # and the update session was closed: a normal swap works afterwards
    run(eng.swap_weights(m2.path, 2, "in_flight"))
    s2 = _sample(rig, "d")
    assert all(set(x.versions) == {2} for x in s2) and _max_err(rig["hf"](w2), s2) < TOL


def test_a_file_that_fails_its_sha256_is_refused_beside_the_stage_build(rig, tmp_path: Path) -> None:
    """The actor's check runs inside swap_weights, concurrently with the stage build: a damaged file
    raises WeightIntegrityError before any pause, its built stage is dropped, the old weights serve."""
    from asyncrl.buffer import WeightIntegrityError, verify
    from asyncrl.learner.publisher import FilesystemTransport

    eng, run = rig["engine"], rig["loop"].run_until_complete
    served = eng.version
    ref = rig["hf"](rig["weights"](served))
    ft = FilesystemTransport(tmp_path / "w")
    v = served + 1
    staging, eng.staging = eng.staging, True
    try:
        for damage in ("data", "truncate"):
            m = ft.publish(v, rig["weights"](v), "float32")
            with open(m.path, "r+b") as f:
                if damage == "data":  # a flipped byte in the tensor data: the stage builds, sha256 fails
                    f.seek(m.size - 5)
                    b = f.read(1)
                    f.seek(m.size - 5)
                    f.write(bytes([b[0] ^ 0xFF]))
                else:  # half the file: the build fails too, and the integrity error is the one raised
                    f.truncate(m.size // 2)

            async def check(m=m) -> None:
                await asyncio.to_thread(verify, m)

            with pytest.raises(WeightIntegrityError):
                run(eng.swap_weights(m.path, v, "in_flight", verify=check))
            assert eng.version == served
            s = _sample(rig, f"dmg-{damage}")
            assert all(set(x.versions) == {served} for x in s) and _max_err(ref, s) < TOL
            ft.delete(v)
        # The dropped stage left nothing behind: the intact file stages and serves exactly.
        m = ft.publish(v, rig["weights"](v), "float32")
        res = run(eng.swap_weights(m.path, v, "in_flight", verify=lambda: asyncio.to_thread(verify, m)))
        assert res.staged and eng.version == v
        s = _sample(rig, "intact")
        assert all(set(x.versions) == {v} for x in s) and _max_err(rig["hf"](rig["weights"](v)), s) < TOL
    finally:
        eng.staging = staging


def _seeded(rig, rid: str, max_tokens: int = 12):
    eng = rig["engine"]
    return rig["loop"].run_until_complete(
        eng.generate_group(PROMPT, 2, TEMPERATURE, 1.0, max_tokens, rid, seed=4242)
    )


def test_staged_swap_serves_the_new_weights_exactly_like_an_in_place_reload(rig) -> None:
    """The staged path (asyncrl.actors.staging: load + oneDNN packing in a worker thread, pointer switch
    in the pause) serves what the in-place reload serves, to the bit, and what the HF fp32 recompute of
    the same weights gives; the per-token labels are the staged version's."""
    eng, tr, run = rig["engine"], rig["transport"], rig["loop"].run_until_complete
    w = rig["weights"](3)
    m_in, m_st = tr.publish(10, w, "float32"), tr.publish(11, w, "float32")
    eng.staging = False
    res_in = run(eng.swap_weights(m_in.path, 10, "in_flight"))
    s_in = _seeded(rig, "in-place")
    eng.staging = True
    try:
        res_st = run(eng.swap_weights(m_st.path, 11, "in_flight"))
        assert eng.staging_refused is None and not res_in.staged and res_st.staged
        s_st = _seeded(rig, "staged")
        assert all(set(s.versions) == {10} for s in s_in) and all(set(s.versions) == {11} for s in s_st)
        for a, b in zip(s_in, s_st, strict=True):
            assert a.token_ids == b.token_ids and a.logprobs == b.logprobs  # bitwise
        hf3 = rig["hf"](w)
        assert _max_err(hf3, s_st) < TOL
        # A stage built from other weights really is different (the comparison can fail).
        w4 = rig["weights"](4)
        run(eng.swap_weights(tr.publish(12, w4, "float32").path, 12, "in_flight"))
        s4 = _seeded(rig, "staged-4")
        assert all(set(s.versions) == {12} for s in s4)
        assert _max_err(rig["hf"](w4), s4) < TOL and _max_err(hf3, s4) > 100 * TOL
        # A file the worker refuses while staging costs no pause and leaves v12 serving.
        bad = tr.publish(13, rig["weights"](5), "float32")
        with pytest.raises(ValueError, match="expected 14"):
            run(eng._stage(bad.path, 14))
        assert eng.version == 12
        s4b = _seeded(rig, "staged-4b")
        assert [s.logprobs for s in s4b] == [s.logprobs for s in s4]
    finally:
        eng.staging = False


def test_a_replayed_stage_serves_what_the_loaders_stage_serves(rig, tmp_path: Path) -> None:
    """Stages after the first replay the copies its loaders made (asyncrl.actors.stage_replay): the
    same weights staged by the loaders and by the replay serve the same seeded groups to the bit, and
    a replay of other weights serves those (HF fp32 recompute), not the recorded file's."""
    from safetensors.torch import save_file

    eng, tr, run = rig["engine"], rig["transport"], rig["loop"].run_until_complete
    base = (eng.version or 0) + 100

    def staged(version: int, w: dict, replay: bool) -> dict:
        eng.stage_replay = replay
        res = run(eng.swap_weights(tr.publish(version, w, "float32").path, version, "in_flight"))
        assert res.staged and eng.version == version
        return run(eng.llm.collective_rpc("asyncrl_stage_poll"))[0]

    w, w2 = rig["weights"](6), rig["weights"](7)
    eng.staging = True
    try:
        assert staged(base, w, replay=False)["replayed"] is False  # the loaders (and no plan kept)
        by_loaders = _seeded(rig, "loaders")
        first = staged(base + 1, w2, replay=True)  # no plan yet: the loaders, recording one
        assert first["replayed"] is False and first["plan_refused"] is None
        again = staged(base + 2, w, replay=True)
        assert again["replayed"] is True and again["error"] is None
        by_replay = _seeded(rig, "replayed")
        for a, b in zip(by_loaders, by_replay, strict=True):
            assert a.token_ids == b.token_ids and a.logprobs == b.logprobs  # bitwise
        assert all(set(s.versions) == {base + 2} for s in by_replay)
        assert staged(base + 3, w2, replay=True)["replayed"] is True
        s2 = _seeded(rig, "replayed-2")
        assert _max_err(rig["hf"](w2), s2) < TOL and _max_err(rig["hf"](w), s2) > 100 * TOL
        # A file of another layout (one tensor stored in fp16; the names are the same): the loaders
        # load it (converting), a plan is recorded for it, and the next fp32 file mismatches it again.
        half = {k: v.half() if k.endswith("norm.weight") else v for k, v in w.items()}
        path = tmp_path / "half.safetensors"
        save_file(half, str(path), metadata={"asyncrl_version": str(base + 4)})
        before = run(eng.llm.collective_rpc("asyncrl_stage_poll"))[0]["plan_mismatches"]
        res = run(eng.swap_weights(str(path), base + 4, "in_flight"))
        got = run(eng.llm.collective_rpc("asyncrl_stage_poll"))[0]
        assert res.staged and got["replayed"] is False and got["plan_mismatches"] == before + 1
        served = {k: v.float() for k, v in half.items()}
        assert _max_err(rig["hf"](served), _seeded(rig, "half")) < TOL
        again = staged(base + 5, w, replay=True)
        assert again["replayed"] is False and again["plan_mismatches"] == before + 2
        assert staged(base + 6, w, replay=True)["replayed"] is True
        for a, b in zip(by_loaders, _seeded(rig, "replayed-3"), strict=True):
            assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    finally:
        eng.staging, eng.stage_replay = False, True


def test_streamed_and_final_only_groups_are_identical(rig) -> None:
    """actors.stream_tokens only changes how vLLM hands a group over (every decode step, or once at the
    end): the same seeded group comes back with the same tokens, logprobs, text, finish reasons and
    per-token versions, bit for bit; and only the streamed one counts its tokens while it runs."""
    eng, loop = rig["engine"], rig["loop"]
    assert eng.stream_tokens is False  # the default (actors.stream_tokens=false)
    seen: dict[str, int] = {}

    async def group(rid: str, stream: bool | None):
        task = asyncio.ensure_future(
            eng.generate_group(PROMPT, 3, TEMPERATURE, 1.0, 40, rid, seed=99, stream=stream)
        )
        while not task.done():  # the most tokens counted while the group was still running
            seen[rid] = max(seen.get(rid, 0), eng.progress.get(rid, 0))
            await asyncio.sleep(0.0005)
        return await task

    streamed = loop.run_until_complete(group("streamed", True))
    final = loop.run_until_complete(group("final", None))
    assert len(streamed) == len(final) == 3
    for a, b in zip(streamed, final, strict=True):
        assert a.token_ids and a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs and len(a.logprobs) == len(a.token_ids)
        assert a.text == b.text and a.finish_reason == b.finish_reason
        assert a.versions == b.versions == [eng.version] * len(a.token_ids)
    assert seen["streamed"] > 0 and seen["final"] == 0, seen
    # A different seed really changes the group (the comparison can fail).
    other = loop.run_until_complete(eng.generate_group(PROMPT, 3, TEMPERATURE, 1.0, 40, "other", seed=98))
    assert [s.token_ids for s in other] != [s.token_ids for s in final]


def test_groups_started_together_reach_the_engine_in_one_loop_pass_as_the_raw_prompt_path_samples(
    rig,
) -> None:
    """generate_group hands vLLM a rendered prompt (``TokensInput``): the request is built and sent on
    the event loop's thread, so the groups a swap releases together are all in the engine before the loop
    runs anything else. A raw prompt dict went through the renderer's one-thread executor, a hop per
    group, which spread them over ~1 ms and into different engine steps. What is sampled is unchanged:
    the same seeded group through vLLM's raw prompt path has the same tokens, logprobs and text."""
    from vllm import SamplingParams

    eng, loop = rig["engine"], rig["loop"]
    if eng.version is None:
        m0 = rig["transport"].publish(0, rig["weights"](0), "float32")
        loop.run_until_complete(eng.load_weights(m0.path, 0))
    _sample(rig, "warm", 2)  # vLLM caches its engine's supported tasks at the first request (an RPC)

    async def together():
        tasks = [
            asyncio.ensure_future(
                eng.generate_group(PROMPT, 2, TEMPERATURE, 1.0, 8, f"together-{i}", seed=60 + i)
            )
            for i in range(4)
        ]
        await asyncio.sleep(0)  # one pass of the loop: each task runs to its first suspension
        sent = eng.llm.output_processor.get_num_unfinished_requests()
        return sent, await asyncio.gather(*tasks)

    sent, groups = loop.run_until_complete(together())
    assert sent == 4 * 2  # every completion of every group, before any other callback ran

    async def raw(seed: int):
        params = SamplingParams(n=2, temperature=TEMPERATURE, top_p=1.0, max_tokens=8, logprobs=0, seed=seed,
                                output_kind=eng.output_kind)  # fmt: skip
        outs = [o async for o in eng.llm.generate({"prompt_token_ids": list(PROMPT)}, params, f"raw-{seed}")]
        return sorted(outs[-1].outputs, key=lambda c: c.index)

    for i, group in enumerate(groups):
        ref = loop.run_until_complete(raw(60 + i))
        for ours, theirs in zip(group, ref, strict=True):
            assert ours.token_ids and ours.token_ids == list(theirs.token_ids)
            assert ours.text == theirs.text
            assert ours.logprobs == [
                float(p[t].logprob) for p, t in zip(theirs.logprobs, theirs.token_ids, strict=True)
            ]
    assert [s.token_ids for s in groups[0]] != [s.token_ids for s in groups[1]]  # the seeds differ


def test_completion_text_is_the_text_vllm_itself_decodes(rig) -> None:
    """With ``actors.decode_text_once`` generate_group asks vLLM for no text (``detokenize=False``: no
    string per sampled token for the logprob entries) and decodes each completion once it ended with
    vLLM's own detokenizer (asyncrl.actors.detokenize). Over many seeded completions, streamed and not, the text equals the
    one vLLM returns for the same seeds with its detokenization on; and for completions cut by a stop
    token the stop token is left out of the text exactly as vLLM leaves it out."""
    from vllm import SamplingParams

    from asyncrl.actors.detokenize import completion_text

    eng, loop = rig["engine"], rig["loop"]
    if eng.version is None:
        m0 = rig["transport"].publish(0, rig["weights"](0), "float32")
        loop.run_until_complete(eng.load_weights(m0.path, 0))

    async def vllm_own(seed: int, n: int, max_tokens: int, **extra):
        params = SamplingParams(n=n, temperature=1.5, top_p=1.0, max_tokens=max_tokens, logprobs=0, seed=seed,
                                output_kind=eng.output_kind, **extra)  # fmt: skip
        outs = [o async for o in eng.llm.generate({"prompt_token_ids": list(PROMPT)}, params, f"own-{seed}")]
        return sorted(outs[-1].outputs, key=lambda c: c.index)

    texts = 0
    assert eng.decode_text_once is True  # the default (actors.decode_text_once=true)
    default = eng.decode_text_once
    for k, stream in enumerate((False, True, None, True)):
        eng.decode_text_once = True  # (the default; set here so the test keeps its meaning if that changes)
        try:
            ours = loop.run_until_complete(
                eng.generate_group(PROMPT, 4, 1.5, 1.0, 48, f"text-{k}", seed=300 + 10 * k, stream=stream)
            )
        finally:
            eng.decode_text_once = default
        theirs = loop.run_until_complete(vllm_own(300 + 10 * k, 4, 48))
        for a, b in zip(ours, theirs, strict=True):
            assert a.token_ids == list(b.token_ids) and a.finish_reason == str(b.finish_reason)
            assert a.text == b.text, (a.token_ids, a.text, b.text)
            texts += len(b.text)
    assert texts > 100  # the tokens decode to text: the comparison could fail

    # Completions ended by a stop token: vLLM drops that token from the text. The stop ids are tokens
    # the seeded completions above sample, so these requests end on them.
    ids = [t for c in loop.run_until_complete(vllm_own(300, 4, 48)) for t in c.token_ids]
    stops = [ids[5], ids[20], ids[40]]
    stopped = loop.run_until_complete(vllm_own(300, 4, 48, stop_token_ids=stops))
    on_ids = [c for c in stopped if c.stop_reason in stops]  # (an EOS has stop_reason None)
    assert len(on_ids) >= 2, [(c.finish_reason, c.stop_reason) for c in stopped]
    plain = SamplingParams(n=4, temperature=1.5, max_tokens=48, logprobs=0, detokenize=False)
    tok = eng.llm.output_processor.tokenizer
    for c in stopped:
        got = completion_text(tok, PROMPT, c.token_ids, plain, str(c.finish_reason), "stop")
        assert got == c.text, (c.token_ids, got, c.text)
    for c in on_ids:  # the stop token (a plain one here) is really what the text leaves out
        assert completion_text(tok, PROMPT, c.token_ids, plain, "length", "stop") != c.text


def test_one_call_commit_serves_what_the_paused_commit_serves_without_pausing(rig) -> None:
    """A staged swap committed by one engine-core utility call (asyncrl.actors.atomic_commit: commit,
    label, KV reset between two steps) serves, to the bit, what the paused five-call sequence serves,
    labelled with its own version, and never pauses the scheduler; the paused sequence stays available
    (``atomic_commit = False``, what engines on vLLM's own executors use)."""
    eng, tr, run = rig["engine"], rig["transport"], rig["loop"].run_until_complete
    base = (eng.version or 0) + 500
    w = rig["weights"](9)
    pauses: list[str] = []
    core = eng.llm.engine_core
    paused = core.pause_scheduler_async

    async def spy(*args: Any, **kwargs: Any) -> Any:  # observes; the real pause still runs
        pauses.append(kwargs.get("mode", args[0] if args else ""))
        return await paused(*args, **kwargs)

    eng.staging = True
    core.pause_scheduler_async = spy
    try:
        eng.atomic_commit = False
        res_p = run(eng.swap_weights(tr.publish(base, w, "float32").path, base, "in_flight"))
        s_p = _seeded(rig, "paused-commit")
        assert res_p.staged and pauses == ["keep"]
        eng.atomic_commit = None  # ask the engine core again
        res_a = run(eng.swap_weights(tr.publish(base + 1, w, "float32").path, base + 1, "in_flight"))
        s_a = _seeded(rig, "one-call-commit")
        assert res_a.staged and eng.atomic_commit is True and pauses == ["keep"]  # no second pause
    finally:
        del core.pause_scheduler_async
        eng.staging = False
    assert all(set(s.versions) == {base} for s in s_p) and all(set(s.versions) == {base + 1} for s in s_a)
    for a, b in zip(s_p, s_a, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs  # bitwise
    assert _max_err(rig["hf"](w), s_a) < TOL


def test_staged_swap_under_running_requests_labels_every_token(rig) -> None:
    """A staged swap while groups are generating: the stage builds while tokens keep coming, every
    token is labelled with the version that sampled it and matches HF under that version's weights,
    both in a streamed group (which times the swap) and in one handed over once it ends (the default):
    vLLM's version spans cover the whole completion either way."""
    eng, tr, loop = rig["engine"], rig["transport"], rig["loop"]
    w_old, w_new = rig["weights"](6), rig["weights"](7)
    loop.run_until_complete(eng.swap_weights(tr.publish(20, w_old, "float32").path, 20, "in_flight"))
    m = tr.publish(21, w_new, "float32")
    eng.staging = True

    async def scenario():
        task = asyncio.ensure_future(
            eng.generate_group(PROMPT, 2, TEMPERATURE, 1.0, 100, "span", seed=7, stream=True)
        )
        final = asyncio.ensure_future(
            eng.generate_group(PROMPT, 2, TEMPERATURE, 1.0, 100, "span-final", seed=8, stream=False)
        )
        while eng.progress.get("span", 0) < 10:
            await asyncio.sleep(0.001)
        res = await eng.swap_weights(m.path, 21, "in_flight")
        return res, await task, await final

    try:
        res, streamed, final = loop.run_until_complete(scenario())
    finally:
        eng.staging = False
    # Committed by one engine-core call between two steps (asyncrl.actors.atomic_commit), no pause.
    assert res.staged and res.pause_s < 5.0 and eng.atomic_commit is True
    hf = {20: rig["hf"](w_old), 21: rig["hf"](w_new)}
    assert sum(set(s.versions) == {20, 21} for s in final) >= 1, [s.versions for s in final]
    for s in streamed + final:
        assert s.versions == sorted(s.versions) and set(s.versions) <= {20, 21}
        ids = torch.tensor([PROMPT + s.token_ids])
        for v, model in hf.items():
            with torch.no_grad():
                logits = model(ids).logits[0, len(PROMPT) - 1 : -1].float()
            lp = torch.log_softmax(logits / TEMPERATURE, -1).gather(1, torch.tensor(s.token_ids)[:, None])[
                :, 0
            ]
            mask = torch.tensor(s.versions) == v
            if mask.any():
                assert float((lp[mask] - torch.tensor(s.logprobs)[mask]).abs().max()) < TOL
    assert sum(set(s.versions) == {20, 21} for s in streamed) >= 1, [s.versions for s in streamed]


def test_staged_swaps_in_a_row_recycle_scratch_and_serve_what_in_place_reloads_serve(rig) -> None:
    """Two staged swaps back to back, with different weights: the second stage loads into the scratch the
    first one's packing freed (asyncrl.actors.stage_shadow.Scratch, holding the other version's layers), and
    each serves, to the bit, what vLLM's in-place reload of the same weights serves."""
    eng, tr, run = rig["engine"], rig["transport"], rig["loop"].run_until_complete
    base = (eng.version or 0) + 300  # above whatever the module's other tests left serving
    wa, wb = rig["weights"](10), rig["weights"](11)

    def swap(v: int, w: dict, staged: bool) -> list:
        eng.staging = staged
        res = run(eng.swap_weights(tr.publish(v, w, "float32").path, v, "in_flight"))
        assert res.staged == staged and eng.version == v
        tr.delete(v)
        return _seeded(rig, f"recycle-{v}")

    try:
        in_a = swap(base, wa, False)
        st_b = swap(base + 1, wb, True)
        st_a = swap(base + 2, wa, True)
        (poll,) = run(eng.llm.collective_rpc("asyncrl_stage_poll"))
        in_b = swap(base + 3, wb, False)
    finally:
        eng.staging = False
    assert poll["recycled_bytes"] > 0 and poll["error"] is None, poll
    for x, y in ((in_a, st_a), (in_b, st_b)):
        for a, b in zip(x, y, strict=True):
            assert a.token_ids == b.token_ids and a.logprobs == b.logprobs  # bitwise
    assert [s.logprobs for s in st_a] != [s.logprobs for s in st_b]  # the versions really differ


def test_a_staged_swap_frees_the_version_it_replaced_without_waiting_for_the_garbage_collector(rig) -> None:
    """Every tensor a commit replaced is freed by the retire thread shortly after the pause. The stage's
    bookkeeping once held the whole shadow tree in a reference cycle (the build's ``process`` callback
    and the tree referring to each other), so the replaced version, oneDNN handles included, lived until
    Python's oldest generation was collected: +1.1 GB of RSS every third 300M swap in a row."""
    eng, tr, run = rig["engine"], rig["transport"], rig["loop"].run_until_complete
    base = (eng.version or 0) + 400
    try:
        eng.staging = True
        for i in range(2):  # the second commit replaces tensors that the first stage built
            v = base + i
            res = run(eng.swap_weights(tr.publish(v, rig["weights"](20 + i), "float32").path, v, "in_flight"))
            assert res.staged and eng.version == v
            tr.delete(v)
        deadline = time.monotonic() + 3.0
        while True:
            (poll,) = run(eng.llm.collective_rpc("asyncrl_stage_poll"))
            if poll["retired_alive"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        eng.staging = False
    assert poll["error"] is None and poll["retired_alive"] == 0, poll


def _idle_cpu_s(procs) -> float:
    """CPU-s ``procs`` use over 0.4-1.2 s from now (the engine has just finished a request)."""
    time.sleep(0.4)
    before = {p.pid: sum(p.cpu_times()[:2]) for p in procs}
    time.sleep(0.8)
    return sum(sum(p.cpu_times()[:2]) - before[p.pid] for p in procs)


def test_a_cpu_engine_keeps_the_memory_its_swaps_free_from_its_size_on(rig) -> None:
    """actors.cpu_keep_freed_memory (default on) reaches the worker, which leaves a checkpoint below
    cpu_heap.MIN_BYTES (this tiny one) to glibc's defaults; the multiprocess engine's test below sets the
    size to 0 and gets the kept heap (the mechanism itself is tested in test_cpu_heap)."""
    got = rig["loop"].run_until_complete(rig["engine"].heap_policy())
    assert got.startswith("off: checkpoint 1.") and got.endswith("< 64 MiB"), got


def test_in_process_engine_has_no_worker_process_and_sleeps_when_idle(rig) -> None:
    """actors.engine_executor=auto on CPU (the rig's engine): the worker runs inside the engine-core
    process (asyncrl.actors.inproc_executor), so there is no worker process and no shared-memory queue;
    the idle engine uses no CPU (vLLM's multiprocess executor spins 1 s after every message: 0.60 CPU-s
    in the same 0.8 s window). The engine core gets the OpenMP binding vLLM gives its worker."""
    import psutil

    eng = rig["engine"]
    assert eng.in_process
    if eng.version is None:  # run alone: load weights first
        m = rig["transport"].publish(7, rig["weights"](0), "float32")
        rig["loop"].run_until_complete(eng.load_weights(m.path, 7))
    _sample(rig, "idle-0")
    procs = psutil.Process().children(recursive=True)
    names = [p.name() for p in procs]
    assert not any("Worker" in n for n in names) and sum("EngineCor" in n for n in names) == 1, names
    core = next(p for p in procs if "EngineCor" in p.name())
    # vLLM's OpenMP binding for its rank-0 worker (VLLM_CPU_OMP_THREADS_BIND=auto: one core kept back)
    # reached the engine core: libgomp bound its main thread when it loaded (the test process is unbound).
    mine = os.sched_getaffinity(0)
    if len(mine) > 1:
        assert 1 <= len(core.cpu_affinity()) < len(mine) and set(core.cpu_affinity()) <= mine
    # The engine core alone: the test process's other children (the session's redis-server, a local Ray
    # started by an earlier module) have their own background CPU, which is not the engine's.
    used = _idle_cpu_s([core])
    assert used < 0.15, f"the engine core used {used:.2f} CPU-s while idle"


def test_multiproc_engine_swaps_exactly_and_bounds_its_busy_wait(rig, tmp_path: Path) -> None:
    """actors.engine_executor=multiproc (also what TP/PP > 1 use): the worker in its own process behind
    asyncrl's quiet executor. A swap through the cross-process collective_rpc serves exactly the new
    weights, and with actors.engine_busy_loop_ms = 100 its processes (engine core, worker) sleep once
    that window has passed: their CPU time over 0.4-1.2 s after the last output is near zero, where
    vLLM's own 1 s spin burns most of a core (the same test at 1000 ms: 0.60 CPU-s in the 0.8 s)."""
    import psutil

    from asyncrl.actors.engine import Engine

    model_dir = rig["engine"].model_path
    others = {p.pid for p in psutil.Process().children(recursive=True)}  # the rig's engine
    eng = Engine(model_dir, dtype="float32", kv_cache_bytes=32 << 20, max_model_len=128, busy_loop_ms=BUSY_MS,
                 executor="multiproc", staging=True, keep_freed_from=0)  # fmt: skip
    loop = rig["loop"]
    try:
        assert not eng.in_process
        # The kept heap reaches a worker in its own process (from any size here: min bytes 0).
        assert loop.run_until_complete(eng.heap_policy()) == "kept"
        m = rig["transport"].publish(11, rig["weights"](3), "float32")
        res = loop.run_until_complete(eng.swap_weights(m.path, 11, "in_flight"))
        # The stage built in the worker process, committed by the engine core's one-call commit (its
        # collective_rpc to the worker returns before the next step).
        assert res.staged and eng.atomic_commit is True
        seqs = loop.run_until_complete(eng.generate_group(PROMPT, 2, TEMPERATURE, 1.0, 12, "mp-0"))
        assert all(set(x.versions) == {11} for x in seqs)
        assert _max_err(rig["hf"](rig["weights"](3)), seqs) < TOL
        mine = [p for p in psutil.Process().children(recursive=True) if p.pid not in others]
        names = [p.name() for p in mine]
        assert any("Worker" in n for n in names) and any("EngineCor" in n for n in names), names
        used = _idle_cpu_s(mine)
        assert used < 0.15, f"engine processes used {used:.2f} CPU-s while idle (busy-wait not bounded)"
    finally:
        eng.shutdown()


def _actor_rig(rig, redis_url: str, run_dir: Path, run_name: str, overrides: list[str]):
    """A RolloutActor (no group workers running) on the module's engine, serving a fresh base version
    published over shm; returns (transport, buffer, actor, base)."""
    from asyncrl.actors.actor import RolloutActor
    from asyncrl.buffer import ReplayBuffer
    from asyncrl.config import load_config

    cfg = load_config(overrides=[f"run.name={run_name}", f"run.dir={run_dir}", f"redis.url={redis_url}",
                                 "buffer.groups_per_step=1", "metrics.enabled=false", *overrides])  # fmt: skip
    eng, loop = rig["engine"], rig["loop"]
    tr = ShmTransport(shm_root(run_dir, run_name), rig["transport"].expected_names)
    buf = ReplayBuffer.from_config(cfg)
    actor = RolloutActor(cfg, run_dir, 0, redis_url=redis_url, model_path=eng.model_path)
    actor.engine = eng
    base = (eng.version or 0) + 100  # above whatever the module's other tests left serving
    buf.publish_weights(tr.publish(base, rig["weights"](0), "float32"))
    loop.run_until_complete(eng.load_weights(tr.version_dir(base) / "model.safetensors", base))
    return tr, buf, actor, base


def _close_actor_rig(buf, actor, tr) -> None:
    buf.delete_run()
    buf.close()
    actor.buffer.close()
    actor.timeline.close()
    tr.cleanup()


@contextlib.asynccontextmanager
async def _watching(actor):
    """The actor's version watcher running in the background for the body's length."""
    watcher = asyncio.create_task(actor._watch_versions())
    try:
        yield watcher
    finally:
        actor._stop_requested = True
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)


async def _until_serves(eng, version: int, why: str, limit_s: float = 4.0) -> float:
    """Seconds until ``eng`` serves ``version`` (fails after ``limit_s`` with ``why``)."""
    t0 = time.perf_counter()
    while eng.version != version:
        assert time.perf_counter() - t0 < limit_s, why
        await asyncio.sleep(0.005)
    return time.perf_counter() - t0


def test_worker_refused_for_stale_weights_starts_as_soon_as_its_engine_swapped(
    rig, redis_server, tmp_path: Path, run_name: str
) -> None:
    """max_staleness=0 (synchronous): after a publish every group worker is refused until its engine
    serves the new version, and no Redis hint announces that moment. The actor pulses its own admission
    waker when the swap returns, so the refused worker starts within milliseconds; before, it waited for
    its next poll (``actors.admission_poll_s``, 5 s here: the wait below would time out)."""
    from asyncrl.actors.admission_wake import AdmissionWaker

    poll_s = 5.0
    eng, loop = rig["engine"], rig["loop"]
    tr, buf, actor, base = _actor_rig(rig, redis_server.url, tmp_path / "run", run_name, [
        "buffer.max_staleness=0", f"actors.admission_poll_s={poll_s}", "actors.refuse_stale_weights=true",
    ])  # fmt: skip
    while buf.try_admit():  # use up the window of V = base (no version: not refused for staleness)
        pass
    waited: dict[str, float] = {}

    async def main() -> None:
        actor._wake = asyncio.Event()
        actor._waker = await asyncio.to_thread(AdmissionWaker(actor.buffer, loop, "t").start)
        try:
            # V = base + 1 frees one slot, but this engine's weights are now too stale for it.
            await asyncio.to_thread(buf.publish_weights, tr.publish(base + 1, rig["weights"](1), "float32"))
            task = asyncio.create_task(actor._admit())
            await asyncio.sleep(0.5)  # the publish hint came and went: refused, waiting for its poll
            assert not task.done() and actor.counters["admission_blocked"] == 1
            assert await actor._maybe_swap() and eng.version == base + 1
            t0 = time.perf_counter()
            assert await asyncio.wait_for(task, poll_s / 2)
            waited["after_swap"] = time.perf_counter() - t0
        finally:
            actor._waker.stop()

    try:
        loop.run_until_complete(main())
    finally:
        _close_actor_rig(buf, actor, tr)
    assert waited["after_swap"] < 0.5, waited  # typically 1-3 ms: one admission round trip


@pytest.mark.parametrize("serves", [True, False], ids=["swap-serves", "swap-refused"])
def test_worker_refused_for_stale_weights_is_admitted_while_the_swap_prepares(
    rig, redis_server, tmp_path: Path, run_name: str, serves: bool
) -> None:
    """max_staleness=0: a worker refused for stale weights takes its slot for the version the engine is
    preparing (during the prepare, not after the swap) and submits nothing until the engine serves it.
    A swap that does not serve it (its file refused) gives the slot back as a credit."""
    from asyncrl.actors.admission_wake import AdmissionWaker

    eng, loop = rig["engine"], rig["loop"]
    tr, buf, actor, base = _actor_rig(rig, redis_server.url, tmp_path / "run", run_name, [
        "buffer.max_staleness=0", "actors.admission_poll_s=5.0", "actors.refuse_stale_weights=true",
    ])  # fmt: skip
    while buf.try_admit():  # use up the window of V = base
        pass
    seen: dict[str, object] = {}

    async def main() -> None:
        actor._wake = asyncio.Event()
        actor._waker = await asyncio.to_thread(AdmissionWaker(actor.buffer, loop, "t").start)
        gate = asyncio.Event()

        async def verify() -> None:  # the prepare: held open until the test has looked
            await gate.wait()
            if not serves:
                raise ValueError("refused by the test")

        try:
            await asyncio.to_thread(buf.publish_weights, tr.publish(base + 1, rig["weights"](1), "float32"))
            task = asyncio.create_task(actor._admit())
            await asyncio.sleep(0.3)
            admitted0 = buf.stats()["admitted"]
            assert not task.done() and actor.counters["admission_blocked"] == 1  # refused: weights of V-1
            path = tr.version_dir(base + 1) / "model.safetensors"
            swap = asyncio.create_task(eng.swap_weights(path, base + 1, "in_flight", verify=verify))
            deadline = time.monotonic() + 10
            while buf.stats()["admitted"] == admitted0:  # the slot is taken during the prepare ...
                assert time.monotonic() < deadline, "no admission while the swap prepared"
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.05)
            # ... but nothing runs on the old weights meanwhile: the worker waits for the swap.
            assert not task.done() and eng.version == base and eng.swapping_to == base + 1
            seen["credits0"] = buf.stats()["credits"]
            gate.set()
            if serves:
                assert (await swap).version == base + 1
                assert await asyncio.wait_for(task, 2.0) and eng.version == base + 1
            else:
                with pytest.raises(ValueError, match="refused by the test"):
                    await swap
                await asyncio.sleep(0.3)
                assert not task.done() and eng.version == base  # refused again, waiting
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            seen["credits1"] = buf.stats()["credits"]
            seen["counters"] = dict(actor.counters)
        finally:
            actor._waker.stop()

    try:
        loop.run_until_complete(main())
    finally:
        _close_actor_rig(buf, actor, tr)
    c = seen["counters"]
    assert (c["preadmissions"], c["preadmissions_returned"]) == ((1, 0) if serves else (0, 1)), c
    # Refused: the slot taken for the version that never served went back (admission cannot leak).
    assert seen["credits1"] == seen["credits0"] + (0 if serves else 1), seen


def test_a_worker_cancelled_inside_its_admission_attempt_gives_the_slot_back(
    rig, redis_server, tmp_path: Path, run_name: str
) -> None:
    """A stop with abort can cancel a group worker while its admission script runs in its thread. The
    script still runs to its end (here: admits); the slot it took is credited back once it returns,
    tracked with the worker's writes, so nothing is left in the actor's in-flight tally."""
    import threading

    loop = rig["loop"]
    tr, buf, actor, _ = _actor_rig(rig, redis_server.url, tmp_path / "run", run_name, [])
    real, entered, release = actor.buffer.try_admit, threading.Event(), threading.Event()

    def held_try_admit(*args):  # the real script, started only once the test has cancelled the worker
        entered.set()
        release.wait(30)
        return real(*args)

    actor.buffer.try_admit = held_try_admit
    seen: dict[str, object] = {}

    async def main() -> None:
        actor._wake = asyncio.Event()
        before = buf.stats()
        task = asyncio.create_task(actor._admit())
        assert await asyncio.to_thread(entered.wait, 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        deadline = time.monotonic() + 10
        while buf.stats()["admitted"] == before["admitted"]:  # the script runs on after the cancel
            assert time.monotonic() < deadline, "the admission script never ran"
            await asyncio.sleep(0.01)
        await actor._writes_done()
        seen["before"], seen["after"] = before, buf.stats()
        seen["inflight"] = sum(int(v) for v in buf.client.hvals(buf.keys.inflight))

    try:
        loop.run_until_complete(main())
    finally:
        release.set()
        _close_actor_rig(buf, actor, tr)
    b, a = seen["before"], seen["after"]
    assert a["admitted"] == b["admitted"] + 1, seen  # the script did admit ...
    assert a["credits"] == b["credits"] + 1 and seen["inflight"] == 0, seen  # ... and the slot came back


def test_a_worker_cancelled_during_a_redis_freeze_gives_its_slot_back_without_holding_the_loop(
    rig, redis_server, tmp_path: Path, run_name: str
) -> None:
    """A stop with abort cancels a worker waiting for its engine's swap to settle while Redis is frozen
    (SIGSTOP on the real server). The slot's credit runs in a thread, tracked with the worker's writes:
    the cancellation returns at once and the event loop keeps running (before: the credit ran inline
    and held the loop until Redis answered); once Redis is back the credit lands."""
    import os
    import signal

    loop = rig["loop"]
    tr, buf, actor, _ = _actor_rig(rig, redis_server.url, tmp_path / "run", run_name,
                                   ["redis.retry_budget_s=20"])  # fmt: skip
    eng = rig["engine"]
    seen: dict[str, float] = {}

    async def main() -> None:
        # _await_swap's worker holds a slot (admitted for the version the swap prepares): its owner's
        # tally has it, so its give-back is a credit (a slot the tally does not hold credits nothing).
        assert buf.try_admit(1, 64, owner=actor.actor_id)
        before = buf.stats()["credits"]
        eng.swap_settled.clear()  # a swap in progress: the worker waits for it to settle
        task = asyncio.create_task(actor._await_swap((eng.version or 0) + 1))
        await asyncio.sleep(0.05)
        os.kill(redis_server.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            seen["cancel_s"] = time.monotonic() - t0
            t0 = time.monotonic()
            await asyncio.sleep(0.2)  # the loop runs on while the credit waits for Redis
            seen["loop_s"] = time.monotonic() - t0
            seen["pending"] = len(actor._writes)
            await asyncio.sleep(1.0)
        finally:
            os.kill(redis_server.pid, signal.SIGCONT)
            eng.swap_settled.set()
        await asyncio.wait_for(actor._writes_done(), 30)
        seen["credited"] = buf.stats()["credits"] - before

    try:
        loop.run_until_complete(main())
    finally:
        os.kill(redis_server.pid, signal.SIGCONT)
        eng.swap_settled.set()
        _close_actor_rig(buf, actor, tr)
    assert seen["cancel_s"] < 0.5 and seen["loop_s"] < 0.5, seen  # inline: >= the 1.2 s freeze
    assert seen["pending"] == 1 and seen["credited"] == 1, seen


def test_swap_min_lag_skips_versions_until_due_and_a_waiting_worker_makes_a_swap_due_at_once(
    rig, redis_server, tmp_path: Path, run_name: str, monkeypatch
) -> None:
    """actors.swap_min_lag=2 at max_staleness 4: one version ahead is not swapped in, two are (straight
    to the newest); one ahead is swapped in as soon as a group worker waits on admission: the waiting
    worker wakes the watcher (its registry poll is 5 s here, so a swap within a second was woken)."""
    from asyncrl.actors import version_watch

    monkeypatch.setattr(version_watch, "MANIFEST_POLL_S", 5.0)
    eng, loop = rig["engine"], rig["loop"]
    tr, buf, actor, base = _actor_rig(rig, redis_server.url, tmp_path / "run", run_name, [
        "buffer.max_staleness=4", "actors.admission_poll_s=5.0", "actors.admission_events=false",
        "actors.swap_min_lag=2",
    ])  # fmt: skip

    def publish(v: int) -> None:
        buf.publish_weights(tr.publish(v, rig["weights"](v - base), "float32"))

    seen: dict[str, object] = {}

    async def main() -> None:
        actor._wake = asyncio.Event()
        await asyncio.to_thread(publish, base + 1)
        seen["lag1"] = (await actor._maybe_swap(), eng.version)
        await asyncio.to_thread(publish, base + 2)
        seen["lag2"] = (await actor._maybe_swap(), eng.version, actor.counters["swaps"])
        async with _watching(actor):
            await asyncio.to_thread(publish, base + 3)
            await asyncio.sleep(1.0)  # the publish hint woke the watcher: one ahead, nobody waiting
            seen["lag1_watched"] = eng.version
            while await asyncio.to_thread(buf.try_admit):  # fill the window: the next worker waits
                pass
            task = asyncio.create_task(actor._admit())
            seen["woken_s"] = await _until_serves(
                eng, base + 3, "the waiting worker did not wake the watcher"
            )
            seen["blocked"] = actor.counters["admission_blocked"]
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    try:
        loop.run_until_complete(main())
    finally:
        _close_actor_rig(buf, actor, tr)
    assert seen["lag1"] == (False, base)
    assert seen["lag2"] == (True, base + 2, 1)  # v(base+1) was never staged
    assert seen["lag1_watched"] == base + 2
    assert seen["blocked"] == 1 and seen["woken_s"] < 1.0, seen
    out = _sample(rig, "lag")  # the served weights are exactly v(base+3)
    assert _max_err(rig["hf"](rig["weights"](3)), out) < TOL


def test_a_swap_woken_by_a_notification_serves_its_manifest_without_reading_the_registry(
    rig, redis_server, tmp_path: Path, run_name: str, monkeypatch
) -> None:
    """The version notification carries the registered manifest: the watcher swaps straight to it (no
    registry scan on the way from a publish to the swap). A stale hint (not newer than what is served)
    or one whose path is outside the run falls back to the registry, which then serves its own entry."""
    import dataclasses

    from asyncrl.actors import version_watch

    monkeypatch.setattr(version_watch, "MANIFEST_POLL_S", 5.0)  # no timed registry poll meanwhile
    eng, loop = rig["engine"], rig["loop"]
    tr, buf, actor, base = _actor_rig(rig, redis_server.url, tmp_path / "run", run_name, [])
    scans: list[int] = []
    scan = actor._scan_manifests

    def counted(*args, **kwargs):
        scans.append(1)
        return scan(*args, **kwargs)

    actor._scan_manifests = counted
    seen: dict[str, object] = {}

    def publish(v: int) -> None:
        buf.publish_weights(tr.publish(v, rig["weights"](v - base), "float32"))

    async def main() -> None:
        actor._wake = asyncio.Event()
        sub = await asyncio.to_thread(buf.subscribe_versions)
        try:
            await asyncio.to_thread(publish, base + 1)
            note = await asyncio.to_thread(sub.latest_note, 2.0)
        finally:
            sub.close()
        seen["note_is_registered"] = note["manifest"] == buf.manifest(base + 1)
        seen["hinted"] = (await actor._maybe_swap(hint=note["manifest"]), eng.version, len(scans))
        await asyncio.to_thread(publish, base + 2)
        seen["stale"] = (await actor._maybe_swap(hint=note["manifest"]), eng.version, len(scans))
        await asyncio.to_thread(publish, base + 3)
        outside = dataclasses.replace(
            buf.manifest(base + 3), path=str(tmp_path / "elsewhere" / "m.safetensors")
        )
        seen["outside"] = (await actor._maybe_swap(hint=outside), eng.version, len(scans))
        async with _watching(actor):
            channel = buf.keys.versions_channel
            while (
                dict(await asyncio.to_thread(buf._client.pubsub_numsub, channel)).get(channel.encode(), 0) < 1
            ):
                await asyncio.sleep(0.01)  # the watcher's subscription is confirmed: no notification is lost
            before = len(scans)
            await asyncio.to_thread(publish, base + 4)
            await _until_serves(eng, base + 4, "the notification did not lead to a swap")
            seen["watched_scans"] = len(scans) - before

    try:
        loop.run_until_complete(main())
    finally:
        _close_actor_rig(buf, actor, tr)
    assert seen["note_is_registered"], seen
    assert seen["hinted"] == (True, base + 1, 0), seen  # served from the note: no scan
    assert seen["stale"] == (True, base + 2, 1), seen  # the hint is v(base+1), served: the registry's newest
    assert seen["outside"] == (True, base + 3, 2), seen  # ignored, not refused: the registry's entry serves
    assert actor.counters["weight_rejects"] == 0, actor.counters
    assert seen["watched_scans"] == 0, seen
    out = _sample(rig, "hint")  # the served weights are exactly v(base+4)
    assert _max_err(rig["hf"](rig["weights"](4)), out) < TOL


def test_a_registered_version_whose_file_vanished_is_skipped_not_remembered(
    rig, redis_server, tmp_path: Path, run_name: str
) -> None:
    """The newest registered manifest's file is gone (pruned or recycled after registration): the
    watcher serves the next older valid version in the same call, counts it, and does not remember it
    as refused (newer weights replaced it; nothing about the version was wrong)."""
    eng, loop = rig["engine"], rig["loop"]
    tr, buf, actor, base = _actor_rig(rig, redis_server.url, tmp_path / "run", run_name, [])
    try:
        for v in (base + 1, base + 2):
            buf.publish_weights(tr.publish(v, rig["weights"](v - base), "float32"))
        gone = buf.manifest(base + 2)
        tr.delete(base + 2)  # the manifest stays registered
        assert loop.run_until_complete(actor._maybe_swap()) is True
        assert eng.version == base + 1, eng.version
        assert actor.counters["weight_rejects"] == 1 and (gone.version, gone.sha256) not in actor._rejected
        # The loop did not fail: a newer version is served by the next call as usual.
        buf.publish_weights(tr.publish(base + 3, rig["weights"](3), "float32"))
        assert loop.run_until_complete(actor._maybe_swap()) is True and eng.version == base + 3
    finally:
        _close_actor_rig(buf, actor, tr)
    out = _sample(rig, "vanished")  # the served weights are exactly v(base+3)
    assert _max_err(rig["hf"](rig["weights"](3)), out) < TOL


def test_idle_engine_builds_the_stage_inside_one_rpc_and_a_busy_one_in_a_thread(rig) -> None:
    """Nothing generating (the synchronous case): the stage is built inside the begin RPC (no thread
    start, no polls); with a group running it is built in the worker's thread and polled, so tokens keep
    coming. Both serve the staged version (exactness itself: the staged tests above)."""
    eng, tr, loop = rig["engine"], rig["transport"], rig["loop"]
    calls: list[tuple[str, tuple]] = []
    rpc = eng.llm.collective_rpc

    async def counted(method, *a, **k):
        calls.append((method, tuple(k.get("args", ()))))
        return await rpc(method, *a, **k)

    base = (eng.version or 0) + 200
    eng.staging, eng.llm.collective_rpc = True, counted
    try:
        res = loop.run_until_complete(eng.swap_weights(tr.publish(base, rig["weights"](8), "float32").path,
                                                       base, "in_flight"))  # fmt: skip
        methods = [m for m, _ in calls]
        assert res.staged and eng.version == base
        assert methods.count("asyncrl_stage_begin") == 1 and "asyncrl_stage_poll" not in methods, methods
        assert next(a for m, a in calls if m == "asyncrl_stage_begin")[2] is True  # wait=True
        # Staged, the worker's build and the front end's header check (beside it) both check the tag:
        # a file tagged v8 announced as another version is refused before any pause, the version stays.
        bad = tr.publish(base + 5, rig["weights"](8), "float32")
        with pytest.raises(ValueError, match=f"expected {base + 6}|announced as v{base + 6}"):
            loop.run_until_complete(eng.swap_weights(bad.path, base + 6, "in_flight"))
        assert eng.version == base
        calls.clear()

        async def busy() -> None:
            gen = asyncio.ensure_future(eng.generate_group(PROMPT, 2, TEMPERATURE, 1.0, 100, "busy-stage"))
            while eng.in_flight == 0:
                await asyncio.sleep(0.001)
            await eng.swap_weights(
                tr.publish(base + 1, rig["weights"](9), "float32").path, base + 1, "in_flight"
            )
            seqs = await gen
            assert all(set(s.versions) <= {base, base + 1} for s in seqs)

        loop.run_until_complete(busy())
        methods = [m for m, _ in calls]
        assert eng.version == base + 1 and "asyncrl_stage_poll" in methods, methods
        assert next(a for m, a in calls if m == "asyncrl_stage_begin")[2] is False
    finally:
        eng.staging, eng.llm.collective_rpc = False, rpc


def _exact_per_version(models: dict, seqs) -> None:
    """Every token's logprob is the one the weights of its label give (HF fp32 recompute)."""
    for s in seqs:
        ids = torch.tensor([PROMPT + s.token_ids])
        for v in set(s.versions):
            with torch.no_grad():
                logits = models(v)(ids).logits[0, len(PROMPT) - 1 : -1].float()
            lp = torch.log_softmax(logits / TEMPERATURE, -1).gather(1, torch.tensor(s.token_ids)[:, None])[
                :, 0
            ]
            mask = torch.tensor(s.versions) == v
            err = float((lp[mask] - torch.tensor(s.logprobs)[mask]).abs().max())
            assert err < TOL, f"tokens labelled v{v} were not sampled by v{v}'s weights (err {err:.3g})"


@pytest.mark.parametrize("path", ["in_place", "staged_paused", "staged_one_call"])
def test_a_swap_cancelled_at_any_point_leaves_the_engine_running_its_label_true_and_swappable(
    rig, path
) -> None:
    """The actor cancels its version watcher, possibly inside a swap, when a group worker fails; the
    engine (and a stage being built) outlives that. Cancelled at every point of the sequence (begin /
    stage polls, pause, commit or reload, label, resume): the engine is not left paused (a group running
    meanwhile and a new one finish), ``Engine.version`` names the weights that serve and label the
    tokens (each token matches the HF recompute under its label's weights), and the next swap works (no
    stage left building)."""
    eng, tr, loop = rig["engine"], rig["transport"], rig["loop"]
    hf_models: dict[int, Any] = {}

    def weights(v: int) -> dict[str, torch.Tensor]:  # three weight sets: v, v+1 and v+2 all differ
        return rig["weights"](40 + v % 3)

    def model(v: int):
        if v % 3 not in hf_models:
            hf_models[v % 3] = rig["hf"](weights(v))
        return hf_models[v % 3]

    offset = {"in_place": 1000, "staged_paused": 2000, "staged_one_call": 3000}[path]
    v = (eng.version or 0) + offset
    loop.run_until_complete(eng.swap_weights(tr.publish(v, weights(v), "float32").path, v, "in_flight"))
    eng.staging = path != "in_place"
    eng.atomic_commit = False if path == "staged_paused" else None
    committed = []
    # Cancel points 0-40 ms into the swap; on a loaded box a (staged) swap can outlast all of them, and
    # then the sweep goes on with longer delays until one swap committed (up to ~3 s).
    delays = list(range(0, 41, 2))
    try:
        for i in itertools.count():
            if i == len(delays):
                if any(committed) or delays[-1] >= 3000:
                    break
                delays.append(int(delays[-1] * 1.5))
            delay_ms = delays[i]

            async def cancelled_swap(i=i, delay_ms=delay_ms, v=v):
                bg = asyncio.ensure_future(
                    eng.generate_group(PROMPT, 2, TEMPERATURE, 1.0, 60, f"bg-{path}-{i}")
                )
                while eng.in_flight == 0:  # busy: a stage is built in the worker's thread and polled
                    await asyncio.sleep(0.001)
                m = tr.publish(v + 1, weights(v + 1), "float32")
                swap = asyncio.ensure_future(eng.swap_weights(m.path, v + 1, "in_flight"))
                await asyncio.sleep(delay_ms / 1000)
                swap.cancel()
                await asyncio.gather(swap, return_exceptions=True)
                assert eng.swapping_to is None and eng._admit.is_set()
                running = await asyncio.wait_for(bg, 60)  # never finishes on a paused engine
                after = await asyncio.wait_for(
                    eng.generate_group(PROMPT, 2, TEMPERATURE, 1.0, 12, f"after-{path}-{i}"), 60
                )
                return running, after

            running, after = loop.run_until_complete(cancelled_swap())
            served = eng.version
            assert served in (v, v + 1), (delay_ms, served)
            committed.append(served == v + 1)
            assert all(set(s.versions) == {served} for s in after), (
                delay_ms,
                served,
                [s.versions for s in after],
            )
            _exact_per_version(model, running + after)
            nxt = v + 2
            res = loop.run_until_complete(
                eng.swap_weights(tr.publish(nxt, weights(nxt), "float32").path, nxt, "in_flight")
            )
            assert eng.version == nxt and res.staged == (path != "in_place")
            _exact_per_version(model, _sample(rig, f"next-{path}-{i}"))
            for old in (v, v + 1):
                tr.delete(old)
            v = nxt
    finally:
        eng.staging, eng.atomic_commit = False, None
    # The sweep cancelled swaps before they served and after (both sides of the commit were hit).
    assert any(committed) and not all(committed), committed


def test_files_of_the_wrong_shape_unreadable_or_vanished_are_refusals_and_the_old_weights_serve(
    rig, tmp_path: Path
) -> None:
    """Content failures are WeightIntegrityError s (WeightFileError; WeightFileGone for a file that is
    not there), raised before the pause, staged or in place: a file with the right names and tag but a
    wrong shape (which an in-place reload would have loaded halfway), a file that is not safetensors, a
    path that does not exist, and a file pruned while a between_groups swap drained (the worker's reopen
    inside the pause fails; the model keeps its weights). The old weights keep serving exactly."""
    from asyncrl.buffer.weights import WeightFileError, WeightFileGone, WeightIntegrityError

    eng, tr, loop = rig["engine"], rig["transport"], rig["loop"]
    run = loop.run_until_complete
    v = (eng.version or 0) + 4000
    run(eng.swap_weights(tr.publish(v, rig["weights"](50), "float32").path, v, "in_flight"))
    ref = rig["hf"](rig["weights"](50))

    def still_serves(rid: str) -> None:
        s = _sample(rig, rid)
        assert eng.version == v and all(set(x.versions) == {v} for x in s) and _max_err(ref, s) < TOL

    w = rig["weights"](51)
    name = next(k for k, t in w.items() if t.dim() == 2 and "embed" not in k)
    shaped = ShmTransport(tmp_path / "shape")  # no expected names: writes what it is given
    m_shape = shaped.publish(v + 1, {**w, name: w[name][:-1].clone()}, "float32")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{bad}   " + b"\0" * 64)
    try:
        for staging in (False, True):
            eng.staging = staging
            with pytest.raises(WeightFileError, match="shape"):
                run(eng.swap_weights(m_shape.path, v + 1, "in_flight"))
            with pytest.raises(WeightFileError, match="unreadable|staging"):
                run(eng.swap_weights(junk, v + 1, "in_flight"))
            with pytest.raises(WeightFileGone):
                run(eng.swap_weights(tmp_path / "never.safetensors", v + 1, "in_flight"))
            still_serves(f"refused-{staging}")
    finally:
        eng.staging = False
        shaped.cleanup()
    # Pruned during a between_groups drain: the in-place reload reopens the path inside the pause.
    m = tr.publish(v + 2, rig["weights"](52), "float32")

    async def pruned_while_draining() -> BaseException | None:
        bg = asyncio.ensure_future(eng.generate_group(PROMPT, 2, TEMPERATURE, 1.0, 80, "draining"))
        while eng.in_flight == 0:
            await asyncio.sleep(0.001)
        swap = asyncio.ensure_future(eng.swap_weights(m.path, v + 2, "between_groups"))
        while eng._admit.is_set():  # the header checks passed; now draining
            await asyncio.sleep(0.001)
        assert not bg.done(), "the group ended before the file could be pruned"
        tr.delete(v + 2)
        await bg
        try:
            await swap
        except BaseException as e:
            return e
        return None

    err = run(pruned_while_draining())
    assert isinstance(err, WeightFileGone) and isinstance(err, WeightIntegrityError), repr(err)
    still_serves("after-pruned")
