"""Runs use JAX's persistent compilation cache by default: a second process finds the first
one's compiled program on disk instead of compiling it again."""

import os
import subprocess
import sys

PROGRAM = """
import jax, jax.numpy as jnp, jax.monitoring
from jaxflow.run import enable_compilation_cache
print("dir", enable_compilation_cache())
hits = []
jax.monitoring.register_event_listener(lambda e, **kw: hits.append(e) if e == "/jax/compilation_cache/cache_hits" else None)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # this tiny program compiles in ms
print(float(jax.jit(lambda x: jnp.sin(x) @ jnp.cos(x).T)(jnp.ones((64, 64))).sum()))
print("hits", len(hits))
"""


def test_second_process_loads_the_compiled_program(tmp_path):
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), PYTHONPATH=os.getcwd(), JAX_PLATFORMS="cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    runs = [subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    cache_dir = tmp_path / "jaxflow" / "jax"
    assert f"dir {cache_dir}" in runs[0].stdout
    assert any(cache_dir.iterdir())  # the first process wrote its executable
    first, second = (int(run.stdout.split("hits ")[1]) for run in runs)
    assert first == 0 and second >= 1  # the jitted program (and jnp.ones') came from disk
