"""The rollout engine: prefill, then a KV-cached decode loop inside one compiled program.

``generate_from_state(graphdef, state, prompt_ids, prompt_mask, params, mesh=..., rules=...)``
runs one jit-compiled program per shape bucket:

1. **Prefill.** The B left-padded prompts [B, P] go through the decoder once, filling slots
   [0, P) of a KV cache of S = P + R slots; the LM head runs on the last column only (the
   last prompt token of every row, since prompts are left-padded). With ``n > 1`` the cache
   and the first logits are then repeated per prompt (interleaved: rows
   ``[p0s0, p0s1, ..., p1s0, ...]``, verl's ``repeat(interleave=True)``), so a prompt is
   prefilled once whatever ``n`` is.
2. **Decode.** A ``lax.while_loop`` samples token j from the current logits, feeds it back at
   cache slot P + j - 1 (position = real prompt length + j - 1), and stops as soon as every
   row has finished or ``max_new_tokens`` tokens were produced. No host round trip happens
   inside the loop.

Stopping. A row finishes on any of ``eos_token_ids`` (the EOS token is part of the response
and is masked in, as in verl) or at ``max_new_tokens``; later positions hold the pad id
(``cfg.pad_token_id`` or 0) with mask 0 and log-prob 0.

Buckets. Shapes are rounded up so that the calls of a training run reuse a few compiled
programs: the prompt batch to ``dp * 2^k`` rows (extra rows copy row 0, start finished and
are dropped), the prompt length (after dropping columns that are padding in every row) to a
power of two >= 16 (more left padding), and the response buffer R to a power of two >= 16.
``max_new_tokens`` itself, the temperature, top-p, the true batch size and the PRNG key are
runtime values of the program, so any ``max_new_tokens`` up to R reuses it. The arrays
returned to the caller are cut back to [B * n, max_new_tokens].

Sharding. With a ``mesh``, ``rules`` (default `GENERATE_RULES`) place the prompt batch on the
``batch`` axes (dp) and constrain the KV cache by `KVCache.K_AXES` / `V_AXES` (batch over dp,
kv-heads over tp) and activations through the model's own constraints. Parameters stay in
whatever layout the caller gives them (e.g. resharded from training).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxflow.mesh import GENERATE_RULES, Rules, constrain, logical_to_spec, sharding_rules
from jaxflow.models import KVCache, ModelConfig, positions_from_mask
from jaxflow.sampling.logits_processing import sample_tokens, token_log_probs

PROMPT_BUCKET_MIN = 16
RESPONSE_BUCKET_MIN = 16


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


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """A rollout of ``B * n`` rows (row ``i * n + s`` is sample s of prompt i).

    ``responses`` int32 [B*n, max_new_tokens], right-padded with the pad id;
    ``response_mask`` int32 (1 on generated tokens, EOS included); ``log_probs`` float32,
    ``log_softmax(logits / T)`` of each sampled token (0 on padding); ``lengths`` int32
    [B*n]; ``num_steps`` (int32 scalar): token positions the program produced (the prefill's
    token plus one per decode iteration), i.e. ``max(lengths)`` whenever the loop stopped
    early. ``logits`` (raw model logits [B*n, max_new_tokens, V] used at each step) and
    ``cache`` (the final `KVCache`, bucket-sized) are debug outputs, None unless requested.
    """

    responses: jax.Array
    response_mask: jax.Array
    log_probs: jax.Array
    lengths: jax.Array
    num_steps: jax.Array
    logits: jax.Array | None = None
    cache: KVCache | None = None


def bucket_size(size: int, multiple: int = 1, minimum: int = 1) -> int:
    """The smallest ``multiple * 2^k`` that is >= ``max(size, minimum)``."""
    target = max(size, minimum, 1)
    return multiple * (1 << max(0, math.ceil(math.log2(target / multiple)))) if target > multiple else multiple


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything that shapes the compiled program besides array shapes."""

    greedy: bool
    top_k: int
    use_top_p: bool
    n: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    response_len: int
    return_logits: bool
    return_cache: bool


# Counts traces of the generation program (a Python side effect at trace time); tests use it
# to check that repeated calls compile nothing.
_TRACE_COUNT = 0


def trace_count() -> int:
    """How many times the generation program has been traced in this process."""
    return _TRACE_COUNT


def _batch_spec(rules: Rules, mesh: Mesh | None, *names: str | None) -> PartitionSpec:
    return logical_to_spec(("batch",) + names, rules, mesh)


def _constrain_cache(cache: KVCache) -> KVCache:
    """Pin the cache by its logical axes (stacked or per layer); a no-op without a mesh."""
    return KVCache(jax.tree.map(lambda x: constrain(x, KVCache.K_AXES[-x.ndim:]), cache.k),
                   jax.tree.map(lambda x: constrain(x, KVCache.V_AXES[-x.ndim:]), cache.v))


