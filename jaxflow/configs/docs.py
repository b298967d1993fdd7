"""Markdown reference of the config keys: ``python -m jaxflow.configs.docs [--config=NAME]``.

Prints the named configs, then one row per key (in :data:`jaxflow.configs.base.FIELDS` order)
with its default, or its value in ``NAME`` when ``--config`` is given, and its description.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from ml_collections import ConfigDict

from jaxflow.configs import NAMED, describe_named, get_config
from jaxflow.configs.base import FIELDS, KEY_DOCS, get_base_config
from jaxflow.configs.overrides import get_value


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def _cell(value: Any) -> str:
    if isinstance(value, str):
        text = f'"{value}"' if value == "" else value
    elif isinstance(value, float):
        text = f"{value:g}"
    elif isinstance(value, list):
        text = "[" + ", ".join(map(str, value)) + "]"
    else:
        text = str(value)
    return "`" + _escape(text) + "`"


def markdown_table(cfg: ConfigDict | None = None) -> str:
    """| key | default | description | for every key; with ``cfg``, its values instead of the
    defaults (column ``value``)."""
    header = "default" if cfg is None else "value"
    cfg = get_base_config() if cfg is None else cfg
    rows = [f"| key | {header} | description |", "| --- | --- | --- |"]
    for key, *_ in FIELDS:
        rows.append(f"| `{key}` | {_cell(get_value(cfg, key))} | {_escape(KEY_DOCS[key])} |")
    return "\n".join(rows)


def named_table() -> str:
    rows = ["| config | what it runs |", "| --- | --- |"]
    for line in describe_named().splitlines():
        name, _, doc = line.strip().partition(" ")
        rows.append(f"| `{name}` | {doc.strip()} |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name = None
    for arg in argv:
        if arg.startswith("--config="):
            name = arg.removeprefix("--config=")
        elif arg in ("-h", "--help"):
            print(__doc__.strip())
            return 0
        else:
            print(f"unknown argument {arg!r}; usage: python -m jaxflow.configs.docs [--config=NAME]", file=sys.stderr)
            return 2
    cfg = get_config(name) if name else None
    print(f"### Named configs ({len(NAMED)})\n\n{named_table()}\n")
    title = f"values in `{name}`" if name else "defaults"
    print(f"### Config keys ({len(FIELDS)}; {title})\n\n{markdown_table(cfg)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
