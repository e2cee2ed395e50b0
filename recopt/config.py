"""Strict TOML configs: parse a file, apply ``key.path=value`` overrides, build frozen dataclasses.

Each component owns its config dataclass; this module only turns nested dicts into them,
checking every key (an unknown key is an error naming it and the valid ones) and every
scalar's type, so a typo in a config file or on the command line never passes silently.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def load_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Reads a TOML file.

    Raises:
        ValueError: if the file is missing or is not valid TOML (naming the file).
    """
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as err:
        raise ValueError(f"config file {os.fspath(path)!r} cannot be read: {err}") from None
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"config file {os.fspath(path)!r} is not valid TOML: {err}") from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """Splits ``a.b.c=value`` into the key path and the value, read as a TOML value.

    ``steps=100`` gives an int, ``lr=0.1`` a float, ``bottom_mlp=[32, 16]`` a list and
    ``activation=relu`` (not valid TOML) the string ``"relu"``. A numeric path part indexes a list
    (``embedding.tables.0.embedding_dim=32``).

    Raises:
        ValueError: if there is no ``=`` or the key is empty.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ValueError(f"override {text!r} must look like section.key=value")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Returns a copy of ``data`` with each ``key.path=value`` override set.

    Missing intermediate tables are created (the dataclass check later rejects unknown
    names); list elements are addressed by index.

    Raises:
        ValueError: on a malformed override, or an index/table path that does not fit.
    """
    result = _deep_copy(data)
    for text in overrides:
        path, value = parse_override(text)
        node: Any = result
        for depth, part in enumerate(path[:-1]):
            node = _child(node, part, ".".join(path[: depth + 1]), text)
        last = path[-1]
        if isinstance(node, list):
            node[_list_index(node, last, ".".join(path), text)] = value
        elif isinstance(node, dict):
            node[last] = value
        else:
            raise ValueError(f"override {text!r}: {'.'.join(path[:-1])} is a value, not a table")
    return result


def _deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


def _child(node: Any, part: str, where: str, text: str) -> Any:
    if isinstance(node, list):
        return node[_list_index(node, part, where, text)]
    if not isinstance(node, dict):
        raise ValueError(f"override {text!r}: {where} is a value, not a table")
    return node.setdefault(part, {})


def _list_index(node: list[Any], part: str, where: str, text: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ValueError(
            f"override {text!r}: {where} must index the list (0..{len(node) - 1}), got {part!r}"
        )
    return int(part)


def to_plain(value: Any) -> Any:
    """A dataclass (recursively) as the nested dicts and lists TOML would give.

    Enums become their values and tuples lists, so ``from_dict(type(c), to_plain(c), "")``
    rebuilds ``c``; merging a file over ``to_plain(defaults)`` lets overrides reach defaults.
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, list | tuple):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    return value


def merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``update`` laid over it: tables merge key by key, anything else replaces."""
    result = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(result.get(key), dict):
            result[key] = merge(result[key], value)
        else:
            result[key] = value
    return result


def from_dict(cls: type[T], data: Mapping[str, Any], where: str) -> T:
    """Builds dataclass ``cls`` from ``data``, recursing into nested dataclass fields.

    Args:
        cls: a dataclass type.
        data: field name -> value (a TOML table).
        where: the table's path for messages (``"model"``, ``"embedding.tables[3]"``; ``""``
            for the top level).

    Returns:
        The instance; missing keys take the dataclass defaults.

    Raises:
        ValueError: naming ``where.key`` for an unknown key, a missing required key or a
            value of the wrong type (and the dataclass's own validation errors).
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"[{where}] must be a table, got {data!r}")
    prefix = f"{where}." if where else ""
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        names = ", ".join(f"{prefix}{k}" for k in unknown)
        raise ValueError(
            f"unknown config key {names}; valid keys {f'in [{where}]' if where else 'at the top'}"
            f": {sorted(fields)}"
        )
    hints = typing.get_type_hints(cls)
    kwargs = {key: convert(hints[key], value, f"{prefix}{key}") for key, value in data.items()}
    missing = [
        name
        for name, f in fields.items()
        if name not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ValueError(f"[{where}] is missing required keys {missing}")
    return cls(**kwargs)


def convert(hint: Any, value: Any, where: str) -> Any:
    """Checks ``value`` against type ``hint`` and converts it (lists to tuples, ints to floats).

    Raises:
        ValueError: naming ``where``, the value and the expected type.
    """
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return convert(option, value, where)
            except ValueError as err:
                errors.append(str(err))
        raise ValueError(errors[0] if len(errors) == 1 else f"{where}: {value!r} fits no type")
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return from_dict(hint, value, where)
    if origin in (tuple, list):
        if not isinstance(value, list | tuple):
            raise ValueError(f"{where} must be a list, got {value!r}")
        item_hints = args[:1] if origin is list or args[-1:] == (Ellipsis,) else args
        if origin is tuple and args and args[-1] is not Ellipsis and len(args) != len(value):
            raise ValueError(f"{where} must have {len(args)} items, got {value!r}")
        items = [
            convert(
                item_hints[min(i, len(item_hints) - 1)] if item_hints else Any, v, f"{where}[{i}]"
            )
            for i, v in enumerate(value)
        ]
        return tuple(items) if origin is tuple else items
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be a table, got {value!r}")
        return dict(value)
    return _scalar(hint, value, where)


def _scalar(hint: Any, value: Any, where: str) -> Any:
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            valid = [m.value for m in hint]
            raise ValueError(f"{where} = {value!r} is not one of {valid}") from None
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if hint in (int, str, bool) and type(value) is hint:
        return value
    name = getattr(hint, "__name__", str(hint))
    raise ValueError(f"{where} = {value!r} must be of type {name}")
