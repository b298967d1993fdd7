"""Model states made on the host for tests: no initialiser runs (eagerly, every initialiser
compiles on its own), and host leaves `jax.device_put` without compiling."""

import jax
import numpy as np
from flax import nnx

from jaxflow.models import ModelConfig, init_model


def random_state(cfg: ModelConfig, seed: int = 0):
    """A model state of host (NumPy) arrays: N(0, 0.02) weights and unit norms."""
    rng = np.random.default_rng(seed)
    _, state = nnx.split(nnx.eval_shape(lambda: init_model(cfg)))
    return jax.tree_util.tree_map_with_path(
        lambda p, x: (
            np.ones(x.shape, x.dtype)
            if "norm" in jax.tree_util.keystr(p)
            else rng.normal(0, 0.02, x.shape).astype(x.dtype)
        ),
        state,
    )
