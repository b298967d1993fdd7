"""Train state and the jitted optimizer step shared by the actor and the critic.

`make_train_step` builds ONE jit-compiled program per role: a mini-batch in, one optimizer
step out::

    grads  = sum_j  d loss(micro_j) / d params          (lax.scan over k micro-batches)
    norm   = ||grads||_2                                 (global norm, before clipping)
    new    = update(params, opt_state, grads)
    ok     = isfinite(loss) and isfinite(norm) and isfinite(every float of new params, opt_state)
    params, opt_state, step = new           if ok
                              unchanged     otherwise    (update_skipped = 1)

The last condition catches a finite gradient whose step overflows (a huge learning rate, an
Adam denominator underflowing): non-finite weights are never written, so they can never be
saved in a checkpoint either.

Every micro-batch loss is aggregated with the *mini-batch's* normalisers
(`jaxflow.algos.global_batch_info`: total valid tokens / sequences, ``dp_size=1`` because the
program sees the global batch), so the micro-batch losses, and their gradients, sum to those
of the whole mini-batch exactly (up to float summation order). The batch is sharded over the
data-parallel mesh axes and the parameters over the role's rules; XLA inserts the gradient
reductions. ``state`` is donated.

A loss function has the signature ``loss_fn(model, micro, gbi, scalars) -> (loss, aux)``
where ``micro`` holds the micro-batch's columns, ``gbi`` the mini-batch normalisers and
``aux`` scalars that *add up* over micro-batches to the mini-batch metric (e.g. a masked mean
written as ``masked_sum / gbi["batch_num_tokens"]``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxflow.algos import global_batch_info
from jaxflow.mesh import Rules, logical_to_spec, sharding_rules
from jaxflow.models.lora import lora_dropout
from jaxflow.workers.forward import named, split_micro, trained_tokens

Array = jax.Array
LossFn = Callable[[Any, dict, dict, dict], tuple[Array, dict]]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    """What a training role carries between steps: parameters (an ``nnx.State``), optimizer
    state, and the number of applied (finite) updates."""

    params: Any
    opt_state: Any
    step: Array


def _is_leafish(x: Any) -> bool:
    return isinstance(x, (nnx.Variable, NamedSharding))


def train_state_shardings(
    params: Any, param_shardings: Any, tx: optax.GradientTransformation, mesh: Mesh
) -> TrainState:
    """Shardings of a `TrainState` (a prefix tree): parameters as given, every per-parameter
    optimizer buffer (Adam's moments) like its parameter, scalars (counts) replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    abstract_opt = jax.eval_shape(tx.init, jax.eval_shape(lambda p: p, params))
    opt_shardings = optax.tree_map_params(
        tx,
        lambda _, s: s,
        abstract_opt,
        param_shardings,
        transform_non_params=lambda _: replicated,
        is_leaf=_is_leafish,
    )
    return TrainState(params=param_shardings, opt_state=opt_shardings, step=replicated)


def _init_program(
    params: Any, param_shardings: Any, tx: optax.GradientTransformation, mesh: Mesh
) -> tuple[Any, TrainState]:
    """``(jitted init, shardings)``: ``params -> TrainState`` (fresh copies of the parameters,
    ``tx.init`` of them, step 0) with the state's shardings as output shardings."""
    shardings = train_state_shardings(params, param_shardings, tx, mesh)

    def init(p):
        p = jax.tree.map(jnp.copy, p)
        return TrainState(params=p, opt_state=tx.init(p), step=jnp.zeros((), jnp.int32))

    return jax.jit(init, out_shardings=shardings), shardings


def create_train_state(
    params: Any, param_shardings: Any, tx: optax.GradientTransformation, mesh: Mesh
) -> tuple[TrainState, TrainState]:
    """``(state, shardings)``: fresh copies of ``params`` placed by ``param_shardings`` (never
    aliasing the caller's buffers, since the train step donates them) and a sharded
    optimizer state."""
    init, shardings = _init_program(params, param_shardings, tx, mesh)
    return init(params), shardings


def abstract_train_state(
    params: Any, param_shardings: Any, tx: optax.GradientTransformation, mesh: Mesh
) -> tuple[TrainState, TrainState]:
    """``(state, shardings)`` as `create_train_state` builds them, with ``jax.ShapeDtypeStruct``
    leaves carrying their shardings (``params`` may be abstract): the same init program,
    traced and never run. What planners lower the train step on and checkpoints restore
    into; the optimizer's dtypes are ``tx``'s own (`jaxflow.workers.optim.OptimConfig.state_dtype`)."""
    init, shardings = _init_program(params, param_shardings, tx, mesh)
    return init.eval_shape(params), shardings


def batch_sharding(mesh: Mesh, batch_axes: Any, ndim: int, leading: int = 0) -> NamedSharding:
    """Rows (dimension ``leading``) over ``batch_axes``, other dimensions replicated."""
    return NamedSharding(mesh, PartitionSpec(*([None] * leading), batch_axes, *([None] * (ndim - 1 - leading))))


def make_train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    loss_fn: LossFn,
    *,
    mesh: Mesh,
    rules: Rules,
    state_shardings: TrainState,
    batch_ndims: Mapping[str, int],
    scalar_names: tuple[str, ...] = (),
    num_micro: int = 1,
    loss_scale_factor: Any = None,
    presplit: bool = False,
    name: str = "train_step",
    frozen_shardings: Any = None,
    dropout_seed: int | None = None,
) -> Callable[..., tuple[TrainState, dict]]:
    """The jitted ``step(state, batch, scalars) -> (state, metrics)`` (see the module doc).

    ``batch_ndims`` names the batch columns (and their ranks) the step takes; ``scalars``
    are runtime float scalars (e.g. the temperature). Metrics: the loss function's ``aux``
    plus ``grad_norm``, ``lr`` (the learning rate this step used) and ``update_skipped``.
    ``presplit``: every column arrives as ``[k, ...]``, already cut into its ``k``
    micro-batches (packed batches, `jaxflow.workers.packing`; ``num_micro`` is then unused),
    dimension 1 split over the data-parallel axes. ``name``: the program's (`jax.jit` names it
    after the function: profiles, compile events).

    ``frozen_shardings``: the step takes a fourth argument, ``frozen`` (parameters that are
    part of the model but not trained, e.g. the base weights under LoRA adapters, placed by
    these shardings): the model is ``nnx.merge(graphdef, frozen, state.params)``, gradients
    and optimizer state exist for ``state.params`` only, and ``frozen`` is neither donated
    nor returned. ``dropout_seed``: the loss runs inside `jaxflow.models.lora.lora_dropout`
    with the key ``fold_in(fold_in(key(seed), state.step), micro-batch index)``.
    """
    batch_axes = _batch_axes(rules, mesh)
    batch_shardings = {k: batch_sharding(mesh, batch_axes, n, leading=int(presplit)) for k, n in batch_ndims.items()}
    replicated = NamedSharding(mesh, PartitionSpec())
    param_shardings = state_shardings.params

    def step(state: TrainState, batch: dict, scalars: dict, frozen: Any = None):
        with sharding_rules(rules, mesh):
            gbi = global_batch_info(trained_tokens(batch), dp_size=1, loss_scale_factor=loss_scale_factor)
            step_key = None if dropout_seed is None else jax.random.fold_in(jax.random.key(dropout_seed), state.step)

            def micro_loss(params, micro, index):
                model = nnx.merge(graphdef, params) if frozen is None else nnx.merge(graphdef, frozen, params)
                if step_key is None:
                    return loss_fn(model, micro, gbi, scalars)
                with lora_dropout(jax.random.fold_in(step_key, index)):
                    return loss_fn(model, micro, gbi, scalars)

            grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
            micros = batch if presplit else split_micro(batch, num_micro, mesh, batch_axes) if num_micro > 1 else None
            loss, aux, grads = accumulate_grads(grad_fn, state.params, batch, micros, param_shardings)
            grads = jax.lax.with_sharding_constraint(grads, param_shardings)
            new_state, grad_norm, finite = guarded_update(tx, state, grads, loss)
            metrics = dict(aux)
            metrics.update(
                grad_norm=grad_norm,
                lr=jnp.asarray(schedule(state.step), jnp.float32),
                update_skipped=1.0 - finite.astype(jnp.float32),
            )
            return new_state, metrics

    in_shardings = (state_shardings, batch_shardings, {k: replicated for k in scalar_names})
    if frozen_shardings is None:
        fn = named(lambda state, batch, scalars: step(state, batch, scalars), name)
    else:
        fn, in_shardings = named(step, name), (*in_shardings, frozen_shardings)
    return jax.jit(
        fn, in_shardings=in_shardings, out_shardings=(state_shardings, replicated), donate_argnames=("state",)
    )


