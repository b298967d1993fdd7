"""Analytic simulators of each stage's time (HybridFlow §6's simulators, in jaxflow's axes).

Every number here is an analytic model's, from the device profile
(:mod:`jaxflow.automap.profiles`), the model's shapes and the layout; none is measured.

Symbols: ``B`` body parameters (the decoder, used once per token), ``Hd`` head parameters
(the LM head ``V D``, tied or not; a value / reward head ``D``), ``W`` all parameter bytes,
``Wm = (B + Hd) p`` the bytes a forward multiplies with (not the embedding table, whose rows
are only looked up), ``L`` layers, ``D`` width, ``F`` MLP width, ``H`` / ``N`` query / kv
heads of ``K`` dims, ``P`` / ``R`` prompt / response tokens, ``T = P + R``, ``c`` compute
bytes, ``p`` parameter bytes; a layout ``(dp, fsdp, tp)`` on ``n`` devices, the weights'
Megatron dimension split ``nw`` ways (``fsdp tp`` under the hybrid rules, ``tp`` under the
``*_embed`` ones), the actor's generation tp ``g`` and ``m = nw / g``.

**A pass** (one forward over ``b`` rows per device): FLOPs ``(2 B b T + 4 L H K b T(T+1)/2 +
2 Hd h) / tp`` (attention counted causally: query ``i`` attends to ``i + 1`` keys; ``h`` the
positions the head runs on: ``b R`` for the LM head, which only scores the responses, ``b T``
for a value head); HBM bytes ``Wm / tp`` (the weights read once) plus the activations, each
written and read once: ``2 c b T L (4 D + (3 F + 2 H K + 2 N K) / tp)``. Its time is the
roofline's ``max(FLOPs / (peak mfu), bytes / (bw hbm_eff))`` plus ``L (16 kernels) + 4``
kernels' fixed cost (a layer's forward: 7 projection matmuls, 2 attention products, ~7
fusions for norms, RoPE, softmax, SwiGLU and residuals; the head and its loss: 4), so a
small per-device batch is memory- or launch-bound, far below ``mfu``.

- **train** (per micro-batch; ``k`` per mini-batch, ``epochs x mini-batches`` optimizer
  steps): forward + backward (2 passes' FLOPs, the weights read and their gradients
  written) + a remat forward, i.e. ``3 + r`` passes (``r = 1`` under remat); tensor-parallel
  all-reduces of ``b T D c`` (2 per layer per forward, 2 per backward); FSDP all-gathers of
  the weights over ``fsdp`` (``2 + r``, each gathering ``W / tp``), a reduce-scatter of the
  gradients over ``fsdp`` and their all-reduce over ``dp`` (``W / (fsdp tp)``: jaxflow's step
  constrains each micro-batch's gradients to the parameters' sharding); Adam reads and
  writes parameters and moments and reads the gradients once per optimizer step; one
  program call per optimizer step.
- **infer**: one pass per micro-batch, its all-reduces and one FSDP gather; one call.
- **generate** (the rollout engine's shape, :func:`jaxflow.sampling.engine_shape`, per
  generation replica of ``g`` devices): chunked prefill of the replica's prompts (a pass
  per chunk, over the engine's prompt bucket ``P``), then ``ceil(rows / slots) R`` decode steps of ``b`` sequences (the slots in
  use), each reading ``Wm / g`` and the KV cache ``b S L 2 N K c`` (``S = P + (R + 1) / 2``
  the mean context; split ``g`` ways) and computing ``b (2 (B + Hd) + 4 L H K S) / g``
  FLOPs at ``decode_mfu``, with ``L (16 + 2)`` + 12 kernels (the layers, the paged-cache
  writes, sampling) and 2 all-reduces of ``b D c`` per layer. When the KV cache is split
  over ``head_dim`` (the ``*_kv_head_dim`` rules, GQA models whose kv heads do not divide
  the training degree), XLA all-gathers the step's keys and values over the group each
  layer (seen in the compiled HLO), and in training and prefill the k/v activations.
- **generate_one**: an extra rollout of one response per prompt (`dataflow`'s
  ``actor/generate_<mode>``): **generate** with ``rows = prompts``.
- **reshard** (3D-HybridEngine, Table 2): an all-gather of ``W / g`` inside each micro-DP
  group of ``m`` consecutive devices (``*_embed`` rules: first one of ``W / tp`` over fsdp).

**Collectives** (:func:`collective`): a ring over a mesh axis' group (``count`` devices,
``stride`` apart in the pool's device order), costed by the profile's protocols
(:class:`~jaxflow.automap.profiles.Protocol`: a base latency, a latency per ring step
inside / between link domains, the slowest link's bandwidth), the fastest protocol per
message. Groups are placed as jaxflow's meshes place them: a training mesh is the pool
reshaped to ``(dp, fsdp, tp)``, so tp groups are consecutive devices, fsdp groups stride
``tp``, dp groups stride ``fsdp tp``; the actor's generation mesh regroups each
weight-parallel block of ``nw`` devices into ``(g, m)`` (the paper's grouping: micro-DP
groups consecutive), so a generation tp group strides ``m`` and leaves the host when
``nw`` exceeds it.

Combining: on an accelerator, FSDP gathers and gradient reductions overlap the compute
(XLA's asynchronous collectives), tensor-parallel all-reduces do not. On a ``shared_host``
profile (simulated devices) the devices of a stage share the host's FLOP/s, bandwidth and
kernel dispatch, and nothing overlaps.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from jaxflow.automap.layouts import RoleLayout
from jaxflow.automap.profiles import DeviceProfile
from jaxflow.automap.workload import RoleModel, Workload

KERNELS_PER_LAYER = 16  # one decoder layer's forward (see the module docstring)
HEAD_KERNELS = 4  # the output head and its log-softmax / loss fusions
CACHE_KERNELS = 2  # a decode step's paged KV-cache writes per layer
SAMPLING_KERNELS = 12  # a decode step's sampling: temperature, top-k/p, draw, log-prob, stops, page table


@dataclasses.dataclass(frozen=True)
class StageTime:
    """Seconds of one stage (analytic), with its parts: ``compute`` (FLOPs at the achievable
    rate), ``memory`` (HBM traffic at the achievable bandwidth), ``comm`` (collectives),
    ``overhead`` (kernels and program calls). ``seconds`` combines them (roofline maxima,
    overlap), so it is not their sum."""

    seconds: float
    compute: float = 0.0
    memory: float = 0.0
    comm: float = 0.0
    overhead: float = 0.0


@functools.lru_cache(maxsize=4096)
def hosts_spanned(count: int, stride: int, domain: int) -> int:
    """Link domains (hosts) the most spread group of ``count`` devices ``stride`` apart
    touches, when groups start at every offset below ``stride`` of a domain-aligned block."""
    return max(len({(j + i * stride) // domain for i in range(count)}) for j in range(min(stride, domain)))


def collective(prof: DeviceProfile, kind: str, count: int, stride: int, nbytes: float, busy: int = 1) -> float:
    """Seconds of a ring ``kind`` (``all_gather``, ``reduce_scatter``, ``all_reduce``) over
    ``count`` devices ``stride`` apart; ``nbytes`` the full (gathered / reduced) size per
    device; ``busy`` devices working at once (they share a simulated host's bandwidth)."""
    if count <= 1:
        return 0.0
    rounds = 2 if kind == "all_reduce" else 1
    hosts = hosts_spanned(count, stride, prof.domain)
    steps, net_steps = rounds * (count - 1), rounds * (hosts - 1)
    bw = prof.inter_bw if hosts > 1 else prof.intra_bw
    if prof.shared_host:
        bw /= busy
    return min(
        p.base_s
        + (steps - net_steps) * p.hop_s
        + net_steps * p.net_hop_s
        + steps / count * nbytes / (p.bw_fraction * bw)
        for p in prof.protocols
    )


def _share(prof: DeviceProfile, busy: int) -> int:
    return busy if prof.shared_host else 1


def roofline(prof: DeviceProfile, busy: int, flops: float, nbytes: float, mfu: float) -> tuple[float, float]:
    """``(compute seconds, memory seconds)`` of work that does ``flops`` and moves ``nbytes``
    per device while ``busy`` devices work; the pass takes the larger."""
    s = _share(prof, busy)
    return flops * s / (prof.flops * mfu), nbytes * s / (prof.hbm_bw * prof.hbm_eff)


def kernels_time(prof: DeviceProfile, busy: int, kernels: float) -> float:
    return kernels * _share(prof, busy) * prof.kernel_overhead_s


def pass_flops(rm: RoleModel, rows: float, T: int, head_tokens: float, tp: int) -> float:
    """FLOPs per device of one forward over ``rows`` sequences of ``T`` tokens (causal)."""
    mc = rm.config
    attention = 4 * mc.num_layers * mc.num_heads * mc.head_dim * rows * T * (T + 1) / 2
    return (2 * rm.body_params * rows * T + attention + 2 * rm.head_params * head_tokens) / tp


def activation_traffic(rm: RoleModel, tokens: float, tp: int) -> float:
    """HBM bytes per device of one forward's activations (each written and read once)."""
    mc = rm.config
    per_token = (
        4 * mc.hidden_size
        + (3 * mc.intermediate_size + 2 * mc.num_heads * mc.head_dim + 2 * mc.num_kv_heads * mc.head_dim) / tp
    )
    return 2 * rm.compute_itemsize * tokens * mc.num_layers * per_token


def _kv_over_head_dim(rules) -> bool:
    table = dict(rules)
    return table.get("kv_heads") is None and table.get("head_dim") is not None


def _head_tokens(rm: RoleModel, rows: float, T: int, R: int) -> float:
    return rows * (R if rm.head == "lm" else T)


def _combine(
    prof: DeviceProfile,
    compute: float,
    memory: float,
    overlapped: float,
    serial: float,
    extra_memory: float,
    overhead: float,
) -> StageTime:
    busy = max(compute, memory)
    work = busy + overlapped if prof.shared_host else max(busy, overlapped)
    return StageTime(
        work + serial + extra_memory + overhead, compute, memory + extra_memory, overlapped + serial, overhead
    )


def train_time(w: Workload, rl: RoleLayout, prof: DeviceProfile) -> StageTime:
    rm, lay = w.models[rl.role], rl.layout
    mc, n, tp = rm.config, lay.devices, lay.tp
    T, R = w.prompt_len + w.response_len, w.response_len
    r = 1 if mc.remat_policy != "none" else 0
    k = rl.micro_batches["train"]
    steps = w.epochs[rl.role] * (w.rows // w.mini_batch_rows[rl.role])  # optimizer steps
    micros = steps * k
    b = w.mini_batch_rows[rl.role] / k / (lay.dp * lay.fsdp)  # rows per device per micro-batch
    passes = 3 + r  # FLOPs: forward 1, backward 2, remat 1
    flops = micros * passes * pass_flops(rm, b, T, _head_tokens(rm, b, T, R), tp)
    # HBM: the weights read by the forwards and the backward, the gradients written; the activations.
    nbytes = micros * ((2 + r + 1) * rm.matmul_weight_bytes / tp + passes * activation_traffic(rm, b * T, tp))
    compute, memory = roofline(prof, n, flops, nbytes, prof.mfu)
    act = b * T * mc.hidden_size * rm.compute_itemsize
    serial = micros * mc.num_layers * (4 + 2 * r) * collective(prof, "all_reduce", tp, 1, act, n)
    if _kv_over_head_dim(rl.rules):  # k and v activations all-gathered over tp: forward 2, backward 4, remat 2
        kv = b * T * mc.num_kv_heads * mc.head_dim * rm.compute_itemsize
        serial += micros * mc.num_layers * (6 + 2 * r) * collective(prof, "all_gather", tp, 1, kv, n)
    W = rm.weight_bytes
    overlapped = micros * (
        (2 + r) * collective(prof, "all_gather", lay.fsdp, tp, W / tp, n)
        + collective(prof, "reduce_scatter", lay.fsdp, tp, W / tp, n)
        + collective(prof, "all_reduce", lay.dp, lay.fsdp * tp, W / (lay.fsdp * tp), n)
    )
    p = rl.plan  # Adam: read parameters, gradients and moments; write parameters and moments
    adam = steps * roofline(prof, n, 0, 3 * p.param_bytes + 2 * p.optimizer_bytes, 1.0)[1]
    layer_kernels = mc.num_layers * KERNELS_PER_LAYER + HEAD_KERNELS
    overhead = kernels_time(prof, n, micros * (1 + r + 2) * layer_kernels) + steps * prof.call_overhead_s
    return _combine(prof, compute, memory, overlapped, serial, adam, overhead)


def infer_time(w: Workload, rl: RoleLayout, prof: DeviceProfile) -> StageTime:
    rm, lay = w.models[rl.role], rl.layout
    mc, n, tp = rm.config, lay.devices, lay.tp
    T, R = w.prompt_len + w.response_len, w.response_len
    k = rl.micro_batches["infer"]
    b = w.rows / k / (lay.dp * lay.fsdp)
    flops = k * pass_flops(rm, b, T, _head_tokens(rm, b, T, R), tp)
    nbytes = k * (rm.matmul_weight_bytes / tp + activation_traffic(rm, b * T, tp))
    compute, memory = roofline(prof, n, flops, nbytes, prof.mfu)
    act = b * T * mc.hidden_size * rm.compute_itemsize
    serial = k * mc.num_layers * 2 * collective(prof, "all_reduce", tp, 1, act, n)
    if _kv_over_head_dim(rl.rules):
        kv = b * T * mc.num_kv_heads * mc.head_dim * rm.compute_itemsize
        serial += k * mc.num_layers * 2 * collective(prof, "all_gather", tp, 1, kv, n)
    overlapped = k * collective(prof, "all_gather", lay.fsdp, tp, rm.weight_bytes / tp, n)
    overhead = kernels_time(prof, n, k * (mc.num_layers * KERNELS_PER_LAYER + HEAD_KERNELS)) + prof.call_overhead_s
    return _combine(prof, compute, memory, overlapped, serial, 0.0, overhead)


def generate_time(w: Workload, rl: RoleLayout, prof: DeviceProfile) -> StageTime:
    rm, lay, shape = w.models[rl.role], rl.layout, rl.engine
    mc, n, g = rm.config, lay.devices, lay.gen_tp
    m = rl.weight_degree // g  # a generation tp group strides m devices
    c = rm.compute_itemsize
    L, D, H, N, K = mc.num_layers, mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim
    P, R = shape.prompt_len, w.response_len  # the prompt bucket is computed; decode stops at R
    gather_kv = _kv_over_head_dim(rl.gen_rules)
    kv_split = g if (gather_kv or N % g == 0) else 1
    layer_kernels = L * KERNELS_PER_LAYER + HEAD_KERNELS
    # Prefill: the replica's prompts in chunks of prefill_rows x prefill_len tokens.
    chunks = math.ceil(shape.prompts / shape.prefill_rows) * math.ceil(P / shape.prefill_len)
    flops = pass_flops(rm, shape.prompts, P, shape.prompts, g)
    nbytes = chunks * rm.matmul_weight_bytes / g + activation_traffic(rm, shape.prompts * P, g)
    p_compute, p_memory = roofline(prof, n, flops, nbytes, prof.mfu)
    chunk_tokens = shape.prefill_rows * shape.prefill_len
    comm = chunks * L * 2 * collective(prof, "all_reduce", g, m, chunk_tokens * D * c, n)
    if gather_kv:
        comm += chunks * L * 2 * collective(prof, "all_gather", g, m, chunk_tokens * N * K * c, n)
    # Decode: waves of `slots` sequences, R steps each; b sequences per step on average.
    waves = math.ceil(shape.rows / shape.slots)
    steps = waves * R
    b = shape.rows / waves
    S = P + (R + 1) / 2  # mean context of a step
    step_flops = b * (2 * (rm.body_params + rm.head_params) + 4 * L * H * K * S) / g
    kv_bytes = b * S * L * 2 * N * K * c
    step_bytes = rm.matmul_weight_bytes / g + kv_bytes / kv_split + activation_traffic(rm, b, g) + b * mc.vocab_size * 4
    d_compute, d_memory = roofline(prof, n, step_flops, step_bytes, prof.decode_mfu)
    step_comm = L * 2 * collective(prof, "all_reduce", g, m, b * D * c, n)
    if gather_kv:  # the step's keys and values, gathered over the group each layer
        step_comm += L * 2 * collective(prof, "all_gather", g, m, kv_bytes / (2 * L), n)
    kernels = chunks * layer_kernels + steps * (L * (KERNELS_PER_LAYER + CACHE_KERNELS) + SAMPLING_KERNELS)
    overhead = kernels_time(prof, n, kernels) + prof.call_overhead_s
    compute = p_compute + steps * d_compute
    memory = p_memory + steps * d_memory
    work = max(p_compute, p_memory) + steps * max(d_compute, d_memory)
    comm += steps * step_comm
    return StageTime(work + comm + overhead, compute, memory, comm, overhead)


def generate_one_time(w: Workload, rl: RoleLayout, prof: DeviceProfile) -> StageTime:
    """A further rollout of one response per prompt (an algorithm's ``extra_rollouts``, e.g.
    ReMax's greedy baseline): the same prefill, decode of one row per prompt."""
    shape = rl.engine
    one = dataclasses.replace(shape, rows=shape.prompts, slots=min(shape.slots, shape.prompts))
    return generate_time(w, dataclasses.replace(rl, engine=one), prof)


def reshard_time(w: Workload, rl: RoleLayout, prof: DeviceProfile) -> StageTime:
    """Table 2's hybrid row: each device receives its generation shard ``W / g`` minus its
    training shard, by all-gathers inside its micro-DP group of ``nw / g`` consecutive
    devices (under the ``*_embed`` rules, first over fsdp: the embedding dimension)."""
    rm, lay = w.models[rl.role], rl.layout
    n, g, W = lay.devices, lay.gen_tp, rm.weight_bytes
    comm = collective(prof, "all_gather", rl.weight_degree // g, 1, W / g, n)
    if dict(rl.rules).get("embed") == "fsdp" and lay.fsdp > 1:  # *_embed rules: the embedding dimension over fsdp
        comm += collective(prof, "all_gather", lay.fsdp, lay.tp, W / lay.tp, n)
    memory = roofline(prof, n, 0, W / g, 1.0)[1]  # the generation copy written
    overhead = prof.call_overhead_s
    return StageTime(comm + memory + overhead, 0.0, memory, comm, overhead)


PHASE_TIMES = {
    "train": train_time,
    "infer": infer_time,
    "generate": generate_time,
    "generate_one": generate_one_time,
    "reshard": reshard_time,
}


def stage_time(w: Workload, phase: str, rl: RoleLayout, prof: DeviceProfile) -> StageTime:
    return PHASE_TIMES[phase](w, rl, prof)