def _generate_program(graphdef, state, prompt_ids_BxP, prompt_mask_BxP, rng, temperature, top_p,
                      max_new_tokens, num_rows, *, static: _Static, mesh: Mesh | None, rules: Rules):
    """The traced program: prefill + while-loop decode. Returns a dict of bucket-sized arrays."""
    global _TRACE_COUNT
    _TRACE_COUNT += 1
    ctx = sharding_rules(rules, mesh) if mesh is not None else contextlib.nullcontext()
    with ctx:  # the model's and our `constrain` calls pin activations to the mesh
        return _prefill_and_decode(nnx.merge(graphdef, state), prompt_ids_BxP, prompt_mask_BxP, rng,
                                   temperature, top_p, max_new_tokens, num_rows, static)


def _prefill_and_decode(model, prompt_ids_BxP, prompt_mask_BxP, rng, temperature, top_p, max_new_tokens,
                        num_rows, static: _Static):
    cfg: ModelConfig = model.cfg
    B, P = prompt_ids_BxP.shape
    n, R = static.n, static.response_len
    S, N = P + R, B * static.n
    pad = static.pad_token_id

    def rows(x):  # batch-major arrays: rows over the data-parallel axes
        return constrain(x, ("batch",) + (None,) * (x.ndim - 1))

    temperature = jnp.float32(1.0) if static.greedy else temperature
    eos = jnp.asarray(static.eos_token_ids or (-1,), jnp.int32)

    def is_eos(tok_N):
        return jnp.any(tok_N[:, None] == eos[None, :], axis=-1)

    row_ids = rows(jnp.arange(N, dtype=jnp.int32))
    row_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(rng, row_ids)

    def sample(step, logits_NxV):
        keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys, step)
        tok = sample_tokens(keys, logits_NxV, greedy=static.greedy, temperature=temperature,
                            top_k=static.top_k, top_p=top_p, use_top_p=static.use_top_p)
        return tok, token_log_probs(logits_NxV, tok, temperature)

    # --- prefill: B prompts once, then repeat per sample ---------------------------------
    # Unrolled layers keep one cache buffer per layer, updated in place by the loop below.
    cache = KVCache.zeros(cfg, B, S)
    cache = _constrain_cache(cache if cfg.scan_layers else cache.split_layers())
    prompt_mask_BxP = prompt_mask_BxP.astype(jnp.int32)
    kv_mask_BxS = jnp.concatenate([prompt_mask_BxP, jnp.zeros((B, R), jnp.int32)], axis=1)
    hidden_BxPxD, cache = model.model(prompt_ids_BxP, positions_BxL=positions_from_mask(prompt_mask_BxP),
                                      cache=cache, cache_index=0, kv_mask_BxS=kv_mask_BxS)
    logits_NxV = model.logits(hidden_BxPxD[:, -1:])[:, 0]  # the last column: every row's last token
    prompt_len_N = jnp.sum(prompt_mask_BxP, axis=1)
    if n > 1:
        batch_axis = 1 if cfg.scan_layers else 0  # of the cache arrays
        rep = functools.partial(jnp.repeat, repeats=n, total_repeat_length=N)
        cache = jax.tree.map(lambda x: rep(x, axis=batch_axis), cache)
        kv_mask_BxS, logits_NxV, prompt_len_N = (rep(x, axis=0) for x in (kv_mask_BxS, logits_NxV, prompt_len_N))
    cache = _constrain_cache(cache)
    kv_mask_NxS, logits_NxV, prompt_len_N = rows(kv_mask_BxS), rows(logits_NxV), rows(prompt_len_N)

    # --- first token, from the prefill's logits ------------------------------------------
    tok, logp = sample(0, logits_NxV)
    finished = row_ids >= num_rows  # bucket padding rows start finished
    tok = jnp.where(finished, pad, tok)
    logp = jnp.where(finished, 0.0, logp)
    lengths_N = (~finished).astype(jnp.int32)
    finished = finished | is_eos(tok)
    carry = dict(step=jnp.int32(1), finished=finished, lengths=lengths_N, cache=cache, kv_mask=kv_mask_NxS,
                 tokens=rows(jnp.full((N, R), pad, jnp.int32).at[:, 0].set(tok)),
                 logps=rows(jnp.zeros((N, R), jnp.float32).at[:, 0].set(logp)))
    if static.return_logits:
        carry["logits"] = rows(jnp.zeros((N, R) + logits_NxV.shape[-1:], jnp.float32).at[:, 0].set(logits_NxV))

    # --- decode: token j-1 goes in at slot P + j - 1, token j comes out ---------------------
    def cond(c):
        return (c["step"] < max_new_tokens) & ~jnp.all(c["finished"])

    def body(c):
        j = c["step"]
        slot = P + j - 1
        prev_N = jax.lax.dynamic_index_in_dim(c["tokens"], j - 1, axis=1, keepdims=False)
        kv_mask = jax.lax.dynamic_update_index_in_dim(c["kv_mask"], jnp.ones((N,), jnp.int32), slot, axis=1)
        positions_Nx1 = (prompt_len_N + j - 1)[:, None]
        logits_Nx1xV, cache = model.forward_with_cache(prev_N[:, None], positions_Nx1, kv_mask, c["cache"], slot)
        logits = logits_Nx1xV[:, 0]
        tok, logp = sample(j, logits)
        active = ~c["finished"]
        tok = jnp.where(active, tok, pad)
        logp = jnp.where(active, logp, 0.0)
        out = dict(
            step=j + 1,
            finished=c["finished"] | is_eos(tok),
            lengths=c["lengths"] + active.astype(jnp.int32),
            cache=_constrain_cache(cache),
            kv_mask=rows(kv_mask),
            tokens=rows(jax.lax.dynamic_update_index_in_dim(c["tokens"], tok, j, axis=1)),
            logps=rows(jax.lax.dynamic_update_index_in_dim(c["logps"], logp, j, axis=1)),
        )
        if static.return_logits:
            out["logits"] = rows(jax.lax.dynamic_update_index_in_dim(c["logits"], logits, j, axis=1))
        return out

    c = jax.lax.while_loop(cond, body, carry)
    response_mask = (jnp.arange(R)[None, :] < c["lengths"][:, None]).astype(jnp.int32)
    out = dict(responses=c["tokens"], response_mask=rows(response_mask), log_probs=c["logps"],
               lengths=c["lengths"], num_steps=c["step"])
    if static.return_logits:
        out["logits"] = c["logits"]
    if static.return_cache:
        out["cache"] = _constrain_cache(c["cache"].stack_layers())
    return out


