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
