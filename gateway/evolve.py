"""`evolve`: `dataclasses.replace` for the request path's frozen, slotted records.

A request is replaced five times on its way (salt, shadow fields, lint findings, the answer's
replica, its usage). `dataclasses.replace` looks the fields up and runs `__init__` with every
one as a keyword, each set through `object.__setattr__`: 11-12 us for a `ChatRequest` here.
`evolve` copies the slots straight into a new instance with one function made per class (as
`dataclasses` makes `__init__`): 5 us. It is a copy, so what `__init__` would do beyond setting
fields is not done; the records it serves have no `__post_init__` (checked when the function
is made), and every change must name a field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_COPIERS: dict[type, Callable[..., Any]] = {}


def evolve(obj: T, **changes: Any) -> T:
    """A copy of the dataclass instance `obj` with `changes` (field name -> value)."""
    cls = type(obj)
    copier = _COPIERS.get(cls)
    if copier is None:
        copier = _COPIERS[cls] = _copier(cls)
    return copier(obj, changes)  # type: ignore[no-any-return]


def _copier(cls: type) -> Callable[[Any, dict[str, Any]], Any]:
    """`copy(obj, changes)` for `cls`: a new instance, each field from `changes` or `obj`."""
    if not dataclasses.is_dataclass(cls) or "__slots__" not in cls.__dict__:
        raise TypeError(f"evolve needs a slotted dataclass, not {cls.__name__}")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__} has a __post_init__: use dataclasses.replace")
    names = [f.name for f in dataclasses.fields(cls)]
    lines = ["def copy(obj, changes):",
             "    if not changes.keys() <= _fields:",
             "        raise TypeError(f'not fields of {_cls.__name__}: '"
             " f'{sorted(changes.keys() - _fields)}')",
             "    new = _new(_cls)"]
    lines += [f"    _set(new, {n!r}, changes[{n!r}] if {n!r} in changes else obj.{n})"
              for n in names]
    lines.append("    return new")
    scope: dict[str, Any] = {"_new": object.__new__, "_set": object.__setattr__,
                             "_cls": cls, "_fields": frozenset(names)}
    exec("\n".join(lines), scope)  # noqa: S102 - the source is built from field names only
    copy: Callable[[Any, dict[str, Any]], Any] = scope["copy"]
    return copy
