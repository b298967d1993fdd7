"""Weights streamed between two JAX worlds (`jaxflow.workers.weight_stream`): two processes,
each its own world of 2 simulated CPU devices; the sender holds the model fsdp=2 and posts
only its own pieces, the receiver pulls its bf16 generation copy with
``jax.experimental.transfer`` and finds it equal, bit for bit, to the NumPy cast."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests.child_env import child_env
from tests.test_weight_sync import CFG, random_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("gen_tp", [2, 1])
def test_two_worlds_stream_their_own_shards_bit_exactly(tmp_path, gen_tp):
    peers = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.weight_stream_peer", side, str(tmp_path), str(gen_tp)],
            env=child_env(),
            cwd=ROOT,
        )
        for side in ("sender", "receiver")
    ]
    try:
        assert [p.wait(timeout=120) for p in peers] == [0, 0]
    finally:
        for p in peers:
            p.kill()
    report = json.loads((tmp_path / "report").read_text())
    leaf_bytes_bf16 = [np.asarray(x).size * 2 for x in jax.tree.leaves(random_state(CFG))]
    assert report["exact"]
    # the receiver pulled exactly the generation shards its devices hold, all the sender posted
    assert report["pulled"] == report["sent"] == report["held"]
    if gen_tp == 1:  # two full replicas
        assert report["held"] == 2 * sum(leaf_bytes_bf16)
    if gen_tp == 2:  # no receiving device holds a whole weight that the generation layout splits
        assert report["largest_shard"] < max(leaf_bytes_bf16)
