"""What every section of the gateway's config shares: the strict frozen base, value checks, and the key style.

Every key of the gateway's YAML is **snake_case**, exactly the Python field name (as vLLM's and SGLang's flags and
the Helm chart's values spell them). Three sections used to take kebab-case keys (``events.subscriber``, ``index``
and ``index.groups[]``); ``rename_deprecated_keys`` still accepts those for one release: a kebab-case key whose
snake_case form is a field of its section is renamed before decoding, and each such key is reported once per load
(``router.config.parse_config`` logs a warning naming the new key).
"""

from __future__ import annotations

import math
from typing import Annotated, Any

import msgspec

__all__ = [
    "AtLeastOne",
    "Count",
    "NonNegativeSeconds",
    "Port",
    "PositiveFactor",
    "PositiveSeconds",
    "ConfigStruct",
    "DeprecatedKey",
    "check_finite",
    "check_non_negative",
    "check_positive",
    "non_finite_value",
    "rename_deprecated_keys",
]


PositiveSeconds = Annotated[float, msgspec.Meta(gt=0.0)]
"""A duration in seconds, > 0 (and finite: ``parse_config`` and ``__post_init__`` refuse NaN and infinity)."""
NonNegativeSeconds = Annotated[float, msgspec.Meta(ge=0.0)]
"""A duration in seconds, >= 0 (and finite)."""
PositiveFactor = Annotated[float, msgspec.Meta(gt=0.0)]
"""A dimensionless factor, > 0 (and finite)."""
AtLeastOne = Annotated[int, msgspec.Meta(ge=1)]
"""A count or size, >= 1."""
Count = Annotated[int, msgspec.Meta(ge=0)]
"""A count, >= 0 (0 often meaning "unlimited" or "off": each field says)."""
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
"""A TCP port, 0..65535 (0: the system picks a free one)."""


class ConfigStruct(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Frozen, strict struct base for every gateway config section: unknown keys are refused, fields are keyword
    only, and the YAML key of a field is its name (snake_case)."""


def check_finite(name: str, value: float) -> None:
    """Refuse NaN and infinities (YAML ``.nan``, ``.inf``): every comparison with NaN is false, so range checks
    alone let it through, and no key of the config gives infinity a meaning.

    Raises:
        ValueError: ``"<name> must be a finite number, got <value>"``.
    """
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")


def check_positive(name: str, value: float) -> None:
    """Refuse a non-finite value or one that is not > 0.

    Raises:
        ValueError: naming ``name`` and the value.
    """
    check_finite(name, value)
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def check_non_negative(name: str, value: float) -> None:
    """Refuse a non-finite value or one below 0.

    Raises:
        ValueError: naming ``name`` and the value.
    """
    check_finite(name, value)
    if not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def non_finite_value(obj: object) -> tuple[str, float] | None:
    """The key path (``$.timeouts.first_byte_s``) and value of the first NaN or infinite float in parsed YAML/JSON
    builtins (mappings, lists, scalars), or ``None`` when there is none.

    Walks without recursion and visits each container once (a YAML alias can make a list contain itself).
    """
    stack: list[tuple[str, object]] = [("$", obj)]
    seen: set[int] = set()
    while stack:
        path, value = stack.pop()
        if isinstance(value, float):
            if not math.isfinite(value):
                return path, value
        elif isinstance(value, dict | list | tuple):
            if id(value) in seen:
                continue
            seen.add(id(value))
            if isinstance(value, dict):
                children = [(f"{path}.{key}", child) for key, child in value.items()]
            else:
                children = [(f"{path}[{i}]", child) for i, child in enumerate(value)]
            stack.extend(reversed(children))
    return None


class DeprecatedKey(msgspec.Struct, frozen=True):
    """An old-style (kebab-case) key found and renamed.

    Attributes:
        old: its path as written, list positions as ``[]`` (``index.groups[].sliding-window-tokens``).
        new: the path of the key to write instead (``index.groups[].sliding_window_tokens``).
    """

    old: str
    new: str


def rename_deprecated_keys(obj: object, cls: type[msgspec.Struct]) -> tuple[object, tuple[DeprecatedKey, ...]]:
    """``obj`` (YAML/JSON builtins to be decoded as ``cls``) with every kebab-case key whose snake_case form is a
    field of its struct renamed to that field, and the renamed keys, each once, in the order found.

    Follows nested structs, optional and tagged-union struct fields (the tag picks the struct) and lists/tuples
    of structs; free-form mappings are left as they are. ``obj`` itself is never modified: a renamed mapping is a
    copy. A key whose snake_case form is also given in the same mapping is left alone, so the decoder refuses it
    as an unknown key.

    Returns:
        ``(renamed obj, deprecated keys)``; ``obj`` itself when nothing was renamed.
    """
    found: dict[str, DeprecatedKey] = {}
    renamed = _walk(msgspec.inspect.type_info(cls), obj, "", found, {})
    return renamed, tuple(found.values())


def _struct_of(info: msgspec.inspect.Type, value: object) -> msgspec.inspect.StructType | None:
    """The struct type ``value`` decodes as under ``info`` (a struct, or a union holding structs), if any."""
    if isinstance(info, msgspec.inspect.StructType):
        return info
    if not isinstance(info, msgspec.inspect.UnionType):
        return None
    structs = [t for t in info.types if isinstance(t, msgspec.inspect.StructType)]
    if len(structs) == 1:
        return structs[0]
    if isinstance(value, dict):
        for struct in structs:
            if struct.tag_field is not None and value.get(struct.tag_field) == struct.tag:
                return struct
    return None


def _items_of(info: msgspec.inspect.Type) -> msgspec.inspect.Type | None:
    """The element type of a list/tuple type (or of the sequence branch of a union), if any."""
    for t in info.types if isinstance(info, msgspec.inspect.UnionType) else (info,):
        if isinstance(t, msgspec.inspect.VarTupleType | msgspec.inspect.ListType):
            return t.item_type
    return None


def _walk(info: msgspec.inspect.Type, value: object, path: str, found: dict[str, DeprecatedKey],
          memo: dict[int, object]) -> object:
    """``value`` renamed under ``info``; ``memo`` maps a container already visited (a YAML alias repeats one) to
    its result, and a container still being walked (one that contains itself) to itself."""
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, list | tuple):
        item = _items_of(info)
        if item is None:
            return value
        memo[id(value)] = value
        items = [_walk(item, v, f"{path}[]", found, memo) for v in value]
        result: object = items if any(a is not b for a, b in zip(items, value, strict=True)) else value
        memo[id(value)] = result
        return result
    struct = _struct_of(info, value)
    if struct is None or not isinstance(value, dict):
        return value
    memo[id(value)] = value
    fields = {f.encode_name: f for f in struct.fields}
    out: dict[Any, Any] = {}
    changed = False
    for key, child in value.items():
        new_key = key
        if isinstance(key, str) and key not in fields and "-" in key:
            snake = key.replace("-", "_")
            if snake in fields and snake not in value:
                new_key = snake
                old_path, new_path = f"{path}.{key}".lstrip("."), f"{path}.{snake}".lstrip(".")
                found.setdefault(old_path, DeprecatedKey(old_path, new_path))
        field = fields.get(new_key)
        new_child = _walk(field.type, child, f"{path}.{new_key}", found, memo) if field is not None else child
        changed |= new_key is not key or new_child is not child
        out[new_key] = new_child
    memo[id(value)] = out if changed else value
    return memo[id(value)]
