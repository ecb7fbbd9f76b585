"""The stage's recorded loads (asyncrl.actors.stage_replay.Recorder) on plain torch tensors.

A replay must write exactly what the loaders write, for any later file of the same layout, and every
load the plan cannot express must be refused (that engine then keeps the loaders' path). The replay on
the real vLLM engine (bitwise against the loaders' stage, and against an fp32 HF recompute) is in
tests/integration/test_weight_swap.py.
"""

from __future__ import annotations

import gc

import torch

from asyncrl.actors.stage_replay import PlanMismatch, Recorder, Replay


def _ckpt(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(4, 6, generator=g),
        "k": torch.randn(2, 6, generator=g),
        "v": torch.randn(2, 6, generator=g),
        "emb": torch.randn(5, 3, generator=g),
        "wt": torch.randn(6, 4, generator=g),  # stored transposed
        "shard": torch.randn(3, 8, generator=g),  # a TP rank's half of its columns
    }


class _Layer(torch.nn.Module):
    def __init__(self, **shapes: tuple[int, ...]) -> None:
        super().__init__()
        for name, shape in shapes.items():
            self.register_parameter(name, torch.nn.Parameter(torch.empty(shape), requires_grad=False))


def _layers() -> dict[str, _Layer]:
    return {"qkv": _Layer(weight=(8, 6)), "emb": _Layer(weight=(7, 3)), "mix": _Layer(a=(4, 6), b=(3, 4))}


def _load(layers: dict[str, _Layer], ck: dict[str, torch.Tensor]) -> None:
    """What vLLM's loaders do, in kind: stacked shards, padding filled, a transposed and a narrowed view."""
    qkv = layers["qkv"].weight
    for name, (off, n) in {"q": (0, 4), "k": (4, 2), "v": (6, 2)}.items():
        qkv.data.narrow(0, off, n).copy_(ck[name])
    emb = layers["emb"].weight
    emb.data[:5].copy_(ck["emb"])
    emb.data[5:].fill_(0.0)  # vocabulary padding
    layers["mix"].a.data.copy_(ck["wt"].t())
    layers["mix"].b.data.copy_(ck["shard"].narrow(1, 4, 4))


def _record(layers: dict[str, _Layer], ck: dict[str, torch.Tensor], load=_load) -> Recorder:
    rec = Recorder()
    for layer in layers.values():
        for name, p in layer._parameters.items():
            rec.target(id(layer), "_parameters", name, p)
    for name, t in ck.items():
        rec.source(name, t)
    with rec:
        load(layers, ck)
    for layer in layers.values():
        rec.processed(id(layer), layer, layer)
    return rec


def _replay(plan, layers: dict[str, _Layer], ck: dict[str, torch.Tensor]) -> None:
    """What Stager._replay does with the plan (its shadows are the layers here)."""
    replay = Replay(plan, ck.__getitem__)
    for i, (live, _) in enumerate(plan.layers):
        replay.layer(i, live.__dict__)
    assert not replay.read  # every checkpoint tensor dropped after its last reader


def test_recorded_copies_and_fills_replay_the_loaders_to_the_bit_for_another_file() -> None:
    first = _layers()
    rec = _record(first, _ckpt(0))
    plan = rec.plan(tuple(sorted(_ckpt(0))), {id(v): v for v in first.values()})
    assert rec.why is None and plan is not None
    assert [len(cs) for _, cs in plan.layers] == [3, 2, 2]
    assert [c.fill for c in plan.layers[1][1]] == [None, 0.0]
    # Another version of the file: the loaders into fresh tensors, and the replay into other fresh ones
    # whose memory holds garbage (nothing of the expected values can be left over).
    ck = _ckpt(1)
    by_loaders, by_replay = _layers(), _layers()
    for layer in by_replay.values():
        for p in layer.parameters():
            p.data.fill_(float("nan"))
    _load(by_loaders, ck)
    plan.layers = [(by_replay[k], cs) for k, (_, cs) in zip(by_replay, plan.layers, strict=True)]
    _replay(plan, by_replay, ck)
    for k in by_loaders:
        for (n, a), (_, b) in zip(
            by_loaders[k].named_parameters(), by_replay[k].named_parameters(), strict=True
        ):
            assert torch.equal(a, b), (k, n)
    # ... and the values are the file's (not the first file's: the comparison can fail).
    assert torch.equal(by_replay["qkv"].weight[4:6], ck["k"]) and torch.equal(
        by_replay["mix"].a, ck["wt"].t()
    )
    assert not torch.equal(by_replay["qkv"].weight[4:6], _ckpt(0)["k"])
    assert torch.equal(by_replay["emb"].weight[5:], torch.zeros(2, 3))


