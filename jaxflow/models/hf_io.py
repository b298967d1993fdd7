"""HF checkpoint I/O: ``from_pretrained`` streams a local HF directory (config.json plus
``*.safetensors``, sharded index included) straight into the target shardings, one tensor at
a time; ``save_pretrained`` writes HF-format safetensors and config.json that transformers
loads.

jaxflow keeps attention kernels as [D, heads, head_dim] (so heads can be sharded by name);
HF keeps ``nn.Linear`` weights as [out, in]. The table below converts between the two.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file
from tqdm.auto import tqdm

from jaxflow.mesh import TRAIN_RULES, Rules, state_shardings
from jaxflow.models.config import ModelConfig
from jaxflow.models.decoder import HEADS, CausalLM, RewardModel, ValueModel

log = logging.getLogger(__name__)

Transform = Callable[[Any], Any]


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, or does not match the model."""


def _tensor_table(cfg: ModelConfig, head: str) -> list[tuple[tuple[str, ...], str, Transform, Transform]]:
    """(path in a layer-free state, HF name with ``{i}`` for the layer, hf->ours, ours->hf)."""
    D, H, N, K = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    same = lambda w: w  # noqa: E731
    transpose = lambda w: w.T  # noqa: E731

    def proj_in(heads):
        return (lambda w: w.T.reshape(D, heads, K)), (lambda w: w.reshape(D, heads * K).T)

    q_in, q_out = proj_in(H)
    kv_in, kv_out = proj_in(N)
    layer = "model.layers.{i}."
    table = [
        (("model", "embed_tokens"), "model.embed_tokens.weight", same, same),
        (("model", "norm", "weight"), "model.norm.weight", same, same),
        (("layers", "input_layernorm", "weight"), layer + "input_layernorm.weight", same, same),
        (("layers", "post_attention_layernorm", "weight"), layer + "post_attention_layernorm.weight", same, same),
        (("layers", "self_attn", "q_proj"), layer + "self_attn.q_proj.weight", q_in, q_out),
        (("layers", "self_attn", "k_proj"), layer + "self_attn.k_proj.weight", kv_in, kv_out),
        (("layers", "self_attn", "v_proj"), layer + "self_attn.v_proj.weight", kv_in, kv_out),
        (("layers", "self_attn", "o_proj"), layer + "self_attn.o_proj.weight",
         lambda w: w.T.reshape(H, K, D), lambda w: w.reshape(H * K, D).T),
        (("layers", "mlp", "gate_proj"), layer + "mlp.gate_proj.weight", transpose, transpose),
        (("layers", "mlp", "up_proj"), layer + "mlp.up_proj.weight", transpose, transpose),
        (("layers", "mlp", "down_proj"), layer + "mlp.down_proj.weight", transpose, transpose),
    ]
    if cfg.attention_bias:
        table += [
            (("layers", "self_attn", "q_bias"), layer + "self_attn.q_proj.bias",
             lambda b: b.reshape(H, K), lambda b: b.reshape(H * K)),
            (("layers", "self_attn", "k_bias"), layer + "self_attn.k_proj.bias",
             lambda b: b.reshape(N, K), lambda b: b.reshape(N * K)),
            (("layers", "self_attn", "v_bias"), layer + "self_attn.v_proj.bias",
             lambda b: b.reshape(N, K), lambda b: b.reshape(N * K)),
        ]
    if cfg.qk_norm:
        table += [
            (("layers", "self_attn", "q_norm", "weight"), layer + "self_attn.q_norm.weight", same, same),
            (("layers", "self_attn", "k_norm", "weight"), layer + "self_attn.k_norm.weight", same, same),
        ]
    if head == "lm" and not cfg.tie_word_embeddings:
        table.append((("lm_head",), "lm_head.weight", transpose, transpose))
    if head == "value":
        table += [(("score",), "score.weight", transpose, transpose), (("score_bias",), "score.bias", same, same)]
    if head == "reward":
        table.append((("score",), "score.weight", transpose, transpose))
    return table


def _head_of(model: nnx.Module) -> str:
    for name, cls in HEADS.items():
        if isinstance(model, cls):
            return name
    raise TypeError(f"not a jaxflow model: {type(model).__name__}")


_ARCH_SUFFIX = {"lm": "ForCausalLM", "value": "ForTokenClassification", "reward": "ForSequenceClassification"}


