"""The analytic model of the trainer modes (`jaxflow.automap.async_schedule`): its formulas
by hand, its parts against the simulators and the mapper they come from, the long tail's
effect, and invariances (more devices never slower, equal lengths make async one_step_off).

The toy: ppo_tiny's models with 256-token responses on a profile of one device per host
(every device count splits), generation-heavy (fast FLOPs, slow memory: a decode step reads
every weight), so that the rollout's length matters; one collective protocol without latency,
so the weight sync's seconds are bytes over bandwidth."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from jaxflow import configs
from jaxflow.automap import async_schedule as A
from jaxflow.automap.profiles import DeviceProfile, Protocol
from jaxflow.automap.search import Mapper
from jaxflow.automap.simulate import generate_time
from jaxflow.automap.workload import workload_from_spec
from jaxflow.configs.prepare import prepare_run

PROF = DeviceProfile(
    "toy",
    flops=1e15,
    hbm_bw=1e9,
    memory_gib=16,
    intra_bw=1e10,
    inter_bw=1e9,
    devices_per_host=1,
    protocols=(Protocol("bytes_over_bandwidth", 0.0, 0.0, 0.0, 1.0),),
    kernel_overhead_s=0.0,
    call_overhead_s=0.0,
)


@pytest.fixture(scope="module")
def w():
    spec = prepare_run(configs.get_config("ppo_tiny"), with_placement=False, with_datasets=False).spec
    return dataclasses.replace(workload_from_spec(spec), response_len=256)


def _tail(rho: float) -> A.Assumptions:
    return A.Assumptions(long_tail=A.LongTail(mean_over_max_given=rho))


def test_steady_state_by_hand():
    assert A.steady_state(3.0, 5.0, 1.0, overlap=True) == 6.0  # max(3, 5) + 1
    assert A.steady_state(7.0, 5.0, 1.0, overlap=True) == 8.0  # max(7, 5) + 1
    assert A.steady_state(3.0, 5.0, 1.0, overlap=False) == 9.0  # 3 + 5 + 1


def test_long_tail_mean_is_the_capped_lognormals():
    """rho = E[min(c, X)] / c = (1/c) int_0^c P(X > x) dx, by quadrature; the default by hand:
    e^0.5 Phi(ln 4 - 1) / 4 + 1 - Phi(ln 4) = 1.6487 x 0.6503 / 4 + 0.0829 = 0.351."""
    erf = np.vectorize(math.erf)
    for sigma, k in ((1.0, 4.0), (0.5, 2.0), (1.5, 10.0)):
        x = np.linspace(1e-12, 1.0, 400_001)  # c = 1, median 1 / k
        survival = 0.5 * (1 - erf((np.log(x) + math.log(k)) / (sigma * math.sqrt(2))))
        integral = float(np.sum((survival[1:] + survival[:-1]) / 2 * np.diff(x)))
        assert A.LongTail(sigma, k).mean_over_max == pytest.approx(integral, abs=1e-6)
    default = A.LongTail()
    assert default.mean_over_max == pytest.approx(0.351, abs=5e-4)
    assert default.capped_fraction == pytest.approx(0.0829, abs=5e-4)
    assert A.LongTail(mean_over_max_given=0.3).mean_over_max == 0.3
    with pytest.raises(ValueError):
        A.LongTail(mean_over_max_given=1.5)


def test_weight_sync_by_hand(w):
    """One replica per rollout device (gen_tp 1): each receives the whole generation copy
    Wg = parameters x generation itemsize; S = max(Wg, Nr Wg / Na) / inter_bw."""
    (rl,) = [
        r
        for r in A.rollout_layouts(w, 2, PROF)
        if r.layout.gen_tp == 1 and r.layout.dp == 2 and not r.layout.max_num_seqs
    ]
    rollout = A.RolloutPool(2, rl, {}, A.rollout_memory(rl))
    rm = w.models["actor"]
    wg = rm.num_params * min(rm.compute_itemsize, rm.param_itemsize)
    one_sender = A.weight_sync(w, rollout, senders=1, prof=PROF)
    assert (one_sender.bytes_per_receiver, one_sender.model_bytes, one_sender.total_bytes) == (wg, wg, 2 * wg)
    assert one_sender.seconds == pytest.approx(2 * wg / 1e9)  # the sender's link carries both copies
    assert A.weight_sync(w, rollout, senders=4, prof=PROF).seconds == pytest.approx(wg / 1e9)  # the receivers'
    slow_start = dataclasses.replace(PROF, protocols=PROF.protocols + (Protocol("latency", 1.0, 0, 0, 1.0),))
    assert A.weight_sync(w, rollout, 4, slow_start).seconds == pytest.approx(wg / 1e9)  # the faster protocol


def test_one_step_off_is_the_max_of_its_parts_plus_the_sync(w):
    plan = A.split_modes(w, 3, PROF, A.Assumptions())["one_step_off"]
    assert plan.iteration_s == max(plan.rollout.seconds, plan.training.iteration_s) + plan.sync.seconds
    assert plan.rollout.seconds == generate_time(w, plan.rollout.layout, PROF).seconds
    n_train = plan.training_devices
    alone = A.TrainingPoolMapper(A.training_workload(w), n_train, PROF).search(top=1)[0]
    assert plan.training.iteration_s == alone.iteration_s
    assert plan.sync == A.weight_sync(w, plan.rollout, plan.training.pool_of("actor").devices, PROF)
    assert plan.rollout_devices + n_train <= 3


def test_sync_is_the_mappers_best_plan(w):
    plan = A.predict(w, 4, PROF)["sync"]
    assert plan.iteration_s == Mapper(w, 4, PROF).search(top=1)[0].iteration_s
    assert plan.rollout is None and plan.sync is None


def test_async_with_equal_lengths_is_one_step_off(w):
    for n in (2, 3, 4):
        modes = A.split_modes(w, n, PROF, _tail(1.0))
        a, o = modes["async"], modes["one_step_off"]
        assert (a.iteration_s, a.rollout_devices, a.training_devices, a.sync) == (
            o.iteration_s,
            o.rollout_devices,
            o.training_devices,
            o.sync,
        )


def test_a_longer_tail_speeds_async_only(w):
    """rho 1 -> 0.5 -> 0.2: async never slower, one_step_off unchanged, async >= one_step_off;
    on 3 devices the rollout (1 device) is the bottleneck at rho 1 and async gains at 0.5."""
    for n in (2, 3, 4, 6):
        runs = [A.predict(w, n, PROF, _tail(rho)) for rho in (1.0, 0.5, 0.2)]
        sync_s = runs[0]["sync"].iteration_s
        assert all(r["sync"].iteration_s == sync_s for r in runs)
        assert all(r["one_step_off"].iteration_s == runs[0]["one_step_off"].iteration_s for r in runs)
        async_s = [r["async"].iteration_s for r in runs]
        assert async_s == sorted(async_s, reverse=True)
        assert all(r["async"].iteration_s <= r["one_step_off"].iteration_s for r in runs)
    three = [A.split_modes(w, 3, PROF, _tail(rho)) for rho in (1.0, 0.5)]
    assert three[0]["one_step_off"].generate_s > three[0]["one_step_off"].rest_s  # rollout-bound
    assert three[1]["async"].iteration_s < three[1]["one_step_off"].iteration_s
    r_mean = A.mean_response_len(w, _tail(0.5).long_tail)
    assert r_mean == 128
    a = three[1]["async"]
    assert a.generate_s == generate_time(dataclasses.replace(w, response_len=r_mean), a.rollout.layout, PROF).seconds


def test_no_overlap_without_staleness_or_on_a_shared_host(w):
    for a, prof in (
        (A.Assumptions(max_staleness=0), PROF),
        (A.Assumptions(), dataclasses.replace(PROF, shared_host=True)),
    ):
        for mode, plan in A.split_modes(w, 3, prof, a).items():
            if mode == "async" or prof.shared_host:
                assert plan.iteration_s == pytest.approx(plan.generate_s + plan.rest_s + plan.sync.seconds)


def test_more_devices_are_never_slower(w):
    for rho in (1.0, 0.3):
        runs = [A.split_modes(w, n, PROF, _tail(rho)) for n in range(2, 9)]
        for mode in ("one_step_off", "async"):
            times = [r[mode].iteration_s for r in runs]
            assert times == sorted(times, reverse=True), (mode, rho, times)


def test_the_training_pool_leaves_the_rollout_out(w):
    wt = A.training_workload(w)
    names = {s.name for s in wt.stages}
    assert names == {s.name for s in w.stages} - {"actor/reshard", "actor/generate"}
    assert all(d in names for s in wt.stages for d in s.deps)
    assert Mapper.phases_elsewhere == frozenset()
    training, whole = A.TrainingPoolMapper(wt, 2, PROF), Mapper(w, 2, PROF)
    for o in whole.role_options("actor", 2):
        phases = o.layout.plan.transient_bytes()
        assert training.transient_bytes(o.layout) == max(t for ph, t in phases.items() if ph != "generate")
        assert whole.transient_bytes(o.layout) == max(phases.values())
