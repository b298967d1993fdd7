"""The training loop's plumbing: checkpoints (orbax, verl resume modes), metric sinks and a
progress bar, end-of-run plots, the non-finite guard, and the version-keyed rollout buffer of
the asynchronous schedules."""

from jaxflow.trainer.checkpoint import (
    RESUME_MODES,
    CheckpointManager,
    CheckpointMismatchError,
    DamagedCheckpointError,
    HostState,
    Restored,
    is_complete,
)
from jaxflow.trainer.guard import NonFiniteError, NonFiniteGuard, non_finite_keys, skipped_keys
from jaxflow.trainer.metrics import (
    BACKENDS,
    DEFAULT_CONSOLE_KEYS,
    MetricsLogger,
    ProgressBar,
    read_jsonl,
    truncate_jsonl,
)
from jaxflow.trainer.plot import plot_metrics, plot_run
from jaxflow.trainer.rollout_buffer import (
    STALENESS_POLICIES,
    BufferClosedError,
    BufferFullError,
    BufferTimeoutError,
    RolloutBuffer,
    RolloutGroup,
    StaleGroupError,
    TakeResult,
)

__all__ = [
    "BACKENDS",
    "DEFAULT_CONSOLE_KEYS",
    "RESUME_MODES",
    "STALENESS_POLICIES",
    "BufferClosedError",
    "BufferFullError",
    "BufferTimeoutError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "DamagedCheckpointError",
    "HostState",
    "MetricsLogger",
    "NonFiniteError",
    "NonFiniteGuard",
    "ProgressBar",
    "Restored",
    "RolloutBuffer",
    "RolloutGroup",
    "StaleGroupError",
    "TakeResult",
    "is_complete",
    "non_finite_keys",
    "plot_metrics",
    "plot_run",
    "read_jsonl",
    "skipped_keys",
    "truncate_jsonl",
]
