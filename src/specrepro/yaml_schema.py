"""Hand-written YAML specs (a table, a pipeline's headlines) read into dataclasses, their schema.

A dataclass's fields say what its YAML mapping may hold: a field without a default is required (or one whose
`optional(default)` gives the default a spec that leaves it out gets), any other key is refused, naming the
closest allowed one. A field's type says what its value may be: `str`, `float` (a number), `int`, `bool`, a
dataclass (a mapping), `list[<dataclass>]` (a non-empty list of such mappings), `X | None`, or
`Annotated[T, check]` where `check(value, where)` returns the value (as T) or raises `Invalid`. Every error is
one line naming the place (`rows[2].select`) and what is wrong.

Not OmegaConf's structured configs, which the Hydra configs use: a spec's values may hold `${NAME:-default}`
(environment variables the table code reads), which OmegaConf would resolve as its own interpolations, and
OmegaConf converts where a spec wants a refusal (`paper: 3` to "3", `scale: "2"` to 2.0)."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Annotated, Any, Callable


class Invalid(Exception):
    """A spec that does not fit its schema; the message says where (`rows[2].select`) and what is wrong."""


def kind(value) -> str:
    """What a value is, for a message: "a mapping", "a list", "null", or a scalar's type and value."""
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list" if value else "an empty list"
    kinds = {str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return f"{kinds.get(type(value), type(value).__name__)} {value!r:.40}"


def optional(default: Any) -> Any:
    """A dataclass field a spec may leave out, `default` then, though code that builds the dataclass gives it."""
    return dataclasses.field(metadata={"spec_default": default})


def mapping(value, where: str, required: tuple = (), optional: tuple = ()) -> dict:
    """`value` if it is a mapping; given `required`/`optional`, with every required key and no other."""
    if not isinstance(value, dict):
        raise Invalid(f"{where}: expected a mapping, got {kind(value)}")
    allowed = (*required, *optional)
    unknown = [key for key in value if key not in allowed] if allowed else []
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), allowed, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"allowed: {', '.join(allowed)}"
        raise Invalid(f"{where}: unknown key '{unknown[0]}' ({hint})")
    for key in required:
        if key not in value:
            raise Invalid(f"{where}: missing required key '{key}'")
    return value


def items(value, where: str) -> list:
    if not isinstance(value, list) or not value:
        raise Invalid(f"{where}: expected a non-empty list, got {kind(value)}")
    return value


def text(value, where: str) -> str:
    if not isinstance(value, str):
        raise Invalid(f"{where}: expected a string, got {kind(value)}")
    return value


def number(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Invalid(f"{where}: expected a number, got {kind(value)}")
    return float(value)


def integer(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise Invalid(f"{where}: expected an integer, got {kind(value)}")
    return value


def boolean(value, where: str) -> bool:
    if not isinstance(value, bool):
        raise Invalid(f"{where}: expected true or false, got {kind(value)}")
    return value


def label(value, where: str) -> str:
    """A label: a string, or a number (`[pld, 2]`), as a string."""
    if value is None or isinstance(value, (dict, list)):
        raise Invalid(f"{where}: expected a string or number, got {kind(value)}")
    return str(value)


def labels(value, where: str) -> list[str]:
    """One label or a list of them."""
    return [label(one, where) for one in (value if isinstance(value, list) else [value])]


def one_of(*allowed: str) -> Callable[[Any, str], str]:
    """A check that a value is one of the `allowed` strings."""

    def check(value, where: str) -> str:
        if value not in allowed:
            got = repr(value) if isinstance(value, str) else kind(value)
            raise Invalid(f"{where}: expected one of {', '.join(allowed)}, got {got}")
        return value

    return check


Label = Annotated[str, label]
Labels = Annotated[list, labels]
SCALARS: dict[type, Callable[[Any, str], Any]] = {str: text, float: number, int: integer, bool: boolean}


def build(schema: type, raw, where: str = "top level", **given):
    """The dataclass `schema` from a spec's parsed YAML mapping `raw` (its fields `given` set by the caller, not
    the spec), each value checked against its field's type; `Invalid` says what does not fit."""
    hints = typing.get_type_hints(schema, include_extras=True)
    fields = [f for f in dataclasses.fields(schema) if f.name not in given]
    has_default = [
        f.name
        for f in fields
        if f.default is not dataclasses.MISSING
        or f.default_factory is not dataclasses.MISSING
        or "spec_default" in f.metadata
    ]
    raw = mapping(
        raw, where, required=tuple(f.name for f in fields if f.name not in has_default), optional=tuple(has_default)
    )
    values = dict(given)
    for f in fields:
        inner = f.name if where == "top level" else f"{where}.{f.name}"
        if f.name in raw:
            values[f.name] = value_of(hints[f.name], raw[f.name], inner)
        elif "spec_default" in f.metadata:
            values[f.name] = value_of(hints[f.name], f.metadata["spec_default"], inner)
    return schema(**values)


def value_of(hint, value, where: str):
    """`value` checked against a field's type `hint` (see the module docstring)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        return hint.__metadata__[0](value, where)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        others = [arg for arg in args if arg is not type(None)]
        return None if value is None else value_of(others[0], value, where)
    if origin is list and dataclasses.is_dataclass(args[0]):
        return [build(args[0], one, f"{where}[{i}]") for i, one in enumerate(items(value, where))]
    if dataclasses.is_dataclass(hint):
        return build(hint, value, where)
    if hint in SCALARS:
        return SCALARS[hint](value, where)
    raise TypeError(f"{where}: the schema's type {hint!r} has no check")  # a schema's mistake, not a spec's