class _Checkpoint:
    """Tensor name -> file, over a single file or a sharded index. Files are opened lazily with
    the ``safetensors`` library (memory-mapped: a tensor is read only when asked for)."""

    def __init__(self, path: str):
        self.path = path
        index_path = os.path.join(path, "model.safetensors.index.json")
        self._files: dict[str, Any] = {}
        if os.path.exists(index_path):
            try:
                with open(index_path, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index_path}: malformed index ({e})") from None
            self.weight_map = dict(weight_map)
            for file in sorted(set(weight_map.values())):
                if not os.path.exists(os.path.join(path, file)):
                    raise CheckpointError(f"{index_path} names {file}, which is missing from {path}")
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors files in {path}")
            self.weight_map = {}
            for file in files:
                for name in self._open(file).keys():
                    self.weight_map[name] = file

    def _open(self, file: str):
        if file not in self._files:
            full = os.path.join(self.path, file)
            try:
                self._files[file] = safe_open(full, framework="numpy")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{full}: truncated or corrupt safetensors file ({e})") from None
        return self._files[file]

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str, expected_shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.weight_map:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.path}")
        file = self.weight_map[name]
        full = os.path.join(self.path, file)
        reader = self._open(file)
        if name not in reader.keys():
            raise CheckpointError(f"tensor {name!r} is missing from {full}")
        shape = tuple(reader.get_slice(name).get_shape())
        if shape != tuple(expected_shape):
            raise CheckpointError(
                f"tensor {name!r} in {full} has shape {shape}; the config implies {tuple(expected_shape)}"
            )
        try:
            return reader.get_tensor(name)
        except (SafetensorError, TypeError) as e:
            raise CheckpointError(f"{full}: cannot read tensor {name!r} ({e})") from None


def _strip_layers(path: tuple) -> tuple[tuple[str, ...], int | None]:
    """('model', 'layers', 3, 'mlp', 'up_proj') -> (('layers', 'mlp', 'up_proj'), 3)."""
    keys = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)
    if len(keys) > 1 and keys[:2] == ("model", "layers"):
        rest = keys[2:]
        if rest and isinstance(rest[0], int):
            return ("layers",) + tuple(rest[1:]), rest[0]
        return ("layers",) + tuple(rest), None
    return tuple(keys), None


