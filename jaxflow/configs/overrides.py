"""Config keys and command-line overrides: :class:`ConfigError`, :func:`leaf_keys`, and
:func:`apply_overrides`, which parses ``key=value`` text to each key's type."""

from __future__ import annotations

import ast
import difflib
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ml_collections import ConfigDict

from jaxflow.configs.base import KEY_TYPES

# Element types of the sequence-valued keys.
ELEMENT_TYPES = {
    "trainer.logger": str,
    "jaxflow.placement.pool_sizes": int,
    "actor_rollout_ref.actor.optim.betas": float,
    "critic.optim.betas": float,
    "actor_rollout_ref.rollout.stop": str,
    "actor_rollout_ref.rollout.stop_token_ids": int,
    "algorithm.gdpo_reward_keys": str,
    "algorithm.gdpo_reward_weights": float,
}


class ConfigError(ValueError):
    """A config problem. ``problems`` lists ``(key, message)`` pairs; ``key`` is the first key."""

    def __init__(self, problems: Sequence[tuple[str, str]] | str, message: str | None = None):
        if isinstance(problems, str):
            problems = [(problems, message or "")]
        self.problems = list(problems)
        self.key = self.problems[0][0] if self.problems else ""
        super().__init__(self._format())

    def _format(self) -> str:
        lines = [f"{key}: {msg}" if key else msg for key, msg in self.problems]
        if len(lines) == 1:
            return lines[0]
        return f"{len(lines)} problems in the config:\n" + "\n".join(f"  - {line}" for line in lines)


# ----------------------------------------------------------------------------- keys


def leaf_keys(cfg: ConfigDict, prefix: str = "") -> list[str]:
    """Every dotted leaf key of ``cfg`` (in ConfigDict's key order: sorted within a group)."""
    out = []
    for name in cfg.keys():
        value = cfg[name]
        key = f"{prefix}{name}"
        if isinstance(value, ConfigDict):
            out.extend(leaf_keys(value, key + "."))
        else:
            out.append(key)
    return out


def get_value(cfg: ConfigDict, key: str) -> Any:
    """The value at dotted ``key``."""
    node: Any = cfg
    for part in key.split("."):
        node = node[part]
    return node


def with_values(cfg: ConfigDict, values: Mapping[str, Any]) -> ConfigDict:
    """A copy of ``cfg`` with typed ``values`` at their dotted keys (e.g. the auto-mapper's
    choice, recorded with the run; a command line sets them with `apply_overrides`)."""
    out = cfg.copy_and_resolve_references()
    with out.unlocked():
        for key, value in values.items():
            *parents, leaf = key.split(".")
            get_value(out, ".".join(parents))[leaf] = value
    return out


def suggest(key: str, candidates: Iterable[str]) -> str:
    """``"; did you mean A or B?"`` for the candidates closest to ``key`` (or "")."""
    candidates = list(candidates)
    close = difflib.get_close_matches(key, candidates, n=3, cutoff=0.6)
    if not close:  # right leaf name, wrong group (e.g. 'actor.lr' for 'actor.optim.lr')
        leaf = key.rsplit(".", 1)[-1]
        close = [c for c in candidates if c.rsplit(".", 1)[-1] == leaf][:3]
    if not close:
        leaves = {c.rsplit(".", 1)[-1]: c for c in candidates}
        close = [leaves[m] for m in difflib.get_close_matches(key.rsplit(".", 1)[-1], list(leaves), n=3, cutoff=0.75)]
    return f"; did you mean {' or '.join(close)}?" if close else ""


def _unknown_key(cfg: ConfigDict, key: str) -> ConfigError:
    return ConfigError(key, f"unknown config key{suggest(key, leaf_keys(cfg))}")


# ----------------------------------------------------------------------------- overrides

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
_NONE = ("none", "null", "~")


def type_name(typ: type, optional: bool) -> str:
    name = {
        bool: "bool (true/false/1/0)",
        int: "int",
        float: "float",
        str: "str",
        tuple: "tuple, e.g. (8, 8)",
        list: "list, e.g. [a,b] or a,b",
    }.get(typ, typ.__name__)
    return f"{name} or None" if optional else name


def _unquote(s: str) -> str:
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"":
        return s[1:-1]
    return s


