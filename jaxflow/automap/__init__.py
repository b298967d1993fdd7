"""The auto-mapper: HybridFlow's device-mapping search (placements, pool sizes, per-model
layouts) over analytic simulators, checked by ahead-of-time compilation. It reads and returns
typed objects: a `RunSpec` without a placement in, an `AutoPlacement` (the `Plan`, the spec
placed by it) out.

``python -m jaxflow.automap --config=ppo_70b --devices=128 --device_kind=a100-80g``.
"""

from jaxflow.automap.auto import AutoPlacement, auto_place, placement_profile
from jaxflow.automap.profiles import DeviceProfile, get_profile
from jaxflow.automap.search import Mapper, Plan, evaluate
from jaxflow.automap.verify import apply_plan, choose_verified, compile_check, search_verified
from jaxflow.automap.workload import Workload, workload_from_spec

__all__ = [
    "AutoPlacement",
    "DeviceProfile",
    "Mapper",
    "Plan",
    "Workload",
    "apply_plan",
    "auto_place",
    "choose_verified",
    "compile_check",
    "evaluate",
    "get_profile",
    "placement_profile",
    "search_verified",
    "workload_from_spec",
]
