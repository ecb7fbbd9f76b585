"""Which models the staged weight swap refuses (asyncrl.actors.staging.unsupported_reason).

A refusal makes the engine reload in place; accepting a model whose processing is not a pure function
of a layer's own loaded tensors would serve wrong weights. The staged path itself runs on the real
engine in tests/integration/test_weight_swap.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

EAGER = SimpleNamespace(enforce_eager=True)


class _Layer(torch.nn.Module):
    def __init__(self, quant_method=None, weight: torch.nn.Parameter | None = None) -> None:
        super().__init__()
        self.weight = weight if weight is not None else torch.nn.Parameter(torch.zeros(2, 2))
        self.quant_method = quant_method


def _model(*layers: torch.nn.Module) -> torch.nn.Module:
    m = torch.nn.Module()
    for i, layer in enumerate(layers):
        m.add_module(f"l{i}", layer)
    return m


def test_plain_unquantized_layers_are_stageable() -> None:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from asyncrl.actors.staging import unsupported_reason

    model = _model(_Layer(UnquantizedLinearMethod()), _Layer(UnquantizedEmbeddingMethod()), _Layer())
    assert unsupported_reason(model, EAGER) is None


def test_tied_parameters_are_refused() -> None:
    from asyncrl.actors.staging import unsupported_reason

    shared = torch.nn.Parameter(torch.zeros(2, 2))
    reason = unsupported_reason(_model(_Layer(weight=shared), _Layer(weight=shared)), EAGER)
    assert reason is not None and "tied" in reason and "l0.weight" in reason and "l1.weight" in reason


def test_unknown_quant_methods_are_refused() -> None:
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    from asyncrl.actors.staging import unsupported_reason

    class PackedInt4Method(QuantizeMethodBase):  # any method outside the known pure ones
        def create_weights(self, *a, **k):
            pass

        def apply(self, *a, **k):
            pass

    reason = unsupported_reason(_model(_Layer(), _Layer(PackedInt4Method())), EAGER)
    assert reason is not None and "l1" in reason and "PackedInt4Method" in reason


def test_graphs_or_compilation_are_refused() -> None:
    from asyncrl.actors.staging import unsupported_reason

    reason = unsupported_reason(_model(_Layer()), SimpleNamespace(enforce_eager=False))
    assert reason is not None and "enforce_eager" in reason


# The scratch pool (asyncrl.actors.stage_shadow.Scratch): model-format storages that processing dropped are
# loaded into again by the next layer / stage. Pooled memory must never be live, nor be written through
# the tensor that dropped it.


def _shadow_of_one_layer(complete):
    from asyncrl.actors.stage_shadow import Scratch as _Scratch
    from asyncrl.actors.stage_shadow import Shadow as _Shadow

    model = _model(_Layer())
    scratch = _Scratch()
    return model, scratch, _Shadow(model, scratch, complete)


def test_a_layer_is_processed_once_its_elements_are_loaded_and_then_refuses_loads() -> None:
    done: list[int] = []
    model, _, shadow = _shadow_of_one_layer(done.append)
    sh = shadow.root.l0
    assert sh.weight is not model.l0.weight and sh._parameters is not model.l0._parameters
    w = torch.arange(4.0).reshape(2, 2)
    sh.weight.weight_loader(sh.weight, w)  # its last (only) element written: processed now
    assert done == [id(sh)]
    shadow.processed.add(id(sh))
    with pytest.raises(RuntimeError, match="loaded again"):
        sh.weight.weight_loader(sh.weight, w)
    assert torch.equal(model.l0.weight, torch.zeros(2, 2))  # the live layer was never written


def test_scratch_pools_only_storages_nothing_else_references() -> None:
    from asyncrl.actors.stage_shadow import Scratch as _Scratch

    scratch = _Scratch()
    layer = _Layer()
    dropped, aliased, kept = torch.ones(8, 4), torch.ones(8, 4), torch.ones(8, 4)
    view = aliased[1:]  # e.g. a kernel holding a view: the storage is not free
    layer.weight = torch.nn.Parameter(kept, requires_grad=False)
    scratch.reclaim(layer, [dropped, aliased, layer.weight])
    assert scratch.held == 128 and list(scratch.free) == [128]
    ptr = dropped.untyped_storage().data_ptr()
    t = scratch.empty((4, 8), (1, 4), torch.float32, torch.device("cpu"))  # same bytes, other layout
    assert t.untyped_storage().data_ptr() == ptr and t.shape == (4, 8) and t.stride() == (1, 4)
    assert scratch.reused == 128 and scratch.held == 0
    fresh = scratch.empty((4, 8), (8, 1), torch.float32, torch.device("cpu"))  # pool empty: a new one
    assert fresh.untyped_storage().data_ptr() not in (ptr, aliased.untyped_storage().data_ptr())
    assert view.sum() == 28 and layer.weight.sum() == 32


def test_scratch_off_hands_out_plain_tensors_and_pools_nothing() -> None:
    """With the heap keeping freed memory (asyncrl.actors.cpu_heap) the stage allocates from it."""
    from asyncrl.actors.stage_shadow import Scratch as _Scratch

    scratch, layer = _Scratch(enabled=False), _Layer()
    dropped = torch.ones(1024, 1025)  # > 2 MiB: would be pooled, and handed out again, when enabled
    scratch.reclaim(layer, [dropped])
    assert scratch.held == 0 and not scratch.free
    t = scratch.empty((1024, 1025), (1025, 1), torch.float32, torch.device("cpu"))
    assert t.untyped_storage().data_ptr() != dropped.untyped_storage().data_ptr()
    assert t.untyped_storage().nbytes() == 1024 * 1025 * 4 and scratch.reused == 0


def test_large_scratch_is_a_huge_page_aligned_mapping_and_comes_back() -> None:
    from asyncrl.actors.stage_shadow import Scratch as _Scratch

    scratch, layer = _Scratch(), _Layer()
    t = scratch.empty((1024, 1025), (1025, 1), torch.float32, torch.device("cpu"))  # > 2 MiB
    assert t.data_ptr() % _Scratch.HUGE == 0 and scratch.reused == 0
    t.fill_(1.5)
    ptr = t.data_ptr()
    scratch.reclaim(layer, [t])
    del t
    u = scratch.empty((1025, 1024), (1, 1025), torch.float32, torch.device("cpu"))
    assert u.data_ptr() == ptr and scratch.reused == 1024 * 1025 * 4 and float(u.sum()) == 1.5 * 1024 * 1025
