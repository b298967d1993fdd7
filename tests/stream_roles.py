"""The roles of `tests/test_weight_stream_ray.py` (importable by Ray worker processes): the
tiny model's weights on a mesh, made on the devices (each process makes only its shards)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxflow.mesh import get_rules, state_shardings
from jaxflow.models import ModelConfig, init_model
from jaxflow.workers import ALL_TO_ALL, ONE_TO_ALL, register
from jaxflow.workers.base import resolve_mesh


class StreamedWeights:
    """The weights of a ``cfg`` model on ``mesh`` under ``rules``: N(0, 0.02) from ``seed``
    (or zeros: a rollout copy before its first sync), in ``dtype``. A `WeightHolder`
    (``params``, ``replace_params``) for `jaxflow.workers.ray.streams.WeightStream`."""

    def __init__(self, cfg: ModelConfig, mesh: str, rules: str, seed: int | None = None, dtype: str = "float32"):
        self.mesh, self.dp_axes = resolve_mesh(mesh), ()
        _, abstract = nnx.split(nnx.eval_shape(lambda: init_model(cfg)))
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.dtype(dtype)), abstract)
        shardings = state_shardings(abstract, get_rules(rules), self.mesh)

        def init():
            leaves, treedef = jax.tree.flatten(abstract)
            keys = jax.random.split(jax.random.key(0 if seed is None else seed), len(leaves))
            values = [
                jnp.zeros(x.shape, x.dtype) if seed is None else 0.02 * jax.random.normal(keys[i], x.shape, x.dtype)
                for i, x in enumerate(leaves)
            ]
            return jax.tree.unflatten(treedef, values)

        self.params = jax.jit(init, out_shardings=shardings)()
        self._update = jax.jit(
            lambda p, k: jax.tree.map(lambda x: x * (1 - 2.0**-3) + k * 2.0**-7, p), donate_argnums=0
        )

    def replace_params(self, params):
        self.params = params

    @register(ONE_TO_ALL)
    def update(self, k: int):
        """A deterministic change of every weight: ``w <- (7/8) w + k/128`` (in place)."""
        self.params = self._update(self.params, jnp.asarray(k, self.params_dtype))

    @property
    def params_dtype(self):
        return jax.tree.leaves(self.params)[0].dtype

    @register(ONE_TO_ALL)
    def weights(self):
        """The weights as a nested dict, brought to the driver (the test's comparison only)."""
        return nnx.to_pure_dict(self.params)

    @register(ALL_TO_ALL)
    def live_bytes(self, _):
        """Measured: bytes of the live arrays on this process's devices (a buffer seen through
        several arrays counts once)."""
        buffers = {}
        for x in jax.live_arrays():
            for s in x.addressable_shards:
                buffers[(s.device.id, s.data.unsafe_buffer_pointer())] = s.data.nbytes
        return int(np.sum(list(buffers.values())))
