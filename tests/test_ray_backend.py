"""The Ray backend: worker groups as `jax.distributed` worlds of one process per (simulated)
host, driven in lock step by this process; the transfer protocols behave as on the local
backend; faults become clear errors within their deadlines and leave no process behind.

One local Ray instance for the module; groups of 4 processes x 2 simulated CPU devices (the
8 devices of the local backend's tests) and a model-free worker (`tests.ray_toy.Toy`), so
the cost is process start-up, not compilation.
"""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import ray

from jaxflow import configs
from jaxflow.configs.resolve import ray_config, ray_devices
from jaxflow.data.batch import Batch
from jaxflow.workers import LocalWorkerGroup, WorkerGroupInfo
from jaxflow.workers.ray_backend import (
    DeadlineExceeded,
    ProcessGroup,
    RayBackend,
    RayConfig,
    Unschedulable,
    WorkerDied,
    describe_hosts,
)
from tests.ray_toy import Toy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = RayConfig(devices_per_host=2, compile_deadline_s=120, step_deadline_s=60, sync_deadline_s=120,
                   schedule_timeout_s=3)


@pytest.fixture(scope="module")
def backend():
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    b = RayBackend(CONFIG)
    yield b
    b.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def toy_groups(backend):
    processes = backend.process_group("toy", 4)
    return {"local": LocalWorkerGroup(Toy, name="toy", mesh="dp=4,tp=2"),
            "ray": backend.group(processes, Toy, name="toy", mesh="dp=4,tp=2")}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_gone(pids, timeout_s: float = 30.0) -> list[int]:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and any(_alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


@pytest.mark.parametrize("kind", ["local", "ray"])
def test_protocols_on_both_backends(toy_groups, kind):
    """The same calls give the same results on one process and on 4 processes x 2 devices."""
    group = toy_groups[kind]
    assert group.methods() == ["busy", "double", "fail", "hello", "rollout", "rows_seen", "stats", "train",
                               "whoami"]
    with pytest.raises(AttributeError, match="no registered method 'not_registered'"):
        group.not_registered()
    batch = Batch.from_dict({"x": np.arange(6, dtype=np.float32)}, {"uid": list("abcdef")}, {"step": 3})
    out = group.double(batch)  # 6 rows padded to 8 for dp=4, one program over the mesh, unpadded
    assert group.rows_seen() == [[8]]
    np.testing.assert_array_equal(np.asarray(out["y"]), 2 * np.arange(6))
    assert list(out["uid"]) == list("abcdef") and out.meta == {"step": 3}
    assert group.hello("you") == ["hi you"]
    with pytest.raises(ValueError, match="does not split evenly"):
        group.train(batch)  # 6 rows on 4 shards: a training step never trains on padding copies
    assert group.train(Batch.from_dict({"x": np.arange(8.0)})) == {"rows": 8.0}
    assert group.stats(batch) == {"mean_x": pytest.approx(np.mean([0, 1, 2, 3, 4, 5, 0, 1]))}
    rolled = group.rollout(batch)  # n outputs per input row: the padding rows' outputs are removed
    assert len(rolled) == 18
    np.testing.assert_array_equal(rolled["uid"], np.repeat(list("abcdef"), 3))
    np.testing.assert_array_equal(rolled["sample"], np.tile(np.arange(3), 6))


def test_ray_group_is_one_jax_world_per_group(toy_groups):
    group = toy_groups["ray"]
    assert group.info == WorkerGroupInfo(world_size=4, dp_size=1)
    tags, processes, devices = zip(*group.whoami(["a", "b", "c", "d"]))  # ALL_TO_ALL: one value per process
    assert tags == ("a", "b", "c", "d") and processes == (0, 1, 2, 3)
    assert all(len(d) == 2 for d in devices) and len({i for d in devices for i in d}) == 8
    with pytest.raises(ValueError, match="one value per rank"):
        group.whoami(["a", "b"])


def test_worker_error_names_group_and_rank_and_group_survives(toy_groups):
    group = toy_groups["ray"]
    with pytest.raises(ValueError, match="bad input") as info:
        group.fail("bad input")
    assert any("worker group 'toy' rank" in note for note in info.value.__notes__)
    assert group.hello("again") == ["hi again"]  # every rank raised alike: the world is intact


def test_sigkill_becomes_error_naming_group_and_rank(backend):
    processes = backend.process_group("victim", 2)
    group = backend.group(processes, Toy, name="victim", mesh="dp=4")
    pids = list(processes.pids)
    group.busy(1)  # compiled; later calls with these shapes get the step deadline
    kill = f"import os, signal, time; time.sleep(2); os.kill({pids[1]}, signal.SIGKILL)"
    killer = subprocess.Popen([sys.executable, "-c", kill])
    start = time.monotonic()
    with pytest.raises(WorkerDied, match=r"worker group 'victim' rank 1 \(pid \d+\) died during victim.busy") as e:
        group.busy(10**9)  # all-reduces until a rank dies; the other waits in one
    elapsed = time.monotonic() - start
    killer.wait()
    assert (e.value.group, e.value.rank) == ("victim", 1)
    assert elapsed < CONFIG.step_deadline_s, elapsed
    assert _wait_gone(pids) == []  # the surviving rank was stopped too: its world is gone
    with pytest.raises(RuntimeError, match="worker group 'victim' is stopped"):
        group.hello("anyone")


def test_call_past_its_deadline_is_an_error(backend):
    processes = ProcessGroup("slow", 1, RayConfig(devices_per_host=2, step_deadline_s=3))
    try:
        group = backend.group(processes, Toy, name="slow", mesh="dp=2")
        group.busy(1)  # a first call with these shapes gets the compile deadline; later ones the step deadline
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded, match=r"worker group 'slow': slow.busy passed its deadline of 3s; "
                                                   r"rank\(s\) \[0\] of 1 did not answer"):
            group.busy(10**9)
        assert time.monotonic() - start < 30
        assert _wait_gone(processes.pids) == []
    finally:
        processes.shutdown()