@functools.lru_cache(maxsize=64)
def _compiled_program(graphdef, static: _Static, mesh: Mesh | None, rules: Rules):
    """One jitted program per (model structure, static sampling settings, mesh, rules); jax
    caches its compilations per input shapes and shardings."""
    fn = functools.partial(_generate_program, graphdef, static=static, mesh=mesh, rules=rules)
    if mesh is None:
        return jax.jit(fn)
    rows2 = NamedSharding(mesh, _batch_spec(rules, mesh, None))
    rows1 = NamedSharding(mesh, _batch_spec(rules, mesh))
    out_shardings: dict[str, Any] = dict(responses=rows2, response_mask=rows2, log_probs=rows2, lengths=rows1,
                                         num_steps=NamedSharding(mesh, PartitionSpec()))
    if static.return_logits:
        out_shardings["logits"] = NamedSharding(mesh, _batch_spec(rules, mesh, None, None))
    if static.return_cache:
        out_shardings["cache"] = None  # whatever the program's own constraints produced
    return jax.jit(fn, out_shardings=out_shardings)


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
        raise ValueError(f"prompts must be left-padded with at least one token: rows {bad[:8].tolist()} "
                         "do not end with a real token")
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
    cols: int  # max_new_tokens


def _prepare(graphdef, state, prompt_ids, prompt_mask, params: SamplingParams, mesh, rules, rng,
             return_logits: bool, return_cache: bool, place: bool = True) -> _Call:
    cfg = _config_of(graphdef, state)
    ids, mask = _left_padded_on_host(prompt_ids, prompt_mask)
    B, L = ids.shape
    pad = params.pad_token_id if params.pad_token_id is not None else (cfg.pad_token_id or 0)
    eos = params.eos_token_ids
    if eos is None:
        eos = () if cfg.eos_token_id is None else (
            tuple(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else (cfg.eos_token_id,))

    Bb = bucket_size(B, multiple=_batch_axis_size(rules, mesh))
    P = bucket_size(L, minimum=PROMPT_BUCKET_MIN)
    R = bucket_size(params.max_new_tokens, minimum=RESPONSE_BUCKET_MIN)
    ids = np.concatenate([np.full((B, P - L), pad, np.int32), ids], axis=1)
    mask = np.concatenate([np.zeros((B, P - L), np.int32), mask], axis=1)
    if Bb > B:  # extra rows copy row 0; they start finished and are dropped
        ids = np.concatenate([ids, np.repeat(ids[:1], Bb - B, axis=0)])
        mask = np.concatenate([mask, np.repeat(mask[:1], Bb - B, axis=0)])
    if mesh is not None:
        prompt_sharding = NamedSharding(mesh, _batch_spec(rules, mesh, "length"))
        if place:
            ids, mask = jax.device_put(ids, prompt_sharding), jax.device_put(mask, prompt_sharding)
        else:  # lowering only: shapes and shardings, no device buffers
            ids, mask = (jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=prompt_sharding) for x in (ids, mask))

    if rng is None:
        rng = jax.random.key(params.seed) if place else jax.eval_shape(jax.random.key, params.seed)
    elif not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        rng = jax.random.wrap_key_data(rng)
    static = _Static(
        greedy=params.greedy,
        top_k=0 if params.greedy or params.top_k >= cfg.vocab_size else params.top_k,
        use_top_p=not params.greedy and params.top_p < 1.0,
        n=params.n,
        eos_token_ids=tuple(eos),
        pad_token_id=int(pad),
        response_len=R,
        return_logits=return_logits,
        return_cache=return_cache,
    )
    program = _compiled_program(graphdef, static, mesh, tuple(rules))
    args = (state, ids, mask, rng, np.float32(params.temperature), np.float32(params.top_p),
            np.int32(params.max_new_tokens), np.int32(B * params.n))
    return _Call(program, args, B * params.n, params.max_new_tokens)