def accumulate_grads(
    grad_fn: Callable, params: Any, batch: dict, micros: dict | None, param_shardings: Any
) -> tuple[Array, Any, Any]:
    """``(loss, aux, grads)`` summed over the micro-batches ``micros`` (``[k, ...]`` columns;
    None: ``batch`` in one pass) in a ``lax.scan``; one micro-batch takes no loop and no
    accumulators. ``grad_fn(params, micro, index)``: ``value_and_grad`` of the loss, with its
    aux (``index``: the micro-batch's, which keys its dropout)."""
    if micros is None or micros["response_mask"].shape[0] == 1:
        (loss, aux), grads = grad_fn(params, batch if micros is None else jax.tree.map(lambda x: x[0], micros), 0)
        return loss, aux, grads

    def body(acc, micro_index):
        micro, index = micro_index
        (l, a), g = grad_fn(params, micro, index)
        g = jax.lax.with_sharding_constraint(g, param_shardings)
        return jax.tree.map(jnp.add, acc, (l, a, g)), None

    first = jax.tree.map(lambda x: x[0], micros)
    (loss_s, aux_s), grads_s = jax.eval_shape(grad_fn, params, first, 0)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (loss_s, aux_s, grads_s))
    k = micros["response_mask"].shape[0]
    (loss, aux, grads), _ = jax.lax.scan(body, zeros, (micros, jnp.arange(k)))
    return loss, aux, grads


