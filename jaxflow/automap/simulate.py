"""Analytic simulators of each stage's time (HybridFlow §6's simulators, in jaxflow's axes).

Symbols: ``N`` matmul parameters of the model (per token), ``L`` layers, ``D`` width, ``H``
query heads of ``K`` dims, ``T = P + R`` tokens per sequence, ``c`` compute bytes, ``W`` the
model's weight bytes; ``n`` devices of the stage, mesh ``(dp, fsdp, tp)``, generation tp
``g``. Per device (``F`` peak FLOP/s x MFU, ``B`` memory bandwidth):

- forward FLOPs per token: ``f(S) = 2 N + 4 L H K S`` (projections and MLP, attention's two
  products over ``S`` keys).
- **train** (compute-bound): ``rows T f(T) (3 + remat) / (n F)``, plus collectives:
  tensor parallel all-reduces of ``b T D c`` (2 per layer forward, 2 backward, 2 more under
  remat) per micro-batch; FSDP all-gathers of the weights ``W / tp`` (2, 3 under remat) and
  a reduce-scatter of the gradients per micro-batch (overlapped with compute on
  accelerators); the dp all-reduce of ``W / (fsdp tp)`` per optimizer step; Adam's update
  reads and writes parameters, gradients and moments (memory-bound).
- **infer** (forward only): ``rows T f(T) / (n F)``, 2 all-reduces per layer, one FSDP
  gather per micro-batch.
- **generate**: per call, a compute-bound prefill of ``b P`` tokens per replica, then ``R``
  memory-bound decode steps: each reads the replica's weights ``W / g`` and KV cache
  ``b S L 2 N_kv K c / g`` (``S`` the mean context) and all-reduces ``b D c`` twice per
  layer, plus a fixed per-step overhead.
- **reshard** (3D-HybridEngine, Table 2): each device receives ``W/g - W_train_shard``
  bytes inside its micro-DP group.

A collective over ``k`` devices of ``X`` bytes (the gathered size): ring, ``(k-1)`` steps of
latency plus ``(k-1)/k X`` over the link (intra-host when the group lies inside a host,
else inter-host); an all-reduce twice that. On a ``shared_host`` profile (simulated devices)
the busy devices share the host's FLOP/s and bandwidth, and collectives do not overlap
compute.
"""

from __future__ import annotations

import dataclasses
import math

from jaxflow.automap.layouts import RoleLayout, generation_rows
from jaxflow.automap.profiles import DeviceProfile
from jaxflow.automap.workload import RoleModel, Workload


@dataclasses.dataclass(frozen=True)
class StageTime:
    """Seconds of one stage (analytic), with its parts."""

    seconds: float
    compute: float = 0.0
    comm: float = 0.0
    memory: float = 0.0
    overhead: float = 0.0


def collective(prof: DeviceProfile, group: int, span: int, nbytes: float, busy: int, all_reduce: bool = False) -> float:
    """Seconds of a ring all-gather / reduce-scatter (all-reduce: twice) over ``group``
    devices whose members lie within ``span`` consecutive devices; ``nbytes`` the gathered
    size per device."""
    if group <= 1:
        return 0.0
    bw = prof.intra_bw if span <= prof.devices_per_host else prof.inter_bw
    if prof.shared_host:
        bw /= busy
    t = (group - 1) * prof.latency_s + (group - 1) / group * nbytes / bw
    return 2 * t if all_reduce else t


def _rates(prof: DeviceProfile, busy: int) -> tuple[float, float]:
    """(FLOP/s, bytes/s) one device gets while ``busy`` devices work."""
    share = busy if prof.shared_host else 1
    return prof.flops / share, prof.hbm_bw * prof.hbm_eff / share


def flops_per_token(rm: RoleModel, context: float) -> float:
    mc = rm.config
    return 2 * rm.matmul_params + 4 * mc.num_layers * mc.num_heads * mc.head_dim * context


def _weight_bytes(rm: RoleModel) -> float:
    return rm.num_params * rm.param_itemsize


def _combine(prof: DeviceProfile, compute: float, overlappable: float, serial: float, memory: float,
             overhead: float) -> StageTime:
    if prof.shared_host:
        busy = compute + overlappable
    else:
        busy = max(compute, overlappable)
    return StageTime(busy + serial + memory + overhead, compute, overlappable + serial, memory, overhead)


