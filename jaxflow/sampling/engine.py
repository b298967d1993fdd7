"""The rollout engine: paged KV cache, continuous batching over a fixed number of decode slots,
prompt prefixes shared by the n samples, per-row limits and stops; one compiled program.

``generate_from_state(graphdef, state, prompt_ids, prompt_mask, params, mesh=..., rules=...,
max_new_tokens=..., options=EngineOptions(slots=..., page_size=..., kv_tokens=...))`` runs, per generation replica
(one per data-parallel group of the mesh, under ``shard_map`` over the mesh's batch axes),
`batcher.rollout`:

1. **Chunked prefill.** The prompts (their first p_i - 1 tokens) are written into pages of a
   paged KV cache (`paged`), ``PREFILL_ROWS`` prompts x ``PREFILL_LEN`` tokens per chunk, once
   per prompt whatever ``n`` is: the n samples of a prompt share its pages.
2. **Continuous decode.** ``slots`` sequences decode at once, one token per slot per step;
   a sequence that stops frees its slot and its pages and the next waiting row takes the
   slot in the next step. Rows wait in row order (row ``i * n + s`` is sample s of prompt i,
   verl's ``repeat(interleave=True)``). The loop ends when every row has finished.

Stopping. A row finishes on any of ``eos_token_ids`` (the EOS token is part of the response
and is masked in, as in verl), at its own ``max_new_tokens`` (an int, or an array of one
limit per row or per prompt, as vLLM's per-request limit), or after the token that completes
one of the ``SamplingParams.stop`` strings (matched on the device, `stops`; the tokenizer
gives each token's text). A finished row frees its slot and pages at once. Later positions
hold the pad id (``cfg.pad_token_id`` or 0) with mask 0 and log-prob 0.

Memory. The page pool is sized from a token budget (``kv_tokens`` per replica), not for the
worst case. Default: the prompts that can be alive and a quarter of every slot's response
buffer (`batcher.pool_pages`); for rows that can only stop at their limits (no EOS ids, no
stop strings) every token is known, and the default is the peak of the schedule in which no
row waits (`batcher.no_wait_peak_pages`, rounded up to a power of two pages). A row that
finds no free page waits for one (`batcher`), which never changes what it samples. ``stats``
reports the pages allocated, the most in use and the waits (measured).

Attention. On GPU and TPU the pallas paged-attention kernels of the jax wheel run the decode
(TPU: and prefill) attention, with the pools in their layouts; elsewhere the pure-JAX
attention (`paged`). ``attention=`` overrides the choice.

Buckets. The prompt batch is rounded to ``dp * 2^k`` prompts (extra prompts copy prompt 0
and are never admitted), the prompt length to a power of two >= 16 and the response buffer R
to a power of two >= 16 (>= ``SamplingParams.max_new_tokens``). Per-row limits, the number
of rows, temperature, top-p, the PRNG key and the stop-string tables are runtime values, so
calls with any mix of lengths reuse the program (rows without EOS: while the default pool
stays in its power-of-two bucket). The arrays returned are cut to [B * n, SamplingParams.max_new_tokens] (per-row
limits are at most that).

Sharding. With a ``mesh``, every replica's prompts, slots and page pool live on its dp group
(the replica axis is sharded over the ``batch`` mesh axes); inside a replica the pools are
split over kv heads like the model's attention (tp). Parameters stay in whatever layout the
caller gives them (e.g. resharded from training).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxflow.mesh import GENERATE_RULES, Rules, logical_to_spec, sharding_rules
from jaxflow.mesh.executables import ahead_of_time
from jaxflow.models import ModelConfig
from jaxflow.sampling.batcher import (
    Static,
    no_wait_peak_pages,
    pool_bounds,
    pool_pages,
    reserve_pages,
    rollout,
)
from jaxflow.sampling.paged import KERNELS, PoolLayout, choose_kernel
from jaxflow.sampling.stops import StopStrings, scan_tokens

PROMPT_BUCKET_MIN = 16
RESPONSE_BUCKET_MIN = 16
DEFAULT_SLOTS = 256  # decode slots per replica (capped at the replica's rows)
DEFAULT_PAGE_SIZE = 16
PREFILL_ROWS = 8  # prompts per prefill chunk
PREFILL_LEN = 512  # tokens per prefill chunk


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample a rollout.

    ``eos_token_ids=None`` uses the model config's ``eos_token_id``; ``()`` never stops
    before ``max_new_tokens``. ``greedy`` ignores temperature / top-k / top-p and reports
    log-probs at temperature 1. ``top_k=0`` and ``top_p=1.0`` disable those filters.
    ``pad_token_id=None`` uses ``cfg.pad_token_id`` (or 0).
    """

    max_new_tokens: int
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    n: int = 1
    eos_token_ids: tuple[int, ...] | int | None = None
    seed: int = 0
    pad_token_id: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not self.greedy and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (use greedy=True for argmax), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.eos_token_ids, (int, np.integer)):
            object.__setattr__(self, "eos_token_ids", (int(self.eos_token_ids),))
        elif self.eos_token_ids is not None:
            object.__setattr__(self, "eos_token_ids", tuple(int(e) for e in self.eos_token_ids))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """A rollout of ``B * n`` rows (row ``i * n + s`` is sample s of prompt i).

    ``responses`` int32 [B*n, max_new_tokens], right-padded with the pad id;
    ``response_mask`` int32 (1 on generated tokens, EOS included); ``log_probs`` float32,
    ``log_softmax(logits / T)`` of each sampled token (0 on padding); ``lengths`` int32
    [B*n]; ``num_steps`` (int32 scalar): decode iterations of the longest-running replica.
    ``stats``: the engine's shape (``replicas``, ``slots``, ``page_size``, ``attention``
    (the kernel), ``pages_per_replica`` allocated (trash page included), ``kv_pool_bytes``
    allocated for keys and values over all replicas, ``page_bytes``) and, measured in the
    program, ``peak_pages`` [replicas] (the most pages in use at once, prompts included),
    ``peak_kv_bytes`` (their bytes, summed over replicas) and ``waits`` [replicas] (slot-steps
    in which an active row waited for a page) and ``prefill_tokens`` [B] (the prompt tokens
    the model ran on: the prefill chunks' and, per sample, the first decode input; a
    `session.KVSession` call counts only what its conversations appended since their last
    call). ``logits`` (raw model logits [B*n, max_new_tokens, V] used at each step) and
    ``cache`` (the final page pools (k, v), [replicas, layers, kv_heads, pages, page_size,
    head_dim]) are debug outputs, None unless requested.
    """

    responses: jax.Array
    response_mask: jax.Array
    log_probs: jax.Array
    lengths: jax.Array
    num_steps: jax.Array
    stats: dict = dataclasses.field(default_factory=dict)
    logits: jax.Array | None = None
    cache: tuple[jax.Array, jax.Array] | None = None


def bucket_size(size: int, multiple: int = 1, minimum: int = 1) -> int:
    """The smallest ``multiple * 2^k`` that is >= ``max(size, minimum)``."""
    target = max(size, minimum, 1)
    return multiple * (1 << max(0, math.ceil(math.log2(target / multiple)))) if target > multiple else multiple


def _batch_spec(rules: Rules, mesh: Mesh | None, *names: str | None) -> PartitionSpec:
    return logical_to_spec(("batch",) + names, rules, mesh)


def _replica_rules(rules: Rules) -> Rules:
    """Inside one replica the batch is not split (the replica axis carries the batch's mesh
    axes), and nothing else is split over those axes either (e.g. ``embed`` over fsdp when
    generating in a training layout: those axes are manual inside the replica)."""
    batch = set(_axes_of(dict(rules).get("batch")))
    return tuple(
        (name, None if name == "batch" else tuple(a for a in _axes_of(axes) if a not in batch) or None)
        for name, axes in rules
    )


def _replica_rollout(graphdef, static: Static, mesh: Mesh | None, rules: Rules, manual: bool, *args):
    """The replica(s) of one dp group: [1, ...] inputs -> [1, ...] outputs (`batcher.rollout`
    under the replica's rules; inside ``shard_map`` (``manual``), constraints and the kernels'
    own ``shard_map`` name the context's partly manual mesh)."""
    (
        state,
        ids,
        plen,
        limits,
        generated,
        stop_state,
        prompt_index,
        num_rows,
        rng,
        temperature,
        top_p,
        stop_tables,
        *resume,
    ) = args
    kv_axes = () if mesh is None else _axes_of(logical_to_spec(("kv_heads",), rules, mesh)[0])
    vocab_axes = () if mesh is None else _axes_of(logical_to_spec(("vocab",), _replica_rules(rules), mesh)[0])
    here = jax.sharding.get_abstract_mesh() if manual else mesh
    pool_layout = PoolLayout(
        static.kernel,
        kv_axes,
        here if kv_axes else None,
        interpret=static.kernel == "gpu" and _platform(mesh) != "gpu",
    )
    ctx = sharding_rules(_replica_rules(rules), here) if mesh is not None else contextlib.nullcontext()
    with ctx:
        model = nnx.merge(graphdef, state)
        model.model.unstack_layers()  # outside the decode loop
        out = rollout(
            model,
            ids[0],
            plen[0],
            limits[0],
            generated[0],
            stop_state[0],
            prompt_index[0],
            num_rows[0],
            rng,
            temperature,
            top_p,
            stop_tables,
            static,
            pool_layout,
            math.prod(mesh.shape[a] for a in vocab_axes) if mesh is not None else 1,
            resume[0] if resume else None,
        )
    pools = out.pop("pools", None)  # a session's (one replica): kept as they are
    out = jax.tree.map(lambda x: x[None], out)
    return out if pools is None else dict(out, pools=pools)


def _generate_program(*args, graphdef, static: Static, mesh: Mesh | None, rules: Rules):
    """The traced program over ``(state, ids_RxBxP, plen_RxB, limits_RxN, generated_RxN,
    stop_state_RxN, prompt_index_RxB, num_rows_R, rng, temperature, top_p, stop_tables)`` (and a session's `batcher.Resume`, one
    replica): every replica's `batcher.rollout`, each on its own dp group (``shard_map`` manual
    over the mesh's batch axes, the rest of the mesh left to the compiler). Not ``vmap``: a
    vmapped ``while_loop`` / ``cond`` becomes selects over the whole carry (the page pools
    copied every step, the prefill branch run every step). Returns rows flattened to
    [replicas * rows, ...]."""
    axes = () if mesh is None else _axes_of(_batch_spec(rules, mesh)[0])
    manual = bool(axes) and args[1].shape[0] > 1
    local = functools.partial(_replica_rollout, graphdef, static, mesh, rules, manual)
    if not manual:
        out = local(*args)
    else:
        rep, rows = PartitionSpec(), PartitionSpec(axes)
        out = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(rep, rows, rows, rows, rows, rows, rows, rows, rep, rep, rep, rep),
            out_specs=rows,
            axis_names=set(axes),
            check_vma=False,
        )(*args)
    flat = {
        k: v.reshape((-1,) + v.shape[2:])
        for k, v in out.items()
        if k in ("responses", "response_mask", "log_probs", "lengths", "logits", "prefill_tokens", "tables")
    }
    return dict(out, **flat, num_steps=jnp.max(out["num_steps"]))


