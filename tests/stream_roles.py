"""The roles of `tests/test_weight_stream_ray.py` and `tests/test_ray_rollout_pool.py`
(importable by Ray worker processes): the tiny model's weights on a mesh, made on the devices
(each process makes only its shards), and roles whose syncs can be made to fail."""

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jaxflow.mesh import get_rules, state_shardings
from jaxflow.models import ModelConfig, init_model
from jaxflow.workers import ALL_TO_ALL, ONE_TO_ALL, register
from jaxflow.workers.base import resolve_mesh
from jaxflow.workers.generation import GenerationWorker


def shard_values(shape: tuple[int, ...], index: tuple[slice, ...], dtype, seed: int) -> np.ndarray:
    """The block ``index`` of a weight whose element at flat position ``n`` is
    ``0.02 sin(0.7 n + seed)`` (made for that block only: no compile, no whole weight)."""
    grids = np.meshgrid(*(np.arange(n)[sl] for n, sl in zip(shape, index)), indexing="ij")
    flat = np.ravel_multi_index(grids, shape) if shape else np.zeros((), np.int64)
    return (0.02 * np.sin(0.7 * flat + seed)).astype(dtype)


class StreamedWeights:
    """The weights of a ``cfg`` model on ``mesh`` under ``rules``, in ``dtype``: each process
    makes only its devices' blocks (`shard_values` from ``seed``, or zeros: a rollout copy
    before its first sync). A `WeightHolder` (``params``, ``replace_params``) for
    `jaxflow.workers.ray.streams.WeightStream`."""

    def __init__(self, cfg: ModelConfig, mesh: str, rules: str, seed: int | None = None, dtype: str = "float32"):
        self.mesh, self.dp_axes = resolve_mesh(mesh), ()
        _, abstract = nnx.split(nnx.eval_shape(lambda: init_model(cfg)))
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.dtype(dtype)), abstract)
        shardings = state_shardings(abstract, get_rules(rules), self.mesh)

        def make(i: int, x: jax.ShapeDtypeStruct, sharding) -> jax.Array:
            def block(index):
                if seed is None:
                    return np.zeros([len(range(*sl.indices(n))) for n, sl in zip(x.shape, index)], x.dtype)
                return shard_values(x.shape, index, x.dtype, seed + i)

            return jax.make_array_from_callback(x.shape, sharding, block)

        leaves, treedef = jax.tree.flatten(abstract)
        self.params = jax.tree.unflatten(
            treedef,
            [
                make(i, x, s)
                for i, (x, s) in enumerate(
                    zip(leaves, jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, NamedSharding)))
                )
            ],
        )
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


class ArmedParams:
    """A role whose next read of ``params`` (a stream's sync reads them first) can be made to
    fail on chosen ranks (`arm`): ``("raise", message)`` raises RuntimeError there;
    ``("cast", dtype)`` gives them cast to ``dtype`` (a layout the stream was not made for);
    ``("hold", path)`` writes this process's pid to ``path`` and waits there (a test kills
    the process meanwhile: the other world is then in the middle of the sync, waiting). Mixed
    in before a role class whose weights are ``self._params``."""

    HOLD_S = 120.0  # a hold that nobody ends raises after this long

    _fault: tuple[str, str] | None = None

    @property
    def params(self):
        fault, self._fault = self._fault, None
        if fault is not None and fault[0] == "raise":
            raise RuntimeError(fault[1])
        if fault is not None and fault[0] == "cast":
            return jax.tree.map(lambda x: x.astype(fault[1]), self._params)
        if fault is not None and fault[0] == "hold":
            with open(fault[1] + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.rename(fault[1] + ".tmp", fault[1])
            time.sleep(self.HOLD_S)
            raise TimeoutError(f"held {self.HOLD_S} s and nobody killed this process")
        return self._params

    @params.setter
    def params(self, value):
        self._params = value

    @register(ALL_TO_ALL)
    def arm(self, fault: tuple[str, str] | None):
        """This rank's next read of ``params`` fails as ``fault`` says (None: it does not)."""
        self._fault = fault


class FaultyWeights(ArmedParams, StreamedWeights):
    """`StreamedWeights` whose syncs can be made to fail (`ArmedParams`)."""


class FaultyGeneration(ArmedParams, GenerationWorker):
    """A rollout pool's `GenerationWorker` whose syncs can be made to fail (`ArmedParams`), and
    whose weights the driver can read (`weights`)."""

    @register(ONE_TO_ALL)
    def weights(self):
        """The weights as a nested dict, brought to the driver (the test's comparison only)."""
        return nnx.to_pure_dict(self.params)