def _parse_sequence(raw: str) -> list[Any]:
    s = raw.strip()
    if not s:
        return []
    try:
        value = ast.literal_eval(s)
    except (ValueError, SyntaxError):
        value = None
    else:
        if isinstance(value, (list, tuple)):
            return list(value)
        if not isinstance(value, (dict, set)):
            return [value]
    items = []
    for part in (p.strip() for p in s.strip("[]()").split(",")):
        if not part:
            continue
        try:
            items.append(ast.literal_eval(part))
        except (ValueError, SyntaxError):
            items.append(_unquote(part))
    return items


def _typed_items(items: list[Any], elem: type | None, bad: ConfigError) -> list[Any]:
    """A sequence's parsed items as ``elem`` (floats from ints too; strings from anything);
    ``bad`` raised for an item of another type."""
    if elem is float:
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in items):
            raise bad
        return [float(x) for x in items]
    if elem is None or all(type(x) is elem for x in items):
        return items
    if elem is str:
        return [str(x) for x in items]  # 'console,1' -> ['console', '1']
    raise bad


def parse_value(key: str, raw: str, typ: type, optional: bool = False, elem: type | None = None) -> Any:
    """``raw`` (command-line text) as a value of type ``typ`` (``elem``: the element type of a
    sequence, if known). Raises :class:`ConfigError` naming the key, the expected type and
    the value."""
    s = raw.strip()
    what = type_name(typ, optional) + (f" of {elem.__name__}" if elem and typ in (tuple, list) else "")
    bad = ConfigError(key, f"expected {what}, got {raw!r}")
    if s.lower() in _NONE and (optional or typ is type(None)):
        return None
    if typ is bool:
        if s.lower() in _TRUE:
            return True
        if s.lower() in _FALSE:
            return False
        raise bad
    if typ is int:
        if re.fullmatch(r"[+-]?\d[\d_]*", s):
            return int(s)
        raise bad
    if typ is float:
        try:
            return float(s)
        except ValueError:
            raise bad from None
    if typ is str:
        return _unquote(s)
    if typ in (tuple, list):
        return typ(_typed_items(_parse_sequence(s), elem, bad))
    if typ is type(None):  # a field the schema does not know whose value is None
        try:
            return ast.literal_eval(s)
        except (ValueError, SyntaxError):
            return _unquote(s)
    raise ConfigError(key, f"cannot override a field of type {typ.__name__} from the command line")


def _expected_type(parent: ConfigDict, leaf: str, key: str) -> tuple[type, bool]:
    typ = parent.get_type(leaf)
    value = parent[leaf]
    schema = KEY_TYPES.get(key)
    if typ is type(None) and schema is not None:
        typ = schema[0]
    optional = value is None or (schema is not None and schema[1])
    return typ, optional


def apply_overrides(cfg: ConfigDict, overrides: Iterable[str]) -> ConfigDict:
    """Applies ``["key.sub=value", ...]`` to ``cfg`` in place (and returns it).

    Each value is parsed to the existing key's type: bool (``true/false/1/0/yes/no``), int,
    float, str, tuple / list (a Python literal such as ``(8,8)`` or ``['a','b']``, or
    comma-separated ``a,b``), and ``None`` / ``null`` where the key is optional. A leading
    ``--config.`` or ``config.`` is ignored. Unknown keys raise :class:`ConfigError` naming the
    key and the closest valid keys; unparsable values name the key, the expected type and
    the value.
    """
    for item in overrides:
        text = item.strip()
        for prefix in ("--config.", "config."):
            if text.startswith(prefix):
                text = text[len(prefix) :]
        if "=" not in text:
            raise ConfigError(text or "<empty>", f"override {item!r} is not of the form key=value")
        key, raw = text.split("=", 1)
        key = key.strip()
        *parents, leaf = key.split(".")
        node = cfg
        for part in parents:
            if not isinstance(node, ConfigDict) or part not in node:
                raise _unknown_key(cfg, key)
            node = node[part]
        if not isinstance(node, ConfigDict) or leaf not in node:
            raise _unknown_key(cfg, key)
        if isinstance(node[leaf], ConfigDict):
            raise ConfigError(key, f"is a group of keys, not a value; set one of {leaf_keys(node[leaf], key + '.')}")
        typ, optional = _expected_type(node, leaf, key)
        current = node[leaf]
        elem = ELEMENT_TYPES.get(key) or (type(current[0]) if isinstance(current, (list, tuple)) and current else None)
        value = parse_value(key, raw, typ, optional, elem)
        try:
            node[leaf] = value
        except TypeError as e:
            raise ConfigError(key, f"expected {type_name(typ, optional)}, got {raw!r} ({e})") from None
    return cfg