STEPS_PER_SYNC = {"cpu": 1, "gpu": 8, "tpu": 8}


def default_steps_per_sync(platform: str) -> int:
    """Decode steps per trip of the rollout loop (`batcher.iteration`): on GPU and TPU the
    loop's predicate is read back by the host every trip, which drains the device's queue, so
    several steps go between reads; on CPU there is no queue to drain and a step past the end
    costs its full compute, so one."""
    return STEPS_PER_SYNC.get(platform, 8)


def _platform(mesh: Mesh | None) -> str:
    """The platform the program runs on (``cpu``, ``gpu``, ``tpu``)."""
    return (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform


def _axes_of(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


@functools.lru_cache(maxsize=64)
def _compiled_program(graphdef, static: Static, mesh: Mesh | None, rules: Rules):
    """One jitted program per (model structure, static settings, mesh, rules); jax caches its
    compilations per input shapes and shardings."""
    fn = functools.partial(_generate_program, graphdef=graphdef, static=static, mesh=mesh, rules=rules)
    if mesh is None:
        return ahead_of_time(jax.jit(fn))
    rows2 = NamedSharding(mesh, _batch_spec(rules, mesh, None))
    rows1 = NamedSharding(mesh, _batch_spec(rules, mesh))
    out_shardings: dict[str, Any] = dict(
        responses=rows2,
        response_mask=rows2,
        log_probs=rows2,
        lengths=rows1,
        num_steps=NamedSharding(mesh, PartitionSpec()),
        peak_pages=rows1,
        waits=rows1,
        prefill_tokens=rows1,
    )
    if static.return_logits:
        out_shardings["logits"] = NamedSharding(mesh, _batch_spec(rules, mesh, None, None))
    if static.return_cache:
        out_shardings["k_pages"] = out_shardings["v_pages"] = None
    return ahead_of_time(jax.jit(fn, out_shardings=out_shardings))


def left_pad(sequences: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Token-id sequences of any lengths as one left-padded batch: ``(ids [B, L], mask [B, L])``
    int32, ``L`` the longest (pad id 0; the mask is 1 on the real tokens)."""
    L = max(len(s) for s in sequences)
    ids = np.zeros((len(sequences), L), np.int32)
    mask = np.zeros_like(ids)
    for row, s in enumerate(sequences):
        ids[row, L - len(s) :] = s
        mask[row, L - len(s) :] = 1
    return ids, mask


def _stop_strings(
    params: SamplingParams, tokenizer: Any, stop_strings: StopStrings | None, vocab_size: int, caller: str
) -> StopStrings | None:
    """The stop-string tables of ``params.stop`` (built with ``tokenizer`` unless given), or
    ``stop_strings`` as given; ``caller`` names the entry point in the error for a missing
    tokenizer."""
    if not params.stop or stop_strings is not None:
        return stop_strings
    if tokenizer is None:
        raise ValueError(f"SamplingParams.stop needs a tokenizer ({caller}(..., tokenizer=...))")
    return StopStrings.build(params.stop, tokenizer, vocab_size)


def _left_padded_on_host(prompt_ids, prompt_mask) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(jax.device_get(prompt_ids))
    mask = np.asarray(jax.device_get(prompt_mask))
    if ids.ndim != 2 or ids.shape != mask.shape:
        raise ValueError(f"prompt_ids {ids.shape} and prompt_mask {mask.shape} must both be [B, L]")
    if ids.shape[0] == 0:
        raise ValueError("empty prompt batch")
    real = mask.astype(bool)
    if not real[:, -1].all():
        bad = np.flatnonzero(~real[:, -1])
        raise ValueError(
            f"prompts must be left-padded with at least one token: rows {bad[:8].tolist()} do not end with a real token"
        )
    if (np.diff(real.astype(np.int8), axis=1) < 0).any():
        raise ValueError("prompt_mask must be left padding followed by contiguous real tokens")
    longest = int(real.sum(axis=1).max())
    return ids[:, -longest:].astype(np.int32), real[:, -longest:].astype(np.int32)


def _batch_axis_size(rules: Rules, mesh: Mesh | None) -> int:
    if mesh is None:
        return 1
    spec = logical_to_spec(("batch",), rules, mesh)[0]
    axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
    return math.prod(mesh.shape[a] for a in axes)


@dataclasses.dataclass(frozen=True)
class _Call:
    """One call's program and its arguments, after host-side bucketing."""

    program: Any
    args: tuple
    rows: int  # B * n, the rows the caller asked for
    cols: int  # SamplingParams.max_new_tokens
    stats: dict
    options: EngineOptions
    prompts: int  # B


def _row_limits(params: SamplingParams, max_new_tokens, B: int) -> np.ndarray:
    """Each row's max_new_tokens [B * n] (a [B] array applies to every sample of a prompt)."""
    N = B * params.n
    if max_new_tokens is None:
        return np.full(N, params.max_new_tokens, np.int32)
    limits = np.asarray(max_new_tokens)
    if limits.ndim == 0:
        limits = np.full(N, int(limits))
    elif limits.shape == (B,) and params.n > 1:
        limits = np.repeat(limits, params.n)
    if limits.shape != (N,) or not np.issubdtype(limits.dtype, np.integer):
        raise ValueError(
            f"max_new_tokens must be an int or an integer array of {N} rows (or {B} prompts), "
            f"got {limits.dtype} {limits.shape}"
        )
    if (limits < 1).any():
        raise ValueError(f"max_new_tokens must be >= 1 for every row, got min {int(limits.min())}")
    if (limits > params.max_new_tokens).any():
        raise ValueError(
            f"per-row max_new_tokens must be <= SamplingParams.max_new_tokens "
            f"({params.max_new_tokens}), got max {int(limits.max())}"
        )
    return limits.astype(np.int32)


def _kernel(cfg: ModelConfig, mesh: Mesh | None, rules: Rules, attention: str | None) -> str:
    """The attention kernel: ``attention`` when given, else ``"ordered"`` for a
    ``batch_invariant`` model, else `paged.choose_kernel` for the platform (the pure-JAX attention when
    the mesh splits head_dim)."""
    platform = _platform(mesh)
    if attention is None and cfg.batch_invariant:
        return "ordered"  # the model's own order-stable attention: decode steps equal a forward bit for bit
    if attention is None:
        split = (
            mesh is not None
            and math.prod(mesh.shape[a] for a in _axes_of(logical_to_spec(("head_dim",), rules, mesh)[0])) > 1
        )
        return choose_kernel(cfg, platform, head_dim_split=split)
    if attention == "tpu" and platform != "tpu":
        raise ValueError(f"attention='tpu' (the ragged paged-attention kernel) runs on TPU only, not {platform}")
    return attention


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """How the engine runs a rollout; what a row samples depends on none of these.

    ``slots``: decode slots per replica (None: the replica's rows, at most `DEFAULT_SLOTS`);
    ``page_size``: tokens per KV page; ``kv_tokens``: the page pool's budget of cached tokens
    per replica (None: the default, `_default_kv_tokens`; too small a budget for one prompt
    group and one response is an error); ``attention``: ``"jax"``, ``"gpu"``, ``"tpu"`` or
    ``"ordered"`` (`paged.ordered_paged_attention`) (None: ``"ordered"`` for a
    ``batch_invariant`` model, else by platform, `paged.choose_kernel`; ``"gpu"`` off a GPU
    runs the kernel in interpret mode); ``pages_per_block``: KV pages the attention reads per
    block (the pure-JAX kernel's online-softmax blocks, the GPU kernel's compute blocks,
    `paged.gpu_partition`); ``steps_per_sync``: decode steps per trip of the rollout loop (None:
    `default_steps_per_sync` of the platform); ``return_logits`` / ``return_cache``: debug
    outputs (separate programs; for tests)."""

    slots: int | None = None
    page_size: int = DEFAULT_PAGE_SIZE
    kv_tokens: int | None = None
    attention: str | None = None
    pages_per_block: int = 8
    steps_per_sync: int | None = None
    return_logits: bool = False
    return_cache: bool = False

    def __post_init__(self):
        for name, least in (("slots", 1), ("kv_tokens", 1), ("steps_per_sync", 1), ("pages_per_block", 1)):
            value = getattr(self, name)
            if value is not None and value < least:
                raise ValueError(f"{name} must be >= {least} (or None: the default), got {value}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.attention is not None and self.attention not in KERNELS:
            raise ValueError(f"attention must be one of {KERNELS} (or None: by platform), got {self.attention!r}")


@dataclasses.dataclass(frozen=True)
class _Rows:
    """A call's rows after host-side bucketing: per replica, right-padded prompts
    ``ids_RxBxP`` (row i's tokens in columns [0, plen_i); bucket padding copies prompt 0),
    their lengths ``plen_RxB``, each row's limit ``limits_RxN`` (1 on padding), each prompt's
    id ``prompt_index_RxB`` (seeds its samples; padding: ids past the caller's) and the real
    rows ``num_rows_R``; ``prompts`` and ``prompt_len`` as the caller gave them. A resumed
    partial rollout's rows (n = 1) also carry their tokens sampled before the call
    ``generated_RxN`` and their stop-string states ``stop_state_RxN`` (else zeros)."""

    ids_RxBxP: np.ndarray
    plen_RxB: np.ndarray
    limits_RxN: np.ndarray
    generated_RxN: np.ndarray
    stop_state_RxN: np.ndarray
    prompt_index_RxB: np.ndarray
    num_rows_R: np.ndarray
    prompts: int
    prompt_len: int

    @property
    def replicas(self) -> int:
        return self.num_rows_R.shape[0]

    @property
    def arrays(self) -> list[np.ndarray]:
        return [
            self.ids_RxBxP,
            self.plen_RxB,
            self.limits_RxN,
            self.generated_RxN,
            self.stop_state_RxN,
            self.prompt_index_RxB,
            self.num_rows_R,
        ]


def _bucket_rows(
    ids: np.ndarray,
    mask: np.ndarray,
    limits: np.ndarray,
    n: int,
    pad: int,
    replicas: int,
    prompt_index: np.ndarray,
    resumed: tuple[np.ndarray, np.ndarray] | None = None,
) -> _Rows:
    """Left-padded prompts [B, L], row limits [B * n] and prompt ids [B] as `_Rows`: the prompt
    batch rounded to ``replicas * 2^k`` and the prompt length to a power of two
    (`bucket_size`); ``resumed``: the rows' (generated, stop_state) [B * n] (None: zeros)."""
    B, L = ids.shape
    Bb = bucket_size(B, multiple=replicas)
    P = bucket_size(L, minimum=PROMPT_BUCKET_MIN)
    plen = mask.sum(axis=1).astype(np.int32)
    right = np.full((Bb, P), pad, np.int32)
    for i in range(B):
        right[i, : plen[i]] = ids[i, L - plen[i] :]
    right[B:] = right[0]
    plen = np.concatenate([plen, np.full(Bb - B, plen[0], np.int32)])
    limits = np.concatenate([limits, np.ones((Bb - B) * n, np.int32)])
    generated, stop_state = resumed if resumed is not None else (np.zeros(B * n, np.int32),) * 2
    generated, stop_state = (np.concatenate([x, np.zeros((Bb - B) * n, np.int32)]) for x in (generated, stop_state))
    index = np.concatenate([prompt_index, int(prompt_index.max()) + 1 + np.arange(Bb - B)]).astype(np.int32)
    Br = Bb // replicas
    offsets = np.arange(replicas, dtype=np.int32) * Br * n
    return _Rows(
        ids_RxBxP=right.reshape(replicas, Br, P),
        plen_RxB=plen.reshape(replicas, Br),
        limits_RxN=limits.reshape(replicas, Br * n),
        generated_RxN=generated.reshape(replicas, Br * n).astype(np.int32),
        stop_state_RxN=stop_state.reshape(replicas, Br * n).astype(np.int32),
        prompt_index_RxB=index.reshape(replicas, Br),
        num_rows_R=np.clip(B * n - offsets, 0, Br * n).astype(np.int32),
        prompts=B,
        prompt_len=L,
    )


def _placed(arrays: list[np.ndarray], mesh: Mesh | None, rules: Rules, place: bool) -> list[Any]:
    """The arrays on the mesh with their replica axis over the batch axes; ``place=False``:
    shapes and shardings only (lowering)."""
    if mesh is None:
        return arrays
    shardings = [NamedSharding(mesh, _batch_spec(rules, mesh, *([None] * (x.ndim - 1)))) for x in arrays]
    if place:
        return [jax.device_put(x, s) for x, s in zip(arrays, shardings)]
    return [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in zip(arrays, shardings)]


def _stop_tables(params: SamplingParams, stop_strings: StopStrings | None, vocab_size: int) -> tuple:
    """The stop-string automaton's arrays (`stops.StopStrings`), or 1-entry placeholders."""
    if not params.stop:
        return (np.zeros(1, np.int32), np.zeros((1, 1), np.int32), np.zeros((1, 1), bool))
    if stop_strings is None or stop_strings.strings != params.stop:
        raise ValueError(
            f"SamplingParams.stop {params.stop!r} needs its tables: pass tokenizer=... (or "
            f"stop_strings=StopStrings.build(stop, tokenizer, vocab_size))"
        )
    if stop_strings.token_class_V.shape[0] != vocab_size:
        raise ValueError(
            f"stop_strings were built for {stop_strings.token_class_V.shape[0]} token ids, the model has {vocab_size}"
        )
    return (stop_strings.token_class_V, stop_strings.next_state_SxC, stop_strings.hit_SxC)


def _eos_ids(params: SamplingParams, cfg: ModelConfig) -> tuple[int, ...]:
    if params.eos_token_ids is not None:
        return tuple(params.eos_token_ids)
    if cfg.eos_token_id is None:
        return ()
    return tuple(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else (cfg.eos_token_id,)


def _call_shape(
    cfg: ModelConfig, rows: _Rows, params: SamplingParams, options: EngineOptions, kv_tokens: int | None = None
) -> EngineShape:
    """The `EngineShape` of a call's bucketed rows with a budget of ``kv_tokens``."""
    return engine_shape(
        cfg,
        rows.prompts,
        rows.prompt_len,
        params.max_new_tokens,
        n=params.n,
        replicas=rows.replicas,
        slots=options.slots,
        page_size=options.page_size,
        kv_tokens=kv_tokens,
    )


def _default_kv_tokens(cfg, rows: _Rows, params, eos, options: EngineOptions, mesh, rules) -> int | None:
    """The pool's budget when the caller gives none: rows that can only stop at their limits
    get the peak of their schedule (`_expected_kv_tokens`); others, on an accelerator, what
    its free memory holds (`memory_kv_tokens`; also when only lowering, so that a program
    compiled ahead is the one a call runs); else None (`batcher.pool_pages`' default)."""
    if not eos and not params.stop:
        return _expected_kv_tokens(cfg, rows, params, options)
    shape = _call_shape(cfg, rows, params, options)
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    return memory_kv_tokens(shape, _kv_shards(rules, mesh), devices)


def _resumed_rows(generated, ids, mask, limits_N, params: SamplingParams, stop_tables) -> tuple[np.ndarray, np.ndarray]:
    """The rows of a resumed partial rollout (n = 1): each one's tokens sampled before the call
    ``generated`` [B] (the last ``generated[i]`` tokens of prompt i; at least one prompt token
    before them, fewer than the row's limit) and its stop-string state after them (the
    automaton of `stops` run over them on the host; 0 without stop strings)."""
    generated_B = np.asarray(jax.device_get(generated))
    B = len(ids)
    if params.n != 1 or generated_B.shape != (B,) or not np.issubdtype(generated_B.dtype, np.integer):
        raise ValueError(
            f"generated must be {B} integers (one per prompt) with n = 1, got {generated_B.shape}, n={params.n}"
        )
    plen_B = mask.sum(axis=1)
    if (generated_B < 0).any() or (generated_B >= plen_B).any() or (generated_B >= limits_N).any():
        raise ValueError("generated must be >= 0, below each prompt's length and below each row's max_new_tokens")
    state_B = np.zeros(B, np.int32)
    for i in range(B if params.stop else 0):
        state_B[i], hit = scan_tokens(ids[i, ids.shape[1] - generated_B[i] :], stop_tables)
        if hit:
            raise ValueError(f"row {i}'s generated tokens already hold a stop string: it has finished")
    return generated_B.astype(np.int32), state_B


def _prompt_index(prompt_index, B: int, n: int) -> np.ndarray:
    """Each prompt's id ``[B]`` (default ``0 .. B - 1``): non-negative, distinct integers whose
    sample ids ``id * n + j`` (padding prompts' included) fit in int32."""
    if prompt_index is None:
        return np.arange(B, dtype=np.int32)
    index = np.asarray(jax.device_get(prompt_index))
    if index.shape != (B,) or not np.issubdtype(index.dtype, np.integer):
        raise ValueError(f"prompt_index must be {B} integers (one per prompt), got {index.dtype} {index.shape}")
    if index.min() < 0 or (int(index.max()) + B + 1) * n > np.iinfo(np.int32).max or len(np.unique(index)) != B:
        raise ValueError(f"prompt_index must be distinct non-negative int32 ids, got {index[:8].tolist()}...")
    return index.astype(np.int32)


def _prepare(
    graphdef,
    state,
    prompt_ids,
    prompt_mask,
    params: SamplingParams,
    *,
    mesh: Mesh | None = None,
    rules: Rules = GENERATE_RULES,
    rng: jax.Array | None = None,
    max_new_tokens=None,
    options: EngineOptions = EngineOptions(),
    tokenizer: Any = None,
    stop_strings: StopStrings | None = None,
    prompt_index=None,
    generated=None,
    place: bool = True,
) -> _Call:
    """The program and arguments of a `generate_from_state` call (``place=False``: abstract
    arguments, for lowering). The one declaration of the entry points' keywords;
    `generate_from_state` says what each does."""
    cfg = _config_of(graphdef, state)
    stop_strings = _stop_strings(params, tokenizer, stop_strings, cfg.vocab_size, "generate_from_state")
    ids, mask = _left_padded_on_host(prompt_ids, prompt_mask)
    prompt_index = _prompt_index(prompt_index, len(ids), params.n)
    pad = params.pad_token_id if params.pad_token_id is not None else (cfg.pad_token_id or 0)
    eos = _eos_ids(params, cfg)
    replicas = _batch_axis_size(rules, mesh)
    limits = _row_limits(params, max_new_tokens, len(ids))
    stop_tables = _stop_tables(params, stop_strings, cfg.vocab_size)
    resumed = None if generated is None else _resumed_rows(generated, ids, mask, limits, params, stop_tables)
    rows = _bucket_rows(ids, mask, limits, params.n, pad, replicas, prompt_index, resumed)
    if rng is None:
        rng = jax.random.key(params.seed) if place else jax.eval_shape(jax.random.key, params.seed)
    elif not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        rng = jax.random.wrap_key_data(rng)
    kv_tokens = options.kv_tokens or _default_kv_tokens(cfg, rows, params, eos, options, mesh, rules)
    shape = _call_shape(cfg, rows, params, options, kv_tokens)
    static = static_settings(cfg, params, shape, options, eos, int(pad), mesh, rules)
    program = _compiled_program(graphdef, static, mesh, tuple(rules))
    arrays = _placed(rows.arrays, mesh, rules, place)
    args = (state, *arrays, rng, np.float32(params.temperature), np.float32(params.top_p), stop_tables)
    stats = engine_stats(static, replicas, shape.pages) | dict(
        pad_token_id=int(pad), kv_pool_bytes=replicas * shape.pool_bytes, page_bytes=shape.pool_bytes // shape.pages
    )
    return _Call(program, args, len(ids) * params.n, params.max_new_tokens, stats, options, len(ids))


def engine_stats(static: Static, replicas: int, pages_per_replica: int) -> dict[str, Any]:
    """The engine's shape as `GenerateOutput.stats` reports it: ``replicas``, ``slots``,
    ``page_size``, ``attention`` (the kernel), ``steps_per_sync``, ``pages_per_replica``."""
    return dict(
        replicas=replicas,
        slots=static.slots,
        page_size=static.page_size,
        attention=static.kernel,
        steps_per_sync=static.steps_per_sync,
        pages_per_replica=pages_per_replica,
    )


def static_settings(
    cfg: ModelConfig,
    params: SamplingParams,
    shape: EngineShape,
    options: EngineOptions,
    eos: tuple[int, ...],
    pad: int,
    mesh: Mesh | None,
    rules: Rules,
) -> Static:
    """The `batcher.Static` of a call of this `EngineShape` (what shapes its program besides
    the arrays)."""
    return Static(
        greedy=params.greedy,
        top_k=0 if params.greedy or params.top_k >= cfg.vocab_size else params.top_k,
        use_top_p=not params.greedy and params.top_p < 1.0,
        n=params.n,
        eos_token_ids=eos,
        pad_token_id=pad,
        response_len=shape.response_len,
        slots=shape.slots,
        page_size=options.page_size,
        num_pages=shape.pages,
        prefill_rows=shape.prefill_rows,
        prefill_len=shape.prefill_len,
        return_logits=options.return_logits,
        return_cache=options.return_cache,
        use_stops=bool(params.stop),
        kernel=_kernel(cfg, mesh, rules, options.attention),
        pages_per_block=options.pages_per_block,
        steps_per_sync=options.steps_per_sync or default_steps_per_sync(_platform(mesh)),
    )


KV_MEMORY_FRACTION = 0.5  # of the free device memory, for the default pool on an accelerator


def memory_kv_tokens(shape: EngineShape, kv_shards: int, devices) -> int | None:
    """The default budget of a rollout whose rows may stop early, on a device that reports its
    memory (GPU, TPU): the worst-case pool (no row ever waits) when it fits in
    `KV_MEMORY_FRACTION` of the free memory of the emptiest device, else the largest power of
    two pages that does (stable across calls, so the program is reused), if that beats the
    token-budget default. None (the default of `batcher.pool_pages`) on CPU, whose devices
    report no memory, where the fraction holds less, and in a multi-process world (each
    process reads only its own devices' memory, and all must compile the same pool).
    ``kv_shards``: the devices one replica's pool is split over (its kv heads)."""
    if jax.process_count() > 1:  # each process sees only its own devices' memory; every one must pick the same pool
        return None
    stats = [d.memory_stats() for d in devices]
    if not stats or any(not s or "bytes_limit" not in s for s in stats):
        return None
    free = min(s["bytes_limit"] - s["bytes_in_use"] for s in stats)
    page_bytes = shape.pool_bytes / shape.pages / kv_shards
    fit = int(KV_MEMORY_FRACTION * free // page_bytes)
    if fit >= shape.worst_case_pages:
        return (shape.worst_case_pages - 1) * shape.page_size
    pages = 1 << (fit.bit_length() - 1) if fit > 0 else 0
    return (pages - 1) * shape.page_size if pages > shape.pages else None


def _kv_shards(rules: Rules, mesh: Mesh | None) -> int:
    """The devices the kv heads of one replica are split over."""
    if mesh is None:
        return 1
    return math.prod(mesh.shape[a] for a in _axes_of(logical_to_spec(("kv_heads",), rules, mesh)[0]))


def _expected_kv_tokens(cfg, rows: _Rows, params: SamplingParams, options: EngineOptions) -> int:
    """The budget of a rollout whose rows can only stop at their limits (no EOS, no stop
    strings): every token is known, so the pool is the peak of the schedule in which no row
    waits (`batcher.no_wait_peak_pages`) plus the priority reserve Rp, rounded up to a power
    of two pages (calls with other limits mostly reuse the program)."""
    shape, page_size = _call_shape(cfg, rows, params, options), options.page_size
    runs_RxN = rows.limits_RxN - rows.generated_RxN  # the tokens each row samples in this call
    peak = max(
        no_wait_peak_pages(plen, runs[:real], params.n, shape.slots, shape.prefill_rows, page_size)
        for plen, runs, real in zip(rows.plen_RxB, runs_RxN, rows.num_rows_R)
        if real > 0
    )
    least, _ = pool_bounds(
        shape.prompts, shape.prompt_len, shape.response_len, shape.slots, shape.prefill_rows, page_size
    )
    pages = bucket_size(max(1 + peak + reserve_pages(shape.response_len, page_size), least))
    return (pages - 1) * page_size


@dataclasses.dataclass(frozen=True)
class EngineShape:
    """What one generate call allocates per replica (analytic, from the engine's buckets):
    ``prompts`` and ``rows`` per replica, ``slots``, the prompt / response buckets, the
    prefill chunk (``prefill_rows`` x ``prefill_len``), ``pages`` in the pool (trash page
    included, `batcher.pool_pages`), ``worst_case_pages`` (the pool in which no row ever
    waits) and ``pool_bytes`` (keys and values of ``pages``, all kv heads, ``dtype`` of the
    cache)."""

    prompts: int
    rows: int
    slots: int
    prompt_len: int
    response_len: int
    prefill_rows: int
    prefill_len: int
    page_size: int
    pages: int
    worst_case_pages: int
    pool_bytes: int


def engine_shape(
    cfg: ModelConfig,
    prompts: int,
    prompt_len: int,
    max_new_tokens: int,
    *,
    n: int = 1,
    replicas: int = 1,
    slots: int | None = None,
    page_size: int = DEFAULT_PAGE_SIZE,
    kv_tokens: int | None = None,
) -> EngineShape:
    """The `EngineShape` of a call with ``prompts`` prompts of at most ``prompt_len`` tokens
    over ``replicas`` generation replicas with a budget of ``kv_tokens`` cached tokens per
    replica (None: the default; what `_prepare` does, without arrays)."""
    Br = bucket_size(prompts, multiple=replicas) // replicas
    P = bucket_size(prompt_len, minimum=PROMPT_BUCKET_MIN)
    R = bucket_size(max_new_tokens, minimum=RESPONSE_BUCKET_MIN)
    S = min(slots or DEFAULT_SLOTS, Br * n)
    T = page_size
    Gr = min(Br, PREFILL_ROWS)
    pages = pool_pages(Br, P, R, S, Gr, T, kv_tokens)
    page_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * T * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
    return EngineShape(
        prompts=Br,
        rows=Br * n,
        slots=S,
        prompt_len=P,
        response_len=R,
        prefill_rows=Gr,
        prefill_len=min(P, PREFILL_LEN),
        page_size=T,
        pages=pages,
        worst_case_pages=pool_bounds(Br, P, R, S, Gr, T)[1],
        pool_bytes=pages * page_bytes,
    )


def generate_from_state(
    graphdef: nnx.GraphDef, state: nnx.State, prompt_ids, prompt_mask, params: SamplingParams, **kwargs
) -> GenerateOutput:
    """Sample ``params.n`` responses for each of the B left-padded prompts.

    The keywords ``mesh``, ``rules``, ``rng``, ``max_new_tokens``, ``options``, ``tokenizer``,
    ``stop_strings`` and ``prompt_index`` are declared (types, defaults) once, on `_prepare`,
    which `lower_generate` shares; an unknown one raises ``TypeError``.
    ``graphdef``/``state`` are ``nnx.split`` of a `CausalLM` (``state`` in any layout, e.g.
    the generation layout of the hybrid engine). ``prompt_ids``/``prompt_mask`` are [B, L]
    (NumPy or jax; every row ends with a real token). ``max_new_tokens`` (an int or an
    integer array [B * n] or [B], each <= ``params.max_new_tokens``) limits each row.
    ``options``: how the engine runs (`EngineOptions`: slots, pages, the KV budget, the
    attention kernel, debug outputs). ``params.stop`` needs ``tokenizer`` (anything with
    ``decode(ids)``), or its prebuilt ``stop_strings`` (`StopStrings.build`). With ``mesh``,
    prompts, slots and pages are split over the ``batch`` axes of ``rules``. The compiled
    program is cached per (graphdef, static settings, mesh, rules, bucket shapes), so
    repeated calls compile nothing. ``rng`` (a PRNG key) overrides ``params.seed``.
    ``prompt_index`` ([B] distinct non-negative ids; default ``0 .. B - 1``): sample ``j`` of
    prompt ``i`` draws its token ``t`` with ``fold_in(fold_in(rng, prompt_index[i] * n + j), t)``
    (`batcher.row_keys`), whatever the mesh, the replicas, the slots or the page pool, and as
    if each prompt were repeated ``n`` times with ``n = 1``. ``generated`` ([B], n = 1; a resumed
    partial rollout, `jaxflow.sampling.partial`): the last ``generated[i]`` tokens of prompt
    ``i`` are its response so far; its row goes on from token ``generated[i]`` (its keys,
    limit and stop strings as if never interrupted), writes columns from ``generated[i]`` on
    (the earlier ones hold the pad id) and reports ``lengths`` counting them.
    """
    call = _prepare(graphdef, state, prompt_ids, prompt_mask, params, **kwargs)
    out = call.program(*call.args)
    rows, cols = call.rows, call.cols

    def cut(x):  # bucket -> the caller's shape (no op when the bucket fits exactly)
        return x if x.shape[:2] == (rows, cols) else x[:rows, :cols]

    peak = out["peak_pages"]
    return GenerateOutput(
        responses=cut(out["responses"]),
        response_mask=cut(out["response_mask"]),
        log_probs=cut(out["log_probs"]),
        lengths=out["lengths"] if out["lengths"].shape[0] == rows else out["lengths"][:rows],
        num_steps=out["num_steps"],
        stats=dict(
            call.stats,
            peak_pages=peak,
            peak_kv_bytes=jnp.sum(peak) * call.stats["page_bytes"],
            waits=out["waits"],
            prefill_tokens=out["prefill_tokens"][: call.prompts],
        ),
        logits=cut(out["logits"]) if call.options.return_logits else None,
        cache=(out["k_pages"], out["v_pages"]) if call.options.return_cache else None,
    )


def lower_generate(
    graphdef: nnx.GraphDef, state: nnx.State, prompt_ids, prompt_mask, params: SamplingParams, **kwargs
) -> jax.stages.Lowered:
    """The program `generate_from_state` runs for these arguments (the same ones; ``rng`` and
    ``tokenizer`` may be left out), lowered but not run: a ``jax.stages.Lowered`` whose
    ``.compile()`` gives its HLO (``as_text()``), ``memory_analysis()`` and
    ``cost_analysis()``. ``state`` may be abstract (``jax.ShapeDtypeStruct`` leaves carrying
    shardings); the prompts only need the intended shapes (e.g. ones)."""
    call = _prepare(graphdef, state, prompt_ids, prompt_mask, params, place=False, **kwargs)
    return call.program.lower(*call.args)


_CONFIGS: dict[Any, ModelConfig] = {}


def _config_of(graphdef: nnx.GraphDef, state: nnx.State) -> ModelConfig:
    """The model config (a static attribute of the graph), memoised per graphdef."""
    if graphdef not in _CONFIGS:
        _CONFIGS[graphdef] = nnx.merge(graphdef, state).cfg
    return _CONFIGS[graphdef]


def generate(model: nnx.Module, prompt_ids, prompt_mask, params: SamplingParams, **kwargs) -> GenerateOutput:
    """`generate_from_state` for a `CausalLM` (e.g. what ``jaxflow.models.from_pretrained``
    returns); ``kwargs`` as there (``mesh``, ``rules``, ``rng``, ``max_new_tokens``,
    ``options``, ``tokenizer``, ...)."""
    graphdef, state = nnx.split(model)
    return generate_from_state(graphdef, state, prompt_ids, prompt_mask, params, **kwargs)
