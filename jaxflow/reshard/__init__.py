"""The 3D-HybridEngine: the actor's train <-> generate layout switch, its strategies, and
the transition's measured cost (from the compiled program) beside HybridFlow's Table 2; and
the weight sync from a trainer's pool to a rollout pool on other devices (`WeightSync`)."""

from jaxflow.reshard.cost import STRATEGY_NAMES, Table2, table2
from jaxflow.reshard.engine import (
    STRATEGIES,
    HybridEngine,
    TransitionReport,
    containment_violations,
    derive_generation_rules,
    redundant_bytes,
    shard_bytes,
)
from jaxflow.reshard.hlo import Collective, capture_stderr, parse_collectives, received_per_device
from jaxflow.reshard.weight_sync import SyncReport, WeightSync, generation_layout, generation_shardings

__all__ = [
    "STRATEGIES",
    "STRATEGY_NAMES",
    "Collective",
    "HybridEngine",
    "SyncReport",
    "Table2",
    "TransitionReport",
    "WeightSync",
    "capture_stderr",
    "containment_violations",
    "derive_generation_rules",
    "generation_layout",
    "generation_shardings",
    "parse_collectives",
    "received_per_device",
    "redundant_bytes",
    "shard_bytes",
    "table2",
]
