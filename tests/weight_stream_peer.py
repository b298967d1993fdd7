"""One side of `tests/test_weight_stream.py`: its own JAX world of 2 simulated CPU devices.

``python -m tests.weight_stream_peer sender|receiver DIR GEN_TP``: the sender holds the tiny model
fsdp=2 on its devices and posts its pieces; the receiver pulls its bf16 generation copy
(tp=GEN_TP over its 2 devices, the rest replicas), checks it bit for bit against the NumPy
cast of the same host state and writes a JSON report. The two exchange layouts and
addresses as files in DIR (the driver's part on Ray)."""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
import pickle  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxflow.mesh import MeshSpec, hybrid_rules, state_shardings  # noqa: E402
from jaxflow.reshard import derive_generation_rules  # noqa: E402
from jaxflow.workers import weight_stream as ws  # noqa: E402
from tests.test_weight_sync import CFG, bits, random_state  # noqa: E402


def wait_for(path: Path, timeout_s: float = 60.0) -> bytes:
    end = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"no {path.name} within {timeout_s} s")
        time.sleep(0.05)
    return path.read_bytes()


def publish(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.rename(path)


def main(side: str, folder: str, gen_tp: int) -> None:
    root = Path(folder)
    host = random_state(CFG)
    train_mesh = MeshSpec(fsdp=2).build(jax.devices())
    train_rules, _ = hybrid_rules(CFG, 2)
    server = ws.start_server()
    if side == "sender":
        train = jax.device_put(host, state_shardings(host, train_rules, train_mesh))
        leaves = jax.tree.leaves(train)
        publish(root / "src", pickle.dumps((ws.layout(leaves), server.address())))
        dst = pickle.loads(wait_for(root / "dst"))
        plan = ws.stream_plan(ws.layout(leaves), dst)
        sent = ws.WeightSender(server).offer(leaves, plan, 1, ws.layout_dtypes(dst)).bytes
        publish(root / "sent", json.dumps(sent).encode())
        wait_for(root / "report")  # the posted pieces live until pulled
        return
    gen_mesh = MeshSpec(dp=-1, tp=gen_tp).build(jax.devices())
    shardings = jax.tree.leaves(
        state_shardings(host, derive_generation_rules(train_rules, train_mesh), gen_mesh),
        is_leaf=lambda s: isinstance(s, jax.sharding.NamedSharding),
    )
    host_leaves = jax.tree.leaves(host)
    dst = ws.layout_of_shardings(host_leaves, shardings, jnp.bfloat16)
    publish(root / "dst", pickle.dumps(dst))
    src, address = pickle.loads(wait_for(root / "src"))
    arrays, received = ws.WeightReceiver(server, {0: address}).receive(ws.stream_plan(src, dst), dst, shardings, 1)
    exact = all(
        np.array_equal(bits(x), bits(np.asarray(h).astype(jnp.bfloat16))) and x.sharding == s
        for x, h, s in zip(arrays, host_leaves, shardings)
    )
    largest = max(max(sh.data.nbytes for sh in x.addressable_shards) for x in arrays)
    held = sum(sh.data.nbytes for x in arrays for sh in x.addressable_shards)
    report = dict(
        exact=exact,
        pulled=received.bytes,
        seconds=received.seconds,
        largest_shard=largest,
        held=held,
        sent=json.loads(wait_for(root / "sent")),
    )
    publish(root / "report", json.dumps(report).encode())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
