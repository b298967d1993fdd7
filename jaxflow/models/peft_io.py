"""LoRA adapters of a jaxflow model and PEFT adapter directories.

`add_adapters` gives a loaded model fresh adapters (`jaxflow.models.lora`) in its layout;
`save_adapter` writes them as the directory ``peft`` reads (``adapter_config.json`` and
``adapter_model.safetensors``) and `load_adapter` reads such a directory back into the
model's adapters, shard by shard. `merged_model` is the model without adapters whose weights
are ``W + s A B`` (what an HF export of the adapted model holds).

PEFT keeps ``lora_A.weight`` as ``[r, in]`` and ``lora_B.weight`` as ``[out, r]`` over an
``nn.Linear``'s flattened features, named ``base_model.model.<module>.lora_A.weight``;
jaxflow keeps ``A`` as ``[in..., r]`` and ``B`` as ``[r, out...]`` (the projection's own
dimensions, e.g. ``o_proj``'s ``A`` is ``[H, K, r]``), so a tensor is a reshape and a
transpose away.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxflow.mesh import Rules, state_shardings
from jaxflow.models.decoder import HEADS
from jaxflow.models.hf_io import CheckpointError, _strip_layers, host_array, sharded_array
from jaxflow.models.lora import SUFFIX, LoRAConfig, join, merge_adapters, split_adapters, without_adapters

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
# PEFT features jaxflow does not implement: a directory using them is refused, not misread.
_UNSUPPORTED = {"use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "bias": "none"}


def _head(graphdef: nnx.GraphDef, params: Any) -> str:
    model = nnx.merge(graphdef, params)
    return next(name for name, cls in HEADS.items() if type(model) is cls)


def model_config_of(graphdef: nnx.GraphDef, params: Any) -> Any:
    """The `ModelConfig` of a split model (a static attribute of its graph)."""
    return nnx.merge(graphdef, params).cfg


def graphdef_for(model_config: Any, head: str) -> nnx.GraphDef:
    """The graph of a ``head`` model with ``model_config`` (shapes only, nothing allocated)."""
    return nnx.split(nnx.eval_shape(lambda: HEADS[head](model_config, rngs=nnx.Rngs(0))))[0]


def add_adapters(
    graphdef: nnx.GraphDef, params: Any, lora: LoRAConfig, seed: int, mesh: Mesh, rules: Rules
) -> tuple[nnx.GraphDef, Any]:
    """``(graphdef, params)`` of the model with adapters ``lora``: the base parameters as given
    (no copy), fresh adapters (A uniform, B zero: the model's outputs are unchanged) initialised
    from ``seed`` directly in their shardings under ``rules`` on ``mesh``. A model that has
    adapters already keeps them; their config must be ``lora``."""
    cfg = model_config_of(graphdef, params)
    if cfg.lora is not None:
        if cfg.lora != lora:
            raise ValueError(f"the model's adapters are {cfg.lora}, the run asks for {lora}")
        return graphdef, params
    head = _head(graphdef, params)
    adapted = cfg.replace(lora=lora)

    def init() -> Any:
        return split_adapters(nnx.state(HEADS[head](adapted, rngs=nnx.Rngs(seed))))[1]

    abstract = jax.eval_shape(init)
    adapters = jax.jit(init, out_shardings=state_shardings(abstract, rules, mesh))()  # only the adapters survive
    return graphdef_for(adapted, head), join(params, adapters)


def base_graphdef(graphdef: nnx.GraphDef, params: Any) -> nnx.GraphDef:
    """The graph of the adapted model's base (the same model without adapters)."""
    cfg = model_config_of(graphdef, params)
    return graphdef_for(without_adapters(cfg), _head(graphdef, params))


def merged_model(graphdef: nnx.GraphDef, params: Any) -> nnx.Module:
    """The adapted model as a model without adapters whose adapted weights are ``W + s A B``
    (in their own dtype; computed where the weights lie)."""
    cfg = model_config_of(graphdef, params)
    base, adapters = split_adapters(params)
    merged = jax.jit(lambda b, a: merge_adapters(b, a, cfg.lora))(base, adapters)
    return nnx.merge(base_graphdef(graphdef, params), merged)


# --- PEFT directories ------------------------------------------------------------------------


def _module_name(path: tuple) -> tuple[str, int | None]:
    """``("model", "layers", 3, "self_attn", "q_proj_lora", "a")`` -> (``"model.layers.{i}.
    self_attn.q_proj"``, 3); a scanned stack gives its layer as None."""
    key, layer = _strip_layers(path)
    sub, proj = key[1], key[2][: -len(SUFFIX)]
    return f"model.layers.{{i}}.{sub}.{proj}", layer


def _tensor_name(module: str, which: str, layer: int) -> str:
    return f"{_PREFIX}{module.format(i=layer)}.lora_{which.upper()}.weight"


def _to_peft(which: str, x: np.ndarray) -> np.ndarray:
    """jaxflow's A ``[in..., r]`` / B ``[r, out...]`` -> PEFT's ``[r, in]`` / ``[out, r]``."""
    if which == "a":
        return x.reshape(-1, x.shape[-1]).T
    return x.reshape(x.shape[0], -1).T


def _from_peft(which: str, t: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return t.T.reshape(shape)


def peft_config(lora: LoRAConfig, base_model: str) -> dict[str, Any]:
    """``adapter_config.json`` of adapters ``lora`` on the base model at ``base_model``."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list(lora.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def save_adapter(cfg: Any, adapters: Any, path: str | os.PathLike, base_model: str = "") -> str:
    """Writes the adapters of a model with config ``cfg`` (its ``lora``; ``adapters``: their
    state, or the whole model's) as the PEFT directory ``path``; ``base_model``: where the base
    model lives (PEFT's ``base_model_name_or_path``, the pointer a loader follows). In a
    multi-process world every process calls it (each adapter is gathered) and process 0 writes."""
    if cfg.lora is None:
        raise ValueError("the model has no LoRA adapters to save")
    _, adapters = split_adapters(adapters)
    tensors: dict[str, np.ndarray] = {}
    for p, v in jax.tree_util.tree_leaves_with_path(adapters, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        module, layer = _module_name(p)
        which = getattr(p[-1], "key", p[-1])
        x = host_array(v.get_value()).astype(np.float32)
        layers = range(cfg.num_layers) if layer is None else [layer]
        for i in layers:
            tensors[_tensor_name(module, which, i)] = np.ascontiguousarray(
                _to_peft(which, x[i] if layer is None else x)
            )
    path = os.fspath(path)
    if jax.process_index() != 0:
        return path
    os.makedirs(path, exist_ok=True)
    tmp = os.path.join(path, f".{ADAPTER_WEIGHTS}.tmp-{os.getpid()}")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(path, ADAPTER_WEIGHTS))
    with open(os.path.join(path, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
        json.dump(peft_config(cfg.lora, base_model), f, indent=2)
    return path


def read_adapter_config(path: str | os.PathLike) -> tuple[LoRAConfig, str]:
    """``(LoRAConfig, base_model_name_or_path)`` of the PEFT directory ``path``; features
    jaxflow does not implement (rsLoRA, DoRA, biases, per-layer ranks) are refused."""
    file = os.path.join(os.fspath(path), ADAPTER_CONFIG)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no {ADAPTER_CONFIG} in {path} (a PEFT LoRA adapter directory)")
    with open(file, encoding="utf-8") as f:
        c = json.load(f)
    if c.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{file}: peft_type {c.get('peft_type')!r}; jaxflow reads LoRA adapters")
    bad = [f"{k}={c[k]!r}" for k, want in _UNSUPPORTED.items() if c.get(k, want) != want]
    bad += [k for k in ("rank_pattern", "alpha_pattern", "layers_to_transform", "modules_to_save") if c.get(k)]
    if bad:
        raise CheckpointError(f"{file}: jaxflow's adapters do not support {', '.join(bad)}")
    targets = c["target_modules"]
    try:
        lora = LoRAConfig(
            rank=int(c["r"]), alpha=float(c["lora_alpha"]), targets=targets, dropout=c.get("lora_dropout", 0.0)
        )
    except ValueError as e:
        raise CheckpointError(f"{file}: {e}") from None
    return lora, str(c.get("base_model_name_or_path") or "")


def load_adapter(path: str | os.PathLike, graphdef: nnx.GraphDef, params: Any, mesh: Mesh, rules: Rules) -> Any:
    """``params`` with the adapters read from the PEFT directory ``path`` (the model's adapters
    must have its config), each placed by ``rules`` on ``mesh`` from the blocks this process's
    devices hold."""
    cfg = model_config_of(graphdef, params)
    lora, _ = read_adapter_config(path)
    if cfg.lora != lora:
        raise CheckpointError(f"the adapter in {path} is {lora}; the model's adapters are {cfg.lora}")
    base, adapters = split_adapters(params)
    shardings = state_shardings(adapters, rules, mesh)
    with safe_open(os.path.join(os.fspath(path), ADAPTER_WEIGHTS), "np") as f:
        names = set(f.keys())

        def read(p, v, sharding):
            module, layer = _module_name(p)
            which = getattr(p[-1], "key", p[-1])
            shape = tuple(v.get_value().shape)
            layers = range(shape[0]) if layer is None else [layer]
            wanted = [_tensor_name(module, which, i) for i in layers]
            missing = [n for n in wanted if n not in names]
            if missing:
                raise CheckpointError(f"{path}: no tensor {missing[0]} (the adapter targets other modules or layers)")
            one = shape[1:] if layer is None else shape
            blocks = [_from_peft(which, f.get_tensor(n), one) for n in wanted]
            whole = np.stack(blocks) if layer is None else blocks[0]
            if whole.size != math.prod(shape):
                raise CheckpointError(f"{path}: {wanted[0]} has the wrong shape for rank {lora.rank}")
            return v.replace(sharded_array(shape, v.get_value().dtype, sharding, lambda index: whole[index]))

        loaded = jax.tree_util.tree_map_with_path(
            read, adapters, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable)
        )
    return join(base, loaded)
