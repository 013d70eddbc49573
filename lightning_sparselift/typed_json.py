"""Strict decoding of parsed JSON into typed dataclasses: every value is checked against its
field's annotation, recursively; unknown keys and missing required keys are errors. The files we
read back (plans, graphs) are caches anyone can edit, so a wrong one must fail here, naming the
field, instead of deep inside the executor."""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, Literal, Union

_JSON_NAMES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}
_EXPECTED = {dict: "an object", list: "an array", str: "a string", int: "an integer", bool: "a boolean"}


def json_type(value: Any) -> str:
    """What ``value`` is, in JSON's words (for messages)."""
    return _JSON_NAMES.get(type(value), type(value).__name__)


def decode(tp: Any, value: Any, where: str = "") -> Any:
    """``value`` as a ``tp``; ValueError naming the field (``where``: its path) otherwise."""
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return _decode_dataclass(tp, value, where)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union:
        return _decode_union(args, value, where)
    if origin is Literal:
        if value not in args:
            raise ValueError(_at(where, f"expected one of {list(args)}, got {value!r}"))
        return value
    if origin is list:
        _expect(list, value, where)
        return [decode(args[0], item, f"{where}[{i}]") for i, item in enumerate(value)]
    if origin is tuple:
        _expect(list, value, where)
        if len(value) != len(args):
            raise ValueError(_at(where, f"expected {len(args)} items, got {len(value)}"))
        return tuple(decode(t, item, f"{where}[{i}]") for i, (t, item) in enumerate(zip(args, value)))
    if origin is dict:
        _expect(dict, value, where)
        return {decode(args[0], k, where): decode(args[1], v, f"{where}[{k!r}]") for k, v in value.items()}
    if tp is float:  # JSON does not tell 1 from 1.0
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(_at(where, f"expected a number, got {_got(value)}"))
        return value
    if tp in (int, str, bool):
        _expect(tp, value, where)
        return value
    raise TypeError(f"no JSON decoding for {tp!r} ({where})")


@functools.cache
def _fields(cls: type) -> dict[str, tuple[Any, bool]]:
    """name -> (resolved annotation, required)."""
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
            for f in dataclasses.fields(cls)}


def _decode_dataclass(cls: type, value: Any, where: str) -> Any:
    _expect(dict, value, where)
    fields = _fields(cls)
    unknown = sorted(set(value) - set(fields))
    missing = sorted(name for name, (_, required) in fields.items() if required and name not in value)
    if unknown or missing:
        problems = [f"missing key(s) {missing}"] * bool(missing) + [f"unknown key(s) {unknown}"] * bool(unknown)
        raise ValueError(_at(where, f"{cls.__name__}: " + ", ".join(problems)))
    kwargs = {name: decode(fields[name][0], item, f"{where}.{name}" if where else name) for name, item in value.items()}
    try:
        return cls(**kwargs)
    except ValueError as error:  # the class's own checks (__post_init__)
        raise ValueError(_at(where, str(error))) from error


def _decode_union(args: tuple[Any, ...], value: Any, where: str) -> Any:
    if value is None and type(None) in args:
        return None
    options = [a for a in args if a is not type(None)]
    if len(options) == 1:
        return decode(options[0], value, where)
    errors = []
    for option in options:
        try:
            return decode(option, value, where)
        except ValueError as error:
            errors.append(f"as {getattr(option, '__name__', option)}: {error}")
    raise ValueError(_at(where, "matches no alternative (" + "; ".join(errors) + ")"))


def _expect(tp: type, value: Any, where: str) -> None:
    # subclasses pass (torch.__version__ is a str), but True is not an integer here
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ValueError(_at(where, f"expected {_EXPECTED[tp]}, got {_got(value)}"))


def _got(value: Any) -> str:
    return json_type(value) if isinstance(value, (dict, list)) else f"{json_type(value)} {value!r:.40}"


def _at(where: str, message: str) -> str:
    return f"{where}: {message}" if where else message
