"""The rollout engine: a paged KV cache sized from a token budget (pallas paged-attention kernels
on GPU and TPU), continuous batching with shared prompt prefixes and per-row limits, EOS and
stop strings matched on the device, compiled as one program; conversations whose KV pages stay
in the engine between turns (`KVSession`), sampled turn by turn (`EngineTurns`: the turn
sampler of multi-turn rollouts and agent loops); and the logits processing (temperature, top-k,
top-p) it samples with; partial rollouts (`partial`), which a weight sync interrupts and
which resume under the new weights, each token recording its policy version."""

from jaxflow.sampling.engine import (
    DEFAULT_PAGE_SIZE,
    DEFAULT_SLOTS,
    EngineOptions,
    EngineShape,
    GenerateOutput,
    SamplingParams,
    bucket_size,
    engine_shape,
    generate,
    generate_from_state,
    left_pad,
    lower_generate,
)
from jaxflow.sampling.logits_processing import (
    apply_temperature,
    process_logits,
    sample_tokens,
    sampling_probs,
    token_log_probs,
    top_k_mask,
    top_p_mask,
)
from jaxflow.sampling.paged import (
    PagedKVCache,
    PoolLayout,
    choose_kernel,
    paged_attention,
)
from jaxflow.sampling.partial import (
    PartialOutput,
    PartialRollout,
    resume_partial,
    run_partial,
    start_partial,
    swap_weights,
)
from jaxflow.sampling.session import KVSession
from jaxflow.sampling.stops import StopStrings
from jaxflow.sampling.turns import EngineTurns

__all__ = [
    "DEFAULT_PAGE_SIZE",
    "DEFAULT_SLOTS",
    "EngineOptions",
    "EngineShape",
    "EngineTurns",
    "GenerateOutput",
    "KVSession",
    "PagedKVCache",
    "PartialOutput",
    "PartialRollout",
    "PoolLayout",
    "SamplingParams",
    "StopStrings",
    "apply_temperature",
    "bucket_size",
    "choose_kernel",
    "engine_shape",
    "generate",
    "generate_from_state",
    "left_pad",
    "lower_generate",
    "paged_attention",
    "process_logits",
    "resume_partial",
    "run_partial",
    "sample_tokens",
    "sampling_probs",
    "start_partial",
    "swap_weights",
    "token_log_probs",
    "top_k_mask",
    "top_p_mask",
]
