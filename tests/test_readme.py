"""The README's examples run, so the documentation cannot drift from the code.

Python blocks run in order in one namespace (like a notebook), in a temporary directory.
Shell commands: the cheap ones run (``--help``, the config docs, the export commands up to
looking for their checkpoints); the others are training runs or installs, too slow for a
test, so each ``python -m jaxflow.run`` line has its config built, its overrides applied and
the result validated (unknown, mistyped or inconsistent keys fail; the README's placeholders
for the user's files stand in as files), and the rest is matched against the kinds this test
knows, so that a new kind of command cannot slip by unchecked.
"""

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from jaxflow import configs

README = Path(__file__).resolve().parent.parent / "README.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.DOTALL)


def _commands() -> list[list[str]]:
    """Each shell command of the README's bash blocks as argv (comments dropped, ``\\``
    continuations joined, ``a && b`` split)."""
    out = []
    for block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            argv: list[str] = []
            for token in shlex.split(line, comments=True) + ["&&"]:
                if token != "&&":
                    argv.append(token)
                elif argv:
                    out.append(argv)
                    argv = []
    return out


def test_python_snippets_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme"}
    blocks = _blocks("python")
    assert len(blocks) >= 4
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)
        except Exception as e:  # re-raised with the block that failed
            raise AssertionError(f"README python block {i + 1} failed:\n{block}") from e
    # the reward function example scores as documented
    assert namespace["compute_score"]("jaxflow/reverse_digits", " 413", "413") == 1.0
    # the algorithm program is only defined (it needs worker groups): the functions it names exist
    from jaxflow import algos, iterations

    for module in (algos, iterations):
        named = set(re.findall(rf"\b{module.__name__.split('.')[-1]}\.(\w+)", "\n".join(blocks)))
        assert all(hasattr(module, name) for name in named), named - set(dir(module))
    for key in re.findall(r"\bcfg\.(algorithm(?:\.\w+)+)", "\n".join(blocks)):
        configs.get_config("ppo_tiny")[key]  # a real config key (KeyError otherwise)


def _run_module(main, argv) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse's --help
            rc = e.code
    return rc, out.getvalue()


def _stand_in(override: str, tmp_path: Path) -> str:
    """``key=value`` with the README's placeholders for the user's own files (``/data/...``,
    ``/models/...``) standing in under ``tmp_path`` (data files exist, empty)."""
    key, value = override.split("=", 1)
    if not value.startswith(("/data/", "/models/")):
        return override
    path = tmp_path / value.lstrip("/")
    if path.suffix in (".parquet", ".jsonl"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    return f"{key}={path}"


def test_shell_commands(tmp_path, monkeypatch, capsys):
    from jaxflow.configs.docs import main as docs_main
    from jaxflow.export import main as export_main
    from jaxflow.run import main as run_main

    # The README's reward file, where its commands expect it (the working directory).
    monkeypatch.chdir(tmp_path)
    (reward,) = [b for b in _blocks("python") if b.startswith("# my_reward.py")]
    (tmp_path / "my_reward.py").write_text(reward)
    kinds = {"run": 0, "ran": 0, "install": 0}
    for argv in _commands():
        exe = Path(argv[0]).name
        if exe in ("python", "python3") and argv[1:3] == ["-m", "venv"] or exe == "pip" or argv[1:3] == ["-m", "pip"]:
            kinds["install"] += 1
            continue
        assert exe in ("python", "python3") and argv[1] == "-m", f"README command not understood: {argv}"
        module, args = argv[2], argv[3:]
        if module == "pytest":
            kinds["install"] += 1  # the test suite itself
            continue
        if module == "jaxflow.configs.docs":
            rc, out = _run_module(docs_main, args)
            assert rc == 0 and "data.train_batch_size" in out
            kinds["ran"] += 1
        elif "--help" in args:
            rc, out = _run_module({"jaxflow.run": run_main, "jaxflow.export": export_main}[module], args)
            assert rc == 0 and "usage" in out.lower(), out
            kinds["ran"] += 1
        elif module == "jaxflow.run":
            name, overrides, rest = configs.parse_cli_args(args)
            assert set(rest) <= {"--dry_run"}, rest
            if "path/to" in name:  # "--config=path/to/my_config.py": any file with get_config()
                continue
            cfg = configs.get_config(name)
            configs.apply_overrides(cfg, [_stand_in(o, tmp_path) for o in overrides])
            with cfg.unlocked():
                cfg.jaxflow.dry_run.enable = "--dry_run" in rest
            try:
                configs.validate(cfg)  # what the command runs with: every key's value checked
            except configs.ConfigError as e:
                raise AssertionError(f"README command does not validate: {' '.join(argv)}") from e
            kinds["run"] += 1
        elif module == "jaxflow.export":
            # Without the run's checkpoints (too slow to train here) the command gets as far as
            # looking for them: its arguments parse, and the answer is one line naming the file.
            rc, out = _run_module(export_main, args)
            err = capsys.readouterr().err
            assert rc == 2 and err.startswith("error: ") and "config.json not found" in err, (argv, out, err)
            kinds["ran"] += 1
        else:
            pytest.fail(f"README runs an unknown module: {argv}")
    assert kinds["ran"] >= 3 and kinds["run"] >= 5 and kinds["install"] >= 2, kinds
