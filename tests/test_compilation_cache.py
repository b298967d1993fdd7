"""Runs use JAX's persistent compilation cache by default: a second process finds the first
one's compiled program on disk instead of compiling it again, whether it turned the cache on
as a library user does (``jaxflow.mesh.enable_compilation_cache``) or is a Ray backend worker
process (``HostProcess.init_world``, the same code path the Ray actors run)."""

import os
import subprocess
import sys

import pytest

LIBRARY = """
from jaxflow.mesh import enable_compilation_cache
print("dir", enable_compilation_cache())
"""

RAY_WORKER = """
import socket
from jaxflow.workers.ray_host import HostProcess
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
HostProcess("actor", 0, 1, 1, "cpu").init_world(f"127.0.0.1:{port}", timeout_s=60)
import jax
print("dir", jax.config.jax_compilation_cache_dir)
"""

COMPILE = """
import jax, jax.numpy as jnp, jax.monitoring
hits = []
jax.monitoring.register_event_listener(lambda e, **kw: hits.append(e) if e == "/jax/compilation_cache/cache_hits" else None)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # this tiny program compiles in ms
print(float(jax.jit(lambda x: jnp.sin(x) @ jnp.cos(x).T)(jnp.ones((64, 64))).sum()))
print("hits", len(hits))
"""


PLATFORMS = """
import jax
from jaxflow.mesh import enable_compilation_cache
for platform in ("cpu", "gpu", "tpu"):
    enable_compilation_cache(platform)
    print(platform, jax.config.jax_persistent_cache_min_compile_time_secs)
"""


def test_what_is_stored_depends_on_the_platform(tmp_path):
    """On an accelerator every program is stored (a small one still compiles in ~0.1 s there,
    and a warm start would compile dozens again); on CPU those under a second are not; the
    environment variable overrides both. (In a subprocess: a process whose cache was turned
    on keeps it.)"""
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), PYTHONPATH=os.getcwd(), JAX_PLATFORMS="cpu")
    env.pop("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", None)
    outputs = []
    for override in (None, "2.5"):
        if override:
            env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = override
        run = subprocess.run([sys.executable, "-c", PLATFORMS], env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        outputs.append(dict(line.split() for line in run.stdout.splitlines()))
    assert outputs == [{"cpu": "1.0", "gpu": "0.0", "tpu": "0.0"}, {"cpu": "2.5", "gpu": "2.5", "tpu": "2.5"}]


@pytest.mark.parametrize("setup", [LIBRARY, RAY_WORKER], ids=["library", "ray_worker"])
def test_second_process_loads_the_compiled_program(tmp_path, setup):
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), PYTHONPATH=os.getcwd(), JAX_PLATFORMS="cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env.pop("XLA_FLAGS", None)
    runs = [
        subprocess.run([sys.executable, "-c", setup + COMPILE], env=env, capture_output=True, text=True, timeout=300)
        for _ in range(2)
    ]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    cache_dir = tmp_path / "jaxflow" / "jax"
    assert f"dir {cache_dir}" in runs[0].stdout
    assert any(cache_dir.iterdir())  # the first process wrote its executable
    first, second = (int(run.stdout.split("hits ")[1]) for run in runs)
    assert first == 0 and second >= 1  # the jitted program (and jnp.ones') came from disk
