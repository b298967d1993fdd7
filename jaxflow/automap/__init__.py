"""The auto-mapper: HybridFlow's device-mapping search (placements, pool sizes, per-model
layouts) over analytic simulators, checked by ahead-of-time compilation.

``python -m jaxflow.automap --config=ppo_70b --devices=128 --device_kind=a100-80g``.
"""
