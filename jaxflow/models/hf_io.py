"""HF checkpoint I/O: ``from_pretrained`` streams a local HF directory (config.json plus
``*.safetensors``, sharded index included) straight into the target shardings, one tensor at
a time; ``save_pretrained`` writes HF-format safetensors and config.json that transformers
loads.

jaxflow keeps attention kernels as [D, heads, head_dim] (so heads can be sharded by name);
HF keeps ``nn.Linear`` weights as [out, in]. The table below converts between the two.
"""

from __future__ import annotations

import dataclasses
import functools
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
from jax.sharding import Mesh, SingleDeviceSharding
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


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How a jaxflow parameter lies in its HF tensor (``K`` = head_dim):

    * ``same``: the same array; ``transpose``: ``[in, out]`` here, ``[out, in]`` in HF;
    * ``heads_in``: q/k/v kernels ``[D, n, K]`` here, ``[n*K, D]`` in HF;
    * ``heads_out``: the output projection ``[H, K, D]`` here, ``[D, H*K]`` in HF;
    * ``heads_bias``: q/k/v biases ``[n, K]`` here, ``[n*K]`` in HF.

    `read` reads one block of the parameter (a tuple of slices in jaxflow's layout) from the
    HF tensor: only the HF rows and columns that the block covers (whole heads), so a
    process reads the shards its devices hold and not the tensor."""

    kind: str
    head_dim: int = 0

    def to_hf(self, w: Any) -> Any:
        if self.kind == "same":
            return w
        if self.kind == "transpose":
            return w.T
        if self.kind == "heads_in":
            return w.reshape(w.shape[0], -1).T
        if self.kind == "heads_out":
            return w.reshape(-1, w.shape[-1]).T
        return w.reshape(-1)  # heads_bias

    def read(self, ckpt: _Checkpoint, name: str, hf_shape: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
        if self.kind == "same":
            return ckpt.read(name, hf_shape, index)
        if self.kind == "transpose":
            return ckpt.read(name, hf_shape, (index[1], index[0])).T
        K = self.head_dim
        heads = {"heads_in": 1, "heads_out": 0, "heads_bias": 0}[self.kind]
        sh = index[heads]
        n = sh.stop - sh.start
        rows = slice(sh.start * K, sh.stop * K)  # whole heads; head_dim is cut after the read
        if self.kind == "heads_in":
            sd, _, sk = index
            return ckpt.read(name, hf_shape, (rows, sd)).T.reshape(sd.stop - sd.start, n, K)[:, :, sk]
        if self.kind == "heads_out":
            _, sk, sd = index
            return ckpt.read(name, hf_shape, (sd, rows)).T.reshape(n, K, sd.stop - sd.start)[:, sk, :]
        return ckpt.read(name, hf_shape, (rows,)).reshape(n, K)[:, index[1]]


def _tensor_table(cfg: ModelConfig, head: str) -> list[tuple[tuple[str, ...], str, _Layout]]:
    """(path in a layer-free state, HF name with ``{i}`` for the layer, layout)."""
    same, transpose = _Layout("same"), _Layout("transpose")
    heads_in, heads_out, heads_bias = (_Layout(k, cfg.head_dim) for k in ("heads_in", "heads_out", "heads_bias"))
    layer = "model.layers.{i}."
    table = [
        (("model", "embed_tokens"), "model.embed_tokens.weight", same),
        (("model", "norm", "weight"), "model.norm.weight", same),
        (("layers", "input_layernorm", "weight"), layer + "input_layernorm.weight", same),
        (("layers", "post_attention_layernorm", "weight"), layer + "post_attention_layernorm.weight", same),
        (("layers", "self_attn", "q_proj"), layer + "self_attn.q_proj.weight", heads_in),
        (("layers", "self_attn", "k_proj"), layer + "self_attn.k_proj.weight", heads_in),
        (("layers", "self_attn", "v_proj"), layer + "self_attn.v_proj.weight", heads_in),
        (("layers", "self_attn", "o_proj"), layer + "self_attn.o_proj.weight", heads_out),
        (("layers", "mlp", "gate_proj"), layer + "mlp.gate_proj.weight", transpose),
        (("layers", "mlp", "up_proj"), layer + "mlp.up_proj.weight", transpose),
        (("layers", "mlp", "down_proj"), layer + "mlp.down_proj.weight", transpose),
    ]
    if cfg.attention_bias:
        table += [
            (("layers", "self_attn", "q_bias"), layer + "self_attn.q_proj.bias", heads_bias),
            (("layers", "self_attn", "k_bias"), layer + "self_attn.k_proj.bias", heads_bias),
            (("layers", "self_attn", "v_bias"), layer + "self_attn.v_proj.bias", heads_bias),
        ]
    if cfg.qk_norm:
        table += [
            (("layers", "self_attn", "q_norm", "weight"), layer + "self_attn.q_norm.weight", same),
            (("layers", "self_attn", "k_norm", "weight"), layer + "self_attn.k_norm.weight", same),
        ]
    if head == "lm" and not cfg.tie_word_embeddings:
        table.append((("lm_head",), "lm_head.weight", transpose))
    if head == "value":
        table += [(("score",), "score.weight", transpose), (("score_bias",), "score.bias", same)]
    if head == "reward":
        table.append((("score",), "score.weight", transpose))
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
        self.bytes_read = 0  # bytes of the blocks read so far (what the reader copied out of the files)
        self.largest_block = 0  # the largest block read at once, in bytes
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

    def read(self, name: str, expected_shape: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
        """The block ``index`` (slices of the HF tensor) of tensor ``name``, read from its file
        (``safetensors``' ``get_slice``: only that block is copied out). Counts the bytes into
        `bytes_read` and the largest block into `largest_block`."""
        if name not in self.weight_map:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.path}")
        file = self.weight_map[name]
        full = os.path.join(self.path, file)
        reader = self._open(file)
        if name not in reader.keys():
            raise CheckpointError(f"tensor {name!r} is missing from {full}")
        tensor = reader.get_slice(name)
        shape = tuple(tensor.get_shape())
        if shape != tuple(expected_shape):
            raise CheckpointError(
                f"tensor {name!r} in {full} has shape {shape}; the config implies {tuple(expected_shape)}"
            )
        try:
            block = np.asarray(tensor[index])
        except (SafetensorError, TypeError, ValueError) as e:
            raise CheckpointError(f"{full}: cannot read tensor {name!r} ({e})") from None
        self.bytes_read += block.nbytes
        self.largest_block = max(self.largest_block, block.nbytes)
        return block


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
    read_stats: dict[str, int] | None = None,
    **config_overrides: Any,
) -> nnx.Module:
    """Load a local HF checkpoint into a jaxflow model, sharded on ``mesh`` by ``rules``.

    Each parameter is built from the blocks that this process's devices hold
    (`sharded_array`): a block is read from the file on its own (``get_slice``: the HF rows
    and columns it covers), converted to jaxflow's layout and the parameter dtype ``dtype``,
    and put on its devices. So no device and no host ever holds the whole model: in a
    multi-process world (`jax.distributed`) each process reads only its shards, and the host
    holds one parameter's local blocks at a time. ``head`` is ``lm`` (actor, reference),
    ``value`` (critic; its head starts at zero when the checkpoint is an actor's) or
    ``reward`` (reward and cost models; the checkpoint must carry ``score.weight``).

    ``read_stats``: a dict that receives ``bytes_read`` (bytes of the blocks read from the
    files, measured) and ``largest_block`` (the largest block read at once, in bytes).
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
    load = functools.partial(
        _load_parameter, ckpt, {k: (n, lay) for k, n, lay in _tensor_table(cfg, head)}, head, np.dtype(dtype)
    )
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    # A progress bar on a terminal only (a log file gets nothing).
    with tqdm(
        total=len(jax.tree.leaves(state, is_leaf=is_var)),
        desc=f"loading {os.path.basename(path)}",
        unit="tensor",
        leave=False,
        disable=not sys.stderr.isatty(),
    ) as progress:

        def load_and_count(p, v, s):
            out = v.replace(load(p, v, s))
            progress.update()
            return out

        values = jax.tree_util.tree_map_with_path(load_and_count, state, shardings, is_leaf=is_var)
    if read_stats is not None:
        read_stats.update(bytes_read=ckpt.bytes_read, largest_block=ckpt.largest_block)
    return nnx.merge(graphdef, values)


def _load_parameter(ckpt: Any, table: dict, head: str, dtype: np.dtype, path_keys, variable, sharding) -> jax.Array:
    """One parameter of `from_pretrained`, each device's block read from its HF tensor(s):
    a value head missing from an actor checkpoint starts at zero; a scanned stack [L, ...]
    reads each layer of a block from its own tensor."""
    key, layer = _strip_layers(path_keys)
    shape = tuple(variable.get_value().shape)
    if key not in table:
        raise CheckpointError(f"no HF tensor mapping for parameter {key}")
    name, layout = table[key]
    if head == "value" and key[0] in ("score", "score_bias") and name not in ckpt:
        log.info("%s has no value head (%s): initialising it to zero", ckpt.path, name)
        return sharded_array(shape, dtype, sharding, lambda index: np.zeros([s.stop - s.start for s in index], dtype))
    if layer is not None or key[0] != "layers":
        hf_shape = _hf_shape(layout.to_hf, shape)
        return sharded_array(
            shape, dtype, sharding, lambda index: layout.read(ckpt, name.format(i=layer), hf_shape, index)
        )
    hf_shape = _hf_shape(layout.to_hf, shape[1:])

    def read_layers(index):
        return np.stack(
            [layout.read(ckpt, name.format(i=i), hf_shape, index[1:]) for i in range(index[0].start, index[0].stop)]
        )

    return sharded_array(shape, dtype, sharding, read_layers)


def sharded_array(
    shape: tuple[int, ...], dtype: Any, sharding: jax.sharding.Sharding, read: Callable[[tuple[slice, ...]], np.ndarray]
) -> jax.Array:
    """The array of ``shape`` laid out by ``sharding``, built from the blocks that this
    process's devices hold: ``read(index)`` (a tuple of ``slice(start, stop)``, one per
    dimension) returns one block; each distinct block is read once, however many local
    devices hold it (``jax.make_array_from_callback``). Works in a multi-process world."""
    blocks: dict[tuple, np.ndarray] = {}

    def block(index: tuple) -> np.ndarray:
        key = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
        if key not in blocks:
            data = np.asarray(read(tuple(slice(a, b) for a, b in key)), dtype)
            want = tuple(b - a for a, b in key)
            if data.shape != want:
                raise ValueError(f"a block {key} of an array of shape {shape} came back with shape {data.shape}")
            blocks[key] = data
        return blocks[key]

    return jax.make_array_from_callback(tuple(shape), sharding, block)


def _hf_tensors(
    model: nnx.Module, cfg: ModelConfig, head: str
) -> list[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]]:
    """``(hf name, shape, fetch)`` of every tensor of ``model``'s HF checkpoint, in table order
    (a scanned stack gives one tensor per layer)."""
    table = [(key, name, layout.to_hf) for key, name, layout in _tensor_table(cfg, head)]
    flat = {}
    for p, v in jax.tree_util.tree_leaves_with_path(nnx.state(model), is_leaf=lambda x: isinstance(x, nnx.Variable)):
        flat[_strip_layers(p)] = v.get_value()
    tensors: list[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]] = []
    for key, name, to_hf in table:
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
    return tensors


def save_pretrained(model: nnx.Module, path: str | os.PathLike, *, max_shard_bytes: int = 2 << 30) -> None:
    """Write ``config.json`` and HF-layout safetensors (sharded with an index past
    ``max_shard_bytes``) that ``transformers`` loads. Tensors are fetched from the devices
    one at a time. In a multi-process world every process calls it alike (each tensor is
    gathered from the processes that hold it: `host_array`) and process 0 writes the files,
    holding one file's tensors; the others drop each tensor once gathered."""
    path = os.fspath(path)
    primary = jax.process_index() == 0
    os.makedirs(path, exist_ok=True)
    head = _head_of(model)
    cfg: ModelConfig = model.cfg
    if cfg.lora is not None:
        raise ValueError(
            "this model has LoRA adapters, which an HF checkpoint cannot hold: write them as a PEFT adapter "
            "(jaxflow.models.peft_io.save_adapter) or merge them first (jaxflow.models.peft_io.merged_model)"
        )
    tensors = _hf_tensors(model, cfg, head)
    dtype = np.dtype(cfg.param_dtype)

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
        arrays = {}
        for n in members:
            name, shape, fetch = tensors[n]
            tensor = fetch()  # every process takes part in the gather
            if tensor.shape != shape:
                raise ValueError(f"tensor {name!r}: expected shape {shape}, got {tensor.shape}")
            if primary:
                arrays[name] = np.ascontiguousarray(tensor, dtype=dtype)
        weight_map.update({tensors[n][0]: file for n in members})
        if not primary:
            continue
        tmp = os.path.join(path, f".{file}.tmp-{os.getpid()}")
        save_file(arrays, tmp, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(path, file))
        del arrays
    if not primary:
        return
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
        return np.ascontiguousarray(to_hf(host_array(arr if index is None else arr[index])))

    return fetch


def host_array(x: Any) -> np.ndarray:
    """``x`` whole, on this host: a host or fully addressable array as it is; a global array of
    a multi-process world gathered from every process (``process_allgather``: a collective,
    so every process of the world calls it, in the same order)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


__all__ = ["from_pretrained", "save_pretrained", "CheckpointError", "CausalLM", "ValueModel", "RewardModel"]