def guarded_update(
    tx: optax.GradientTransformation, state: TrainState, grads: Any, loss: Array
) -> tuple[TrainState, Array, Array]:
    """``(state, grad norm, finite)``: the optimizer step, kept only when the loss, the
    gradient norm and the new parameters and optimizer state are all finite (else the old
    state, its step not counted)."""
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & tree_all_finite((params, opt_state))

    def keep(new, old):
        return jnp.where(finite, new, old)

    new_state = TrainState(
        params=jax.tree.map(keep, params, state.params),
        opt_state=jax.tree.map(keep, opt_state, state.opt_state),
        step=state.step + finite.astype(jnp.int32),
    )
    return new_state, grad_norm, finite


def tree_all_finite(tree: Any) -> Array:
    """Scalar bool: no floating-point leaf of ``tree`` holds NaN or Inf (integer leaves, such
    as optimizer counts, are always finite)."""
    ok = jnp.bool_(True)
    for x in jax.tree.leaves(tree):
        if jnp.issubdtype(x.dtype, jnp.inexact):
            ok &= jnp.all(jnp.isfinite(x))
    return ok


def _batch_axes(rules: Rules, mesh: Mesh) -> Any:
    return logical_to_spec(("batch",), rules, mesh)[0]


def minibatch_indices(
    num_rows: int, mini_batch_size: int, epochs: int, shuffle: bool, rng: np.random.Generator
) -> list[np.ndarray]:
    """Row indices of every PPO mini-batch: ``epochs`` passes, each over a fresh permutation
    (or in order without ``shuffle``), cut into ``num_rows / mini_batch_size`` mini-batches."""
    if mini_batch_size < 1 or num_rows % mini_batch_size:
        raise ValueError(
            f"the batch of {num_rows} responses does not split into mini-batches of "
            f"{mini_batch_size}; make the rollout size (prompts x n) a multiple of it"
        )
    out = []
    for _ in range(epochs):
        order = rng.permutation(num_rows) if shuffle else np.arange(num_rows)
        out.extend(order[i : i + mini_batch_size] for i in range(0, num_rows, mini_batch_size))
    return out
