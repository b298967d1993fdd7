"""The auto-mapper: HybridFlow's device-mapping search (placements, pool sizes, per-model
layouts) over analytic simulators, checked by ahead-of-time compilation.

``python -m jaxflow.automap --config=ppo_70b --devices=128 --device_kind=a100-80g``.
"""

from jaxflow.automap.auto import resolve_placement
from jaxflow.automap.profiles import DeviceProfile, get_profile
from jaxflow.automap.search import Mapper, Plan, evaluate
from jaxflow.automap.verify import choose_verified, compile_check, search_verified
from jaxflow.automap.workload import Workload, workload_from_config, workload_from_spec

__all__ = [
    "DeviceProfile",
    "Mapper",
    "Plan",
    "Workload",
    "choose_verified",
    "compile_check",
    "evaluate",
    "get_profile",
    "resolve_placement",
    "search_verified",
    "workload_from_config",
    "workload_from_spec",
]
