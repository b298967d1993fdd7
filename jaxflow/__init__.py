"""jaxflow: HybridFlow (verl) RLHF rebuilt in JAX.

The curated API, loaded on first use (``import jaxflow`` itself imports nothing heavy)::

    import jaxflow
    cfg = jaxflow.load_config("grpo_tiny", ["actor_rollout_ref.rollout.n=4"])
    run = jaxflow.prepare_run(cfg)               # the typed description, tokenizer and prompts
    jaxflow.RLTrainer(cfg).fit()                 # or jaxflow.dry_run(run.spec)

Subpackages, floor by floor (DESIGN.md): `mesh`; `models`, `data`, `rewards`; `sampling`,
`reshard`, `algos`; `workers`; `iterations`, `configs`; `trainer`, `plan`; `run` (the CLI).
"""

import importlib

_API = {
    # configs
    "get_config": "jaxflow.configs",
    "load_config": "jaxflow.configs",
    "validate": "jaxflow.configs",
    "ConfigError": "jaxflow.configs",
    "describe_run": "jaxflow.configs",
    "prepare_run": "jaxflow.configs",
    "PreparedRun": "jaxflow.configs",
    "RunSpec": "jaxflow.configs",
    # data
    "Batch": "jaxflow.data",
    # algorithm maths and settings (verl's names)
    "AlgorithmConfig": "jaxflow.algos",
    "AlgorithmSettings": "jaxflow.algos",
    # the algorithms' iterations and their registry
    "ppo_iteration": "jaxflow.iterations",
    "remax_iteration": "jaxflow.iterations",
    "safe_rlhf_iteration": "jaxflow.iterations",
    "register_algorithm": "jaxflow.iterations",
    "Algorithm": "jaxflow.iterations",
    "AlgoState": "jaxflow.iterations",
    # workers
    "Workers": "jaxflow.workers",
    "build_local_workers": "jaxflow.workers",
    # placement
    "Placement": "jaxflow.mesh",
    "MeshSpec": "jaxflow.mesh",
    # models and the hybrid engine
    "ModelConfig": "jaxflow.models",
    "from_pretrained": "jaxflow.models",
    "HybridEngine": "jaxflow.reshard",
    # runs and plans
    "RLTrainer": "jaxflow.trainer.rl",
    "dry_run": "jaxflow.plan",
}

__all__ = sorted(_API)


def __getattr__(name: str):
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'jaxflow' has no attribute {name!r}")
