"""Rule-based rewards: per-``data_source`` scorers, user reward functions, the host scorer.

- :func:`register_reward` / :func:`get_reward_fn` / :func:`default_compute_score`: functions
  by ``data_source`` (built in: ``openai/gsm8k``, the MATH sources, ``jaxflow/*`` tasks).
- :func:`load_reward_fn`: a user function from a file (verl's ``custom_reward_function``).
- :class:`RewardScorer`: scores a batch on the host; a failing or timed-out sample scores 0 and
  is counted, but a function that fails on every sample of a batch (or on too many) raises
  :class:`RewardFunctionError`. :func:`token_level_scores` puts scores on the last response token;
  :func:`extra_columns` makes the other named values a function returns batch columns.
- :class:`OverlongBuffer` (:mod:`~jaxflow.rewards.shaping`): DAPO's overlong reward shaping.
- :func:`score_code` (:mod:`~jaxflow.rewards.sandbox`, data source ``jaxflow/code``): the
  fraction of a sample's tests that the response's code passes, run in a sandbox (namespaces,
  resource limits, a timeout) that leaves nothing behind; :func:`score_code_batch` runs many.
"""

from jaxflow.rewards import gsm8k, math, sandbox  # noqa: F401  (registers their data sources)
from jaxflow.rewards.registry import (
    UnknownDataSourceError,
    default_compute_score,
    get_reward_fn,
    known_data_sources,
    load_reward_fn,
    register_reward,
    unregister_reward,
)
from jaxflow.rewards.sandbox import SandboxLimits, SandboxUnavailable, score_code, score_code_batch
from jaxflow.rewards.scorer import (
    EXTRA_COLUMN_PREFIX,
    RewardFunctionError,
    RewardResult,
    RewardScorer,
    extra_columns,
    normalize_reward,
    token_level_scores,
)
from jaxflow.rewards.shaping import OverlongBuffer

__all__ = [
    "EXTRA_COLUMN_PREFIX",
    "OverlongBuffer",
    "RewardFunctionError",
    "RewardResult",
    "RewardScorer",
    "SandboxLimits",
    "SandboxUnavailable",
    "UnknownDataSourceError",
    "default_compute_score",
    "extra_columns",
    "get_reward_fn",
    "gsm8k",
    "known_data_sources",
    "load_reward_fn",
    "math",
    "normalize_reward",
    "register_reward",
    "sandbox",
    "score_code",
    "score_code_batch",
    "token_level_scores",
    "unregister_reward",
]