def train_time(w: Workload, rl: RoleLayout, prof: DeviceProfile) -> StageTime:
    rm, lay = w.models[rl.role], rl.layout
    mc, n = rm.config, lay.devices
    T = w.prompt_len + w.response_len
    remat = mc.remat_policy != "none"
    flops, mem_bw = _rates(prof, n)
    epochs, k = w.epochs[rl.role], rl.micro_batches["train"]
    steps = epochs * (w.rows // w.mini_batch_rows[rl.role])  # optimizer steps
    micros = steps * k
    compute = epochs * w.rows * T * flops_per_token(rm, T) * (4 if remat else 3) / n / (flops * prof.mfu)
    b = w.mini_batch_rows[rl.role] / k / (lay.dp * lay.fsdp)
    act = b * T * mc.hidden_size * rm.compute_itemsize
    tp_comm = micros * mc.num_layers * (6 if remat else 4) * collective(prof, lay.tp, lay.tp, act, n, True)
    W = _weight_bytes(rm)  # FSDP gathers each weight over fsdp: W / tp per device
    fsdp_comm = micros * ((3 if remat else 2) + 1) * collective(prof, lay.fsdp, lay.fsdp * lay.tp, W / lay.tp, n)
    dp_comm = steps * collective(prof, lay.dp, n, W / (lay.fsdp * lay.tp), n, True)
    p = rl.plan
    optimizer = steps * 2 * (p.param_bytes + p.gradient_bytes + p.optimizer_bytes) / mem_bw
    overhead = micros * prof.call_overhead_s
    return _combine(prof, compute, fsdp_comm, tp_comm + dp_comm, optimizer, overhead)


def infer_time(w: Workload, rl: RoleLayout, prof: DeviceProfile) -> StageTime:
    rm, lay = w.models[rl.role], rl.layout
    mc, n = rm.config, lay.devices
    T = w.prompt_len + w.response_len
    flops, _ = _rates(prof, n)
    k = rl.micro_batches["infer"]
    compute = w.rows * T * flops_per_token(rm, T) / n / (flops * prof.mfu)
    b = w.rows / k / (lay.dp * lay.fsdp)
    act = b * T * mc.hidden_size * rm.compute_itemsize
    tp_comm = k * mc.num_layers * 2 * collective(prof, lay.tp, lay.tp, act, n, True)
    fsdp_comm = k * collective(prof, lay.fsdp, lay.fsdp * lay.tp, _weight_bytes(rm) / lay.tp, n)
    return _combine(prof, compute, fsdp_comm, tp_comm, 0.0, k * prof.call_overhead_s)


def generate_time(w: Workload, rl: RoleLayout, prof: DeviceProfile) -> StageTime:
    rm, lay = w.models[rl.role], rl.layout
    mc, n, g = rm.config, lay.devices, lay.gen_tp
    P, R = w.prompt_len, w.response_len
    gen_dp = n // g
    flops, mem_bw = _rates(prof, n)
    per_call = generation_rows(w, gen_dp)
    calls = math.ceil(w.rows / per_call)
    b = math.ceil(per_call / gen_dp)  # sequences per generation replica per call
    c = rm.compute_itemsize
    # Prefill: compute-bound, b P tokens per replica split over g devices.
    prefill = b * P * flops_per_token(rm, P) / g / (flops * prof.mfu)
    prefill_comm = mc.num_layers * 2 * collective(prof, g, g, b * P * mc.hidden_size * c, n, True)
    # Decode: R steps, each reading the replica's weights and KV cache.
    S = P + R / 2
    kv_split = g if (mc.num_kv_heads % g == 0 or mc.head_dim % g == 0) else 1
    step_bytes = _weight_bytes(rm) / g + b * S * mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * c / kv_split
    step_flops = b * flops_per_token(rm, S) / g
    step = max(step_bytes / mem_bw, step_flops / (flops * prof.decode_mfu))
    step_comm = mc.num_layers * 2 * collective(prof, g, g, b * mc.hidden_size * c, n, True)
    compute = calls * (prefill + R * max(0.0, step_flops / (flops * prof.decode_mfu)))
    memory = calls * R * step - calls * R * max(0.0, step_flops / (flops * prof.decode_mfu))
    comm = calls * (prefill_comm + R * step_comm)
    overhead = calls * (R * prof.step_overhead_s + prof.call_overhead_s)
    return StageTime(compute + memory + comm + overhead, compute, comm, memory, overhead)


def reshard_time(w: Workload, rl: RoleLayout, prof: DeviceProfile) -> StageTime:
    """Table 2's hybrid row: each device receives its generation shard minus its training
    shard, inside a micro-DP group (span: the weight-parallel devices)."""
    lay = rl.layout
    n = lay.devices
    group = n // (lay.dp * lay.gen_tp)  # devices whose training shards make one generation shard
    t = collective(prof, group, lay.fsdp * lay.tp, rl.plan.generate_param_bytes, n)
    return StageTime(t + prof.call_overhead_s, comm=t, overhead=prof.call_overhead_s)


PHASE_TIMES = {"train": train_time, "infer": infer_time, "generate": generate_time, "reshard": reshard_time}


def stage_time(w: Workload, phase: str, rl: RoleLayout, prof: DeviceProfile) -> StageTime:
    return PHASE_TIMES[phase](w, rl, prof)