def test_a_file_of_another_layout_stops_the_replay() -> None:
    first = _layers()
    plan = _record(first, _ckpt(0)).plan(tuple(sorted(_ckpt(0))), {id(v): v for v in first.values()})
    other = dict(_ckpt(1), k=torch.randn(2, 6, dtype=torch.float64))
    fresh = _layers()
    plan.layers = [(fresh[k], cs) for k, (_, cs) in zip(fresh, plan.layers, strict=True)]
    try:
        _replay(plan, fresh, other)
    except PlanMismatch as e:
        assert "k" in str(e)
    else:
        raise AssertionError("a float64 'k' replayed as the recorded float32 one")


def _refusal(load, ck: dict[str, torch.Tensor] | None = None) -> str | None:
    layers = _layers()
    rec = _record(layers, ck if ck is not None else _ckpt(0), load)
    plan = rec.plan(("x",), {id(v): v for v in layers.values()})
    assert (plan is None) == (rec.why is not None)
    return rec.why


def test_writes_the_plan_cannot_express_are_refused_with_the_target() -> None:
    def converted(layers, ck):  # a computed source: not a view of what the file holds
        layers["mix"].a.data.copy_((ck["wt"] * 2).t())

    def transformed(layers, ck):  # an in-place transform after the copy (composed_weight_loader)
        layers["qkv"].weight.data[:4].copy_(ck["q"])
        layers["qkv"].weight.data.mul_(2)

    def out_arg(layers, ck):  # an out= write into the target
        torch.add(ck["q"], 1, out=layers["mix"].a.data)

    def source_changed(layers, ck):  # the file's tensor changed in place, then copied
        ck["q"].mul_(2)
        layers["qkv"].weight.data[:4].copy_(ck["q"])

    def rebound(layers, ck):  # no write the dispatcher sees: the tensor is replaced
        layers["mix"].a.data = ck["wt"].t().contiguous()

    def value_fill(layers, ck):  # a scalar read from the file: the fill would replay the first value
        layers["qkv"].weight.data[:4].copy_(ck["q"])
        layers["qkv"].weight.data[4:].fill_(ck["k"][0, 0].item())

    def branch(layers, ck):  # a choice made on the file's values
        if bool((ck["q"] > 0).any()):
            layers["qkv"].weight.data[:4].copy_(ck["q"])

    assert "reads tensor values" in _refusal(value_fill) and "reads tensor values" in _refusal(branch)
    assert "a is written from a computed tensor" in _refusal(converted)
    assert "modifies a checkpoint tensor" in _refusal(source_changed)
    assert _refusal(rebound) == "loading replaced _Layer.a"
    assert "mul_" in _refusal(transformed) and "weight" in _refusal(transformed)
    assert "add" in _refusal(out_arg)
    assert _refusal(_load) is None


def test_a_temporary_on_a_freed_checkpoint_tensors_storage_is_not_taken_for_it() -> None:
    ck = _ckpt(0)
    storage = ck["q"].untyped_storage()

    def reused(layers, ck):
        del ck["q"]  # the file's tensor is gone; a tensor on the same memory is not it
        gc.collect()
        temp = torch.empty(0).set_(storage, 0, (4, 6), (6, 1))
        layers["qkv"].weight.data[:4].copy_(temp)

    assert "weight is written from a computed tensor" in _refusal(reused, ck)


def test_loading_that_sets_a_layer_attribute_or_skips_processing_is_refused() -> None:
    layers = _layers()
    rec = Recorder()
    for layer in layers.values():
        for name, p in layer._parameters.items():
            rec.target(id(layer), "_parameters", name, p)
    ck = _ckpt(0)
    for name, t in ck.items():
        rec.source(name, t)
    with rec:
        _load(layers, ck)
    rec.processed(id(layers["qkv"]), layers["qkv"], layers["qkv"])
    rec.processed(id(layers["mix"]), layers["mix"], layers["mix"])
    assert rec.plan(("x",), {id(v): v for v in layers.values()}) is None  # emb loaded, never processed
    assert "never processed" in rec.why
    shadow = _Layer(weight=(7, 3))
    shadow.__dict__.update(layers["emb"].__dict__)
    shadow.scale = 2.0  # an attribute the live layer does not have
    rec2 = Recorder()
    rec2.processed(1, layers["emb"], shadow)
    assert rec2.why == "loading set _Layer.scale"


def test_processing_is_not_recorded() -> None:
    layers = _layers()
    rec = _record(layers, _ckpt(0))
    with rec, rec.paused():
        layers["qkv"].weight.data.mul_(3)  # e.g. a layout change by processing: redone, not replayed
    assert rec.why is None