def from_pretrained(
    path: str | os.PathLike,
    *,
    dtype: Any = jnp.float32,
    compute_dtype: Any = None,
    mesh: Mesh | None = None,
    rules: Rules = TRAIN_RULES,
    head: str = "lm",
    scan_layers: bool = False,
    remat_policy: str = "none",
    **config_overrides: Any,
) -> nnx.Module:
    """Load a local HF checkpoint into a jaxflow model, sharded on ``mesh`` by ``rules``.

    Tensors are read one at a time (memory-mapped), converted to jaxflow's layout and the
    parameter dtype ``dtype``, and placed shard by shard: no device ever holds the whole
    model and the host holds about one tensor beyond the shards. ``head`` is ``lm`` (actor,
    reference), ``value`` (critic; its head starts at zero when the checkpoint is an actor's)
    or ``reward`` (reward and cost models; the checkpoint must carry ``score.weight``).
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}; choose from {sorted(HEADS)}")
    cfg = ModelConfig.from_json_file(
        os.path.join(path, "config.json"),
        param_dtype=dtype,
        dtype=compute_dtype or dtype,
        scan_layers=scan_layers,
        remat_policy=remat_policy,
        **config_overrides,
    )
    ckpt = _Checkpoint(path)
    abstract = nnx.eval_shape(lambda: HEADS[head](cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    if mesh is not None:
        shardings = state_shardings(state, rules, mesh)
    else:
        device = SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    table = {key: (name, to_ours, to_hf) for key, name, to_ours, to_hf in _tensor_table(cfg, head)}
    target_dtype = np.dtype(dtype)

    def load_one(name: str, to_ours: Transform, to_hf: Transform, shape, sharding):
        hf_shape = jax.eval_shape(to_hf, jax.ShapeDtypeStruct(shape, jnp.float32)).shape
        host = np.asarray(to_ours(ckpt.get(name, hf_shape))).astype(target_dtype)
        return jax.device_put(host, sharding)

    def load(path_keys, variable, sharding):
        key, layer = _strip_layers(path_keys)
        shape = tuple(variable.get_value().shape)
        if key not in table:
            raise CheckpointError(f"no HF tensor mapping for parameter {key}")
        name, to_ours, to_hf = table[key]
        if head == "value" and key[0] in ("score", "score_bias") and name not in ckpt:
            log.info("%s has no value head (%s): initialising it to zero", path, name)
            return jax.device_put(np.zeros(shape, target_dtype), sharding)
        if layer is not None or key[0] != "layers":
            return load_one(name.format(i=layer), to_ours, to_hf, shape, sharding)
        # A scanned stack: fill it layer by layer in place (donated), never two copies.
        layer_sharding = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:])) \
            if isinstance(sharding, NamedSharding) else sharding
        stacked = jax.jit(lambda: jnp.zeros(shape, target_dtype), out_shardings=sharding)()
        for i in range(shape[0]):
            one = load_one(name.format(i=i), to_ours, to_hf, shape[1:], layer_sharding)
            stacked = _set_layer(stacked, one, i)
        return stacked

    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    # A progress bar on a terminal only (a log file gets nothing).
    with tqdm(total=len(jax.tree.leaves(state, is_leaf=is_var)), desc=f"loading {os.path.basename(path)}",
              unit="tensor", leave=False, disable=not sys.stderr.isatty()) as progress:

        def load_and_count(p, v, s):
            out = v.replace(load(p, v, s))
            progress.update()
            return out

        values = jax.tree_util.tree_map_with_path(load_and_count, state, shardings, is_leaf=is_var)
    return nnx.merge(graphdef, values)


def _set_layer_impl(stacked, one, i):
    return jax.lax.dynamic_update_index_in_dim(stacked, one.astype(stacked.dtype), i, 0)


_set_layer = jax.jit(_set_layer_impl, donate_argnums=0)


def save_pretrained(model: nnx.Module, path: str | os.PathLike, *, max_shard_bytes: int = 2 << 30) -> None:
    """Write ``config.json`` and HF-layout safetensors (sharded with an index past
    ``max_shard_bytes``) that ``transformers`` loads. Tensors are fetched from the devices
    one at a time."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    head = _head_of(model)
    cfg: ModelConfig = model.cfg
    table = _tensor_table(cfg, head)
    state = nnx.state(model)
    flat = {}
    for p, v in jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        flat[_strip_layers(p)] = v.get_value()
    dtype = np.dtype(cfg.param_dtype)

    # (hf name, shape, fetch)
    tensors: list[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]] = []
    for key, name, _, to_hf in table:
        if key[0] != "layers":
            arr = flat[(key, None)]
            tensors.append((name, _hf_shape(to_hf, arr.shape[0:]), _fetcher(arr, None, to_hf)))
            continue
        for i in range(cfg.num_layers):
            if (key, i) in flat:  # unrolled layers
                arr, index = flat[(key, i)], None
            else:  # scanned stack
                arr, index = flat[(key, None)], i
            shape = arr.shape if index is None else arr.shape[1:]
            tensors.append((name.format(i=i), _hf_shape(to_hf, shape), _fetcher(arr, index, to_hf)))

    shards: list[list[int]] = [[]]
    size = 0
    for n, (_, shape, _) in enumerate(tensors):
        nbytes = int(np.prod(shape)) * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nbytes
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    weight_map = {}
    for file, members in zip(files, shards):
        # One file's tensors (at most ``max_shard_bytes``) on the host at a time; written to a
        # temporary name and renamed, so an interrupted write never leaves a half file.
        arrays = {tensors[n][0]: np.ascontiguousarray(tensors[n][2](), dtype=dtype) for n in members}
        for n in members:
            name, shape, _ = tensors[n]
            if arrays[name].shape != shape:
                raise ValueError(f"tensor {name!r}: expected shape {shape}, got {arrays[name].shape}")
        tmp = os.path.join(path, f".{file}.tmp-{os.getpid()}")
        save_file(arrays, tmp, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(path, file))
        del arrays
        weight_map.update({tensors[n][0]: file for n in members})
    index_path = os.path.join(path, "model.safetensors.index.json")
    if len(files) > 1:
        total = sum(int(np.prod(s)) * dtype.itemsize for _, s, _ in tensors)
        with open(index_path, "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    elif os.path.exists(index_path):
        os.remove(index_path)
    hf = cfg.to_hf_dict(_ARCH_SUFFIX[head])
    if head != "lm":
        hf["num_labels"] = 1
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf, f, indent=2)


def _hf_shape(to_hf: Transform, shape) -> tuple[int, ...]:
    return tuple(jax.eval_shape(to_hf, jax.ShapeDtypeStruct(tuple(shape), jnp.float32)).shape)


def _fetcher(arr: jax.Array, index: int | None, to_hf: Transform) -> Callable[[], np.ndarray]:
    def fetch():
        host = np.asarray(jax.device_get(arr if index is None else arr[index]))
        return np.ascontiguousarray(to_hf(host))

    return fetch


__all__ = ["from_pretrained", "save_pretrained", "CheckpointError", "CausalLM", "ValueModel", "RewardModel"]