def test_unschedulable_group_is_reported(backend):
    start = time.monotonic()
    with pytest.raises(Unschedulable, match=r"worker group 'huge': 64 host bundle\(s\) of \{'CPU': 1.0\} could not be "
                                            r"scheduled within 3s"):
        backend.process_group("huge", 64)
    assert time.monotonic() - start < 30
    assert "huge" not in backend.groups


ORPHAN_DRIVER = """
import sys, time, ray
from jaxflow.workers.ray_backend import RayBackend, RayConfig
from tests.ray_toy import Toy
ray.init(address=sys.argv[1], log_to_driver=False)
backend = RayBackend(RayConfig(devices_per_host=2))
processes = backend.process_group("orphans", 2)
group = backend.group(processes, Toy, name="orphans", mesh="dp=4")
print("PIDS", *processes.pids, flush=True)
group.busy(10**9)
"""


def test_ctrl_c_at_the_driver_leaves_no_worker_processes(backend):
    env = {**os.environ, "PYTHONPATH": ROOT}
    driver = subprocess.Popen([sys.executable, "-c", ORPHAN_DRIVER, ray.get_runtime_context().gcs_address],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=ROOT)
    try:
        line = ""
        while not line.startswith("PIDS"):
            line = driver.stdout.readline()
            assert line or driver.poll() is None, "the driver exited before starting its group"
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        time.sleep(1.0)  # inside group.busy now
        driver.send_signal(signal.SIGINT)
        assert driver.wait(timeout=60) != 0
    finally:
        if driver.poll() is None:
            driver.kill()
    assert _wait_gone(pids) == []


def test_local_path_never_imports_ray():
    code = ("import sys, jaxflow, jaxflow.workers, jaxflow.trainer, jaxflow.run; "
            "import jaxflow.workers.ray_backend; assert 'ray' not in sys.modules, 'ray was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT)


def test_ppo_70b_per_host_plan_without_a_cluster():
    cfg = configs.load_config("ppo_70b", ["jaxflow.backend=ray", "jaxflow.ray.accelerator=gpu"])
    plan = describe_hosts(configs.build_placement(cfg, ray_devices(cfg)), ray_config(cfg)).splitlines()
    assert plan[0].startswith("ray backend: 16 hosts x 8 gpu devices")
    assert plan[1] == ("group 'actor': hosts 0..7 (8 processes, ranks 0..7), placement group of 8 x "
                       "{'CPU': 1.0, 'GPU': 8} (STRICT_SPREAD)")
    assert plan[2].startswith("  actor: mesh dp=1,fsdp=8,tp=8 over 8 x 8 devices; each process holds a "
                              "dp=1,fsdp=1,tp=8 block of it; generate: replica=1,tp=8,dp=8")
    assert plan[3].startswith("  ref: mesh dp=1,fsdp=64,tp=1") and "dp=1,fsdp=8,tp=1 block" in plan[3]
    assert plan[4].startswith("group 'critic': hosts 8..15 (8 processes")
    assert [line.split(":")[0] for line in plan[5:]] == ["  critic", "  reward"]


@pytest.mark.parametrize("overrides, key, message", [
    (["jaxflow.ray.devices_per_host=3"], "jaxflow.ray.devices_per_host", "not a whole number of hosts of 3"),
    (["jaxflow.ray.devices_per_host=4", "jaxflow.placement.type=split", "jaxflow.placement.pool_sizes=2,6"],
     "jaxflow.placement.pool_sizes", "every pool takes whole hosts of 4 devices"),
    (["jaxflow.ray.accelerator=npu"], "jaxflow.ray.accelerator", "must be one of cpu, gpu, tpu"),
    (["jaxflow.ray.step_deadline_s=0"], "jaxflow.ray.step_deadline_s", "must be > 0"),
])
def test_ray_settings_are_validated(overrides, key, message):
    with pytest.raises(configs.ConfigError, match=message) as e:
        configs.load_config("ppo_tiny", ["jaxflow.backend=ray", *overrides])
    assert key in str(e.value)
