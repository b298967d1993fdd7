"""One orbax item per array tree: how a train state is stored in a checkpoint step
(`jaxflow.trainer.checkpoint` lays the steps out), written and read by whichever process holds
the arrays.

In a multi-process world (a Ray worker group: one `jax.distributed` world) every process of
the world calls `save_item` / `restore_item` with the same path, in lock step: each writes the
shards it holds (``replica_id == 0``) and reads the shards its devices need, orbax's primary
process (process 0) writes the metadata, and orbax synchronises the world around the commit.
A restore target may use another mesh than the save (e.g. 4 processes saved, 2 restore):
orbax reads the stored chunks into the target's shardings.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

PyTree = Any


def flatten_tree(tree: PyTree) -> tuple[dict[str, Any], Any]:
    """``({"params__layers__0__kernel": leaf, ...}, treedef)``: any pytree as one level of string
    keys, so items can hold trees orbax cannot name (e.g. ``nnx.State`` with the integer keys of
    layer lists, dataclass nodes); restore unflattens with the target's treedef."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    flat = {
        "__".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path): leaf
        for path, leaf in leaves
    }
    if len(flat) != len(leaves):
        raise ValueError("tree keys collide when flattened for a checkpoint")
    return flat, treedef


def as_restore_target(tree: PyTree) -> PyTree:
    """Concrete arrays become abstract targets with their sharding; abstract ones pass."""

    def leaf(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x

    return jax.tree.map(leaf, tree)


def abstract_tree(tree: PyTree) -> PyTree:
    """Shapes and dtypes of ``tree``'s arrays (no data, no sharding): what a controller checks a
    checkpoint against without holding the arrays."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "dtype") else x, tree)


def save_item(path: str | os.PathLike, tree: PyTree) -> None:
    """Writes ``tree`` as the orbax item directory ``path`` (see the module docstring)."""
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:
        checkpointer.save(os.fspath(path), args=ocp.args.StandardSave(flatten_tree(tree)[0]))


def restore_item(path: str | os.PathLike, target: PyTree) -> PyTree:
    """The item at ``path`` read into ``target``'s structure and shardings (arrays, or
    ``jax.ShapeDtypeStruct`` with ``sharding=``)."""
    flat, treedef = flatten_tree(as_restore_target(target))
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:
        out = checkpointer.restore(os.fspath(path), args=ocp.args.StandardRestore(flat))
    return jax.tree_util.tree_unflatten(treedef, [out[key] for key in flat])
