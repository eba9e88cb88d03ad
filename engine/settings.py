"""One definition per setting: a frozen dataclass field that carries its help and its bounds.

A settings group is a dataclass next to the code that owns it (``MigrationConfig`` beside live
migration, ...). Each field is made with ``setting``, which records the default, a one-line help
text and the bounds in the field's metadata (``nested`` for a field that holds another group).
From that one definition:

- ``check(obj)`` validates an instance (call it from ``__post_init__``): a value out of bounds
  or of the wrong type raises ValueError naming the group, the field and what is accepted;
- the serve config file's section (cluster/launch/config_file.py) is generated from the
  dataclass, so a file key, its type, default, bounds and the docs/config.md row cannot drift
  from the code;
- ``bound_problem`` words a broken bound the same way for ``tandem serve``'s flags.

No pydantic here: this module sits in the engine layer, which every worker imports.
"""

from __future__ import annotations

import dataclasses
import operator
import types
import typing
from typing import Any

_BOUNDS = {
    "ge": (operator.ge, ">="),
    "gt": (operator.gt, ">"),
    "le": (operator.le, "<="),
    "lt": (operator.lt, "<"),
}


def setting(default: Any, help: str, **bounds: float) -> Any:
    """A dataclass field with ``default``, ``help`` (one line, for the config reference) and
    bounds (``ge``, ``gt``, ``le``, ``lt``)."""
    unknown = set(bounds) - set(_BOUNDS)
    if unknown:
        raise TypeError(f"unknown bounds {sorted(unknown)}; use {', '.join(_BOUNDS)}")
    return dataclasses.field(default=default, metadata={"help": help, **bounds})


def nested(factory: Any, help: str) -> Any:
    """A field holding another settings group (made by ``factory``), with ``help``. Its file
    section is that group's own section; keys left out keep the group's defaults."""
    return dataclasses.field(default_factory=factory, metadata={"help": help})


def help_of(f: dataclasses.Field) -> str:
    return f.metadata.get("help", "")


def bounds_of(f: dataclasses.Field) -> dict[str, float]:
    return {k: f.metadata[k] for k in _BOUNDS if k in f.metadata}


def check(obj: Any) -> None:
    """Raise ValueError if a field of the settings dataclass ``obj`` has the wrong type or lies
    outside its bounds (an int field takes no bool; a float field takes an int; a ``Literal``
    field one of its values; an optional field None, unchecked)."""
    hints = typing.get_type_hints(type(obj))
    name = type(obj).__name__
    for f in dataclasses.fields(obj):
        value, kind = getattr(obj, f.name), hints.get(f.name)
        args = typing.get_args(kind)
        if value is None and type(None) in args:
            continue
        if typing.get_origin(kind) in (typing.Union, types.UnionType):
            kind = next(a for a in args if a is not type(None))
        if typing.get_origin(kind) is typing.Literal:
            if value not in typing.get_args(kind):
                choices = ", ".join(map(str, typing.get_args(kind)))
                raise ValueError(f"{name}.{f.name} must be one of {choices}, got {value!r}")
            continue
        if kind is bool and not isinstance(value, bool):
            raise ValueError(f"{name}.{f.name} must be true or false, got {value!r}")
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{name}.{f.name} must be an integer, got {value!r}")
        if kind is float and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError(f"{name}.{f.name} must be a number, got {value!r}")
        if problem := bound_problem(value, bounds_of(f)):
            raise ValueError(f"{name}.{f.name} {problem}, got {value!r}")


def bound_problem(value: float, bounds: dict[str, float]) -> str | None:
    """What ``value`` breaks of ``bounds`` (``{"ge": 1}``): ``"must be >= 1"``; None when it
    holds them all. The config checks here and ``tandem serve``'s number flags say the same."""
    for op, limit in bounds.items():
        holds, sign = _BOUNDS[op]
        if not holds(value, limit):
            return f"must be {sign} {limit:g}"
    return None
