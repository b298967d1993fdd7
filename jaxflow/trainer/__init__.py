"""The training loop's plumbing: checkpoints (orbax, verl resume modes), metric sinks and a
progress bar, end-of-run plots, and the non-finite guard."""

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

__all__ = [
    "BACKENDS",
    "DEFAULT_CONSOLE_KEYS",
    "RESUME_MODES",
    "CheckpointManager",
    "CheckpointMismatchError",
    "DamagedCheckpointError",
    "HostState",
    "MetricsLogger",
    "NonFiniteError",
    "NonFiniteGuard",
    "ProgressBar",
    "Restored",
    "is_complete",
    "non_finite_keys",
    "plot_metrics",
    "plot_run",
    "read_jsonl",
    "skipped_keys",
    "truncate_jsonl",
]
