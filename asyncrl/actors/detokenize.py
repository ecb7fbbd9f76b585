"""Completion text: vLLM's own detokenizer, run once per completion by the wrapper.

Why not inside vLLM. asyncrl asks for the sampled token's logprob of every token (``logprobs=0``).
With detokenization on, vLLM's output handler also turns each of those tokens into a string for its
``Logprob.decoded_token`` (``LogprobsProcessor._update_sample_logprobs``: a tokenizer call per token,
which asyncrl never reads), besides building the text step by step. A py-spy profile of the demo's
actor (samples of the thread holding the GIL, eta 1, 20 s) put 11% of the front end's Python time in
those per-token strings and 2% in the step-by-step text. With ``SamplingParams(detokenize=False)``
vLLM does neither; :func:`completion_text` then decodes each completion once, when it has ended.

Same text, by construction: it runs vLLM's own class (``IncrementalDetokenizer.from_new_request``,
the fast ``DecodeStream`` one for a fast tokenizer) with the inputs vLLM's output processor gives it
(the request's prompt ids and sampling parameters, the output processor's own tokenizer, and all the
completion's token ids, whose last one is left out of the text when the completion ended on a stop
token, as vLLM does with ``stop_terminated``). Its ``update`` decodes token by token whatever the
chunking, so one call over all the tokens equals vLLM's calls over the streamed chunks. Tested
against vLLM's own text (tests/integration/test_weight_swap.py).

Limit: stop *strings* are matched by that detokenizer while generating, so vLLM refuses them with
``detokenize=False``; the engine stops on token ids only (it passes no stop strings).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

__all__ = ["completion_text"]


def completion_text(
    tokenizer: Any,
    prompt_ids: Sequence[int],
    token_ids: Sequence[int],
    params: Any,
    finish_reason: str,
    request_id: str,
) -> str:
    """The text vLLM's output processor returns for this finished completion (``""`` when the engine
    has no tokenizer, as vLLM's). ``params``: the request's ``SamplingParams``."""
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    if tokenizer is None or not token_ids:
        return ""
    # The fields of vLLM's EngineCoreRequest that its detokenizers read.
    request = SimpleNamespace(
        request_id=request_id, prompt_token_ids=list(prompt_ids), prompt_embeds=None, sampling_params=params
    )
    detok = IncrementalDetokenizer.from_new_request(tokenizer, request)
    # vLLM: update(new_token_ids, finish_reason == FinishReason.STOP) for each chunk; "stop" is the
    # string of FinishReason.STOP (an EOS or stop token id: this engine passes no stop strings).
    detok.update(list(token_ids), finish_reason == "stop")
    return detok.get_next_output_text(finished=True, delta=False)
