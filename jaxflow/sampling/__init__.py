"""The rollout engine: a paged KV cache, continuous batching with shared prompt prefixes and
per-row limits and stops, compiled as one program; and the logits processing (temperature,
top-k, top-p) it samples with."""

from jaxflow.sampling.engine import (
    DEFAULT_PAGE_SIZE,
    DEFAULT_SLOTS,
    EngineShape,
    GenerateOutput,
    SamplingParams,
    bucket_size,
    engine_shape,
    generate,
    generate_from_state,
    lower_generate,
    trace_count,
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
from jaxflow.sampling.paged import PagedKVCache, paged_attention
from jaxflow.sampling.stops import stop_length

__all__ = [
    "DEFAULT_PAGE_SIZE",
    "DEFAULT_SLOTS",
    "EngineShape",
    "GenerateOutput",
    "PagedKVCache",
    "SamplingParams",
    "apply_temperature",
    "bucket_size",
    "engine_shape",
    "generate",
    "generate_from_state",
    "lower_generate",
    "paged_attention",
    "process_logits",
    "sample_tokens",
    "sampling_probs",
    "stop_length",
    "token_log_probs",
    "top_k_mask",
    "top_p_mask",
    "trace_count",
]