def generate_from_state(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    prompt_ids,
    prompt_mask,
    params: SamplingParams,
    *,
    mesh: Mesh | None = None,
    rules: Rules = GENERATE_RULES,
    rng: jax.Array | None = None,
    return_logits: bool = False,
    return_cache: bool = False,
) -> GenerateOutput:
    """Sample ``params.n`` responses for each of the B left-padded prompts.

    ``graphdef``/``state`` are ``nnx.split`` of a `CausalLM` (``state`` in any layout, e.g.
    the generation layout of the hybrid engine). ``prompt_ids``/``prompt_mask`` are [B, L]
    (NumPy or jax; every row ends with a real token). With ``mesh``, the prompt batch and
    the KV cache are sharded by ``rules``; the compiled program is cached per (graphdef,
    static sampling settings, mesh, rules, bucket shapes), so repeated calls compile
    nothing. ``rng`` (a PRNG key) overrides ``params.seed``. ``return_logits`` /
    ``return_cache`` add debug outputs (separate programs; for tests).
    """
    call = _prepare(graphdef, state, prompt_ids, prompt_mask, params, mesh, rules, rng, return_logits,
                    return_cache)
    out = call.program(*call.args)
    rows, cols = call.rows, call.cols

    def cut(x):  # bucket -> the caller's shape (no op when the bucket fits exactly)
        return x if x.shape[:2] == (rows, cols) else x[:rows, :cols]

    return GenerateOutput(
        responses=cut(out["responses"]),
        response_mask=cut(out["response_mask"]),
        log_probs=cut(out["log_probs"]),
        lengths=out["lengths"] if out["lengths"].shape[0] == rows else out["lengths"][:rows],
        num_steps=out["num_steps"],
        logits=cut(out["logits"]) if return_logits else None,
        cache=out.get("cache"),
    )


def lower_generate(graphdef: nnx.GraphDef, state: nnx.State, prompt_ids, prompt_mask, params: SamplingParams,
                   *, mesh: Mesh | None = None, rules: Rules = GENERATE_RULES, return_logits: bool = False,
                   return_cache: bool = False) -> jax.stages.Lowered:
    """The program `generate_from_state` runs for these arguments, lowered but not run:
    ``.compile()`` gives its HLO (``as_text()``), ``memory_analysis()`` and
    ``cost_analysis()``. ``state`` may be abstract (``jax.ShapeDtypeStruct`` leaves carrying
    shardings); the prompts only need the intended shapes (e.g. ones)."""
    call = _prepare(graphdef, state, prompt_ids, prompt_mask, params, mesh, rules, None, return_logits,
                    return_cache, place=False)
    return call.program.lower(*call.args)


_CONFIGS: dict[Any, ModelConfig] = {}


def _config_of(graphdef: nnx.GraphDef, state: nnx.State) -> ModelConfig:
    """The model config (a static attribute of the graph), memoised per graphdef."""
    if graphdef not in _CONFIGS:
        _CONFIGS[graphdef] = nnx.merge(graphdef, state).cfg
    return _CONFIGS[graphdef]


def generate(model: nnx.Module, prompt_ids, prompt_mask, params: SamplingParams, *,
             mesh: Mesh | None = None, rules: Rules = GENERATE_RULES, rng: jax.Array | None = None,
             **debug: bool) -> GenerateOutput:
    """`generate_from_state` for a `CausalLM` (e.g. what ``jaxflow.models.from_pretrained``
    returns)."""
    graphdef, state = nnx.split(model)
    return generate_from_state(graphdef, state, prompt_ids, prompt_mask, params, mesh=mesh, rules=rules,
                               rng=rng, **debug)


__all__ = [
    "GenerateOutput",
    "SamplingParams",
    "bucket_size",
    "generate",
    "generate_from_state",
    "lower_generate",
    "trace_count",
]
