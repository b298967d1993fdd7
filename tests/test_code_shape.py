"""Rules of the house that a reading of the code checks (no run).

1. The experiment config is read at the edge only: `jaxflow.configs.prepare.prepare_run` turns
   it into a `RunSpec`, and nothing under ``workers/``, ``iterations/``, ``plan/`` or
   ``automap/`` reads a ``ConfigDict``: no ``ConfigDict`` / ``ml_collections`` in their
   source, no call of a config reader (a function of `jaxflow.configs` that takes a
   ``ConfigDict``, found by its annotations), no ``cfg.<section>.`` walk of the experiment
   config's sections.
2. A function fits on a screen: none in ``jaxflow/`` is longer than `MAX_FUNCTION_LINES`.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import re

import pytest

from jaxflow.configs.base import FIELDS

ROOT = pathlib.Path(__file__).resolve().parents[1] / "jaxflow"
BELOW_THE_EDGE = ("workers", "iterations", "plan", "automap")
CONFIG_MODULES = ("", ".overrides", ".resolve", ".run_spec", ".prepare", ".validate")
SECTIONS = sorted({key.split(".")[0] for key, *_ in FIELDS})  # data, actor_rollout_ref, ..., jaxflow
SECTION_WALK = re.compile(rf"\b(?:cfg|config)\.({'|'.join(SECTIONS)})\.")
MAX_FUNCTION_LINES = 80


def config_readers() -> set[str]:
    """Names of the functions of `jaxflow.configs` that take a ``ConfigDict``."""
    names = set()
    for suffix in CONFIG_MODULES:
        module = importlib.import_module(f"jaxflow.configs{suffix}")
        for name, fn in vars(module).items():
            if inspect.isfunction(fn) and any("ConfigDict" in str(a) for a in fn.__annotations__.values()):
                names.add(name)
    return names


def config_reads(source: str, readers: set[str]) -> list[str]:
    """Where ``source`` reads an experiment config, one line each (empty: nowhere)."""
    found = [f"mentions {w}" for w in ("ConfigDict", "ml_collections") if w in source]
    found += [f"walks cfg.{m.group(1)}." for m in SECTION_WALK.finditer(source)]
    tree = ast.parse(source)
    modules = set()  # local names of jaxflow.configs modules
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxflow.configs"):
            found += [f"imports {a.name}" for a in node.names if a.name in readers]
            modules |= {a.asname or a.name for a in node.names if a.name not in readers}
        elif isinstance(node, ast.ImportFrom) and node.module == "jaxflow":
            modules |= {a.asname or a.name for a in node.names if a.name == "configs"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            if node.attr in readers:
                found.append(f"calls {node.value.id}.{node.attr}")
    return found


def _files(*packages: str) -> list[pathlib.Path]:
    return sorted(p for package in packages for p in (ROOT / package).rglob("*.py"))


def test_the_config_readers_are_found_and_so_are_their_calls():
    readers = config_readers()
    assert {"prepare_run", "describe_run", "build_tokenizer", "active_roles", "validate", "apply_overrides"} <= readers
    samples = {
        "from jaxflow.configs.resolve import active_roles\n": "imports active_roles",
        "from jaxflow import configs\nconfigs.validate(x)\n": "calls configs.validate",
        "def f(cfg):\n    return cfg.trainer.seed\n": "walks cfg.trainer.",
        "from ml_collections import ConfigDict\n": "mentions ConfigDict",
    }
    for source, reading in samples.items():
        assert reading in config_reads(source, readers), source
    assert (
        config_reads(
            "from jaxflow.configs.run_spec import RunSpec\ndef f(spec):\n    return spec.trainer.seed\n", readers
        )
        == []
    )


@pytest.mark.parametrize("path", _files(*BELOW_THE_EDGE), ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_below_the_edge_reads_a_config(path):
    assert config_reads(path.read_text(), config_readers()) == []


def test_functions_fit_on_a_screen():
    long = []
    for path in _files("."):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []
