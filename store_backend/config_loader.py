"""The one way a config is read: files, ``MOONCAKE_KV_*`` variables, size strings, typed decoding.

Every config of the project (the store's :class:`store_backend.config.StoreConfig`, the connectors'
``ConnectorConfig``, the SGLang backend's own keys) is a msgspec Struct with
``forbid_unknown_fields``, and every one is read through the functions here:

* :func:`read_file`: a JSON (``.json``) or YAML (anything else) file holding one mapping.
* :func:`env_overrides`: ``MOONCAKE_KV_<PATH>`` variables, one naming rule for every config: the
  path of a field, upper case, ``__`` between levels (``MOONCAKE_KV_DRAM__CAPACITY_BYTES=4GiB`` sets
  ``dram.capacity_bytes``). A value is JSON when it parses as JSON (numbers, booleans, null), else
  text; a field that only takes text (``revision``, ``ssd.path``) always gets the text as written. :data:`CONFIG_FILE_ENV` (``MOONCAKE_KV_CONFIG``) names a config file instead.
* :func:`parse_size`: ``"512MiB"``, ``"4GB"``, ``4096`` into bytes. Every field whose name ends in
  ``_bytes`` takes such a string; :func:`decode` parses them, so sizes mean the same everywhere.
* :func:`decode`: plain data into the Struct; every error (a type, an unknown field, a value outside
  a closed choice, a check in a Struct's ``__post_init__``) becomes one :class:`ConfigError` whose
  message starts with the field's full path (``ssd.backend: unknown value 'tape' (known: ...)``).

A Struct's ``__post_init__`` reports a bad field as ``ValueError("<field>: <reason>")``; decode puts
the section's path in front of it. Pure functions, no state: call from any thread.
"""

from __future__ import annotations

import json
import os
import re
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import yaml

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

ENV_PREFIX = "MOONCAKE_KV_"
# Names the config file read when none is given (a store config, or a whole connector config).
CONFIG_FILE_ENV = ENV_PREFIX + "CONFIG"

S = TypeVar("S", bound=msgspec.Struct)


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the reason."""


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "KIB": KiB, "M": 10**6, "MB": 10**6, "MIB": MiB,
          "G": 10**9, "GB": 10**9, "GIB": GiB, "T": 10**12, "TB": 10**12, "TIB": 1024 * GiB}


def parse_size(text: str | int) -> int:
    """Bytes in ``"512MiB"``, ``"4GB"``, ``"4096"`` (or an int, returned as is); raises ValueError."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = _SIZE_RE.match(text) if isinstance(text, str) else None
    unit = (m.group(2) or "").upper() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 512MiB, 4GB)")
    return int(float(m.group(1)) * _UNITS[unit])


def read_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The mapping in a JSON or YAML file (an empty file is ``{}``); raises ConfigError naming it."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror or e}") from None
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:  # json.JSONDecodeError is a ValueError
        raise ConfigError(f"cannot parse config file {p}: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"config file {p} must hold a mapping, not {type(data).__name__}")
    return dict(data)


def _env_value(text: str, field_type: Any) -> Any:
    if _text_only(field_type):
        return text  # a revision "1234567" or a path "1e5" stays text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _text_only(tp: Any) -> bool:
    """Whether a field of type ``tp`` takes a string and no number or boolean."""
    args = set(typing.get_args(tp)) if typing.get_args(tp) else {tp}
    return str in args and not args & {int, float, bool}


def env_overrides(
    cls: type[msgspec.Struct],
    environ: Mapping[str, str] | None = None,
    *,
    exclude: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """Nested dict of the ``MOONCAKE_KV_A__B=v`` variables whose first level names a field of ``cls``.

    Variables whose first level is no field of ``cls`` (or is in ``exclude``) are left alone:
    ``MOONCAKE_KV_CONFIG``, the scripts' ``MOONCAKE_KV_VENV``, another config's fields. Below the
    first level every name is kept, so a typo there is refused by :func:`decode` naming it.
    """
    environ = os.environ if environ is None else environ
    top = frozenset(cls.__struct_fields__) - exclude
    out: dict[str, Any] = {}
    for name, raw in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX) or name == CONFIG_FILE_ENV:
            continue
        parts = [p.lower() for p in name[len(ENV_PREFIX):].split("__") if p]
        if not parts or parts[0] not in top:
            continue
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{name}: {p} is both a value and a section")
        parent = _struct_at(cls, parts[:-1])
        node[parts[-1]] = _env_value(raw, _field_types(parent).get(parts[-1]))
    return out


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``over`` on top, section by section (a key of ``over`` wins)."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def _sizes(obj: Any, path: str = "") -> Any:
    """Size strings in ``*_bytes`` fields turned into ints, recursively."""
    if isinstance(obj, msgspec.Struct):
        obj = msgspec.to_builtins(obj)
    if not isinstance(obj, Mapping):
        return obj
    out = {}
    for k, v in obj.items():
        here = f"{path}.{k}" if path else str(k)
        if isinstance(k, str) and k.endswith("_bytes") and isinstance(v, str):
            try:
                v = parse_size(v)
            except ValueError as e:
                raise ConfigError(f"{here}: {e}") from None
        out[k] = _sizes(v, here)
    return out


def decode(data: Mapping[str, Any] | msgspec.Struct, cls: type[S]) -> S:
    """Build and validate ``cls`` from plain data (sizes parsed); raises ConfigError naming the field."""
    if not isinstance(data, (Mapping, msgspec.Struct)):
        raise ConfigError(f"a {cls.__name__} must be a mapping, not {type(data).__name__}")
    plain = _sizes(data)
    try:
        return msgspec.convert(plain, cls, str_keys=True)
    except msgspec.ValidationError as e:
        raise ConfigError(explain(str(e), plain, cls)) from None


# msgspec's messages: "<what> - at `$.a.b[0]`" (no " - at" for the top level).
_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_PART = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>[^`]+)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<name>[^`]+)`$")
_ENUM = re.compile(r"^Invalid enum value (?P<value>.+)$")
_EXPECTED = re.compile(r"^Expected `(?P<want>[^`]+)`, got `(?P<got>[^`]+)`")
_OWN = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*): (?P<reason>.+)$", re.DOTALL)

_MISSING_VALUE = object()


def _dotted(parts: list[str | int]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def _struct_in(tp: Any) -> type[msgspec.Struct] | None:
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return tp
    for arg in typing.get_args(tp):
        found = _struct_in(arg)
        if found is not None:
            return found
    return None


def _field_types(cls: type[msgspec.Struct] | None) -> dict[str, Any]:
    return {} if cls is None else {f.name: f.type for f in msgspec.structs.fields(cls)}


def _struct_at(cls: type[msgspec.Struct], parts: Sequence[str | int]) -> type[msgspec.Struct] | None:
    current: type[msgspec.Struct] | None = cls
    for p in parts:
        if isinstance(p, int) or current is None:
            return None
        current = _struct_in(_field_types(current).get(p))
    return current


def _value_at(data: Any, parts: list[str | int]) -> Any:
    for p in parts:
        try:
            data = data[p]
        except (KeyError, IndexError, TypeError):
            return _MISSING_VALUE
    return data


def _choices(tp: Any) -> list[Any]:
    if typing.get_origin(tp) is typing.Literal:
        return list(typing.get_args(tp))
    return [c for arg in typing.get_args(tp) for c in _choices(arg)]


def explain(message: str, data: Any, cls: type[msgspec.Struct]) -> str:
    """Rewrite a msgspec validation message as ``<full.field.path>: <reason>``, naming the bad value."""
    m = _AT.match(message)
    assert m is not None  # the pattern matches any text
    msg = m.group("msg")
    parts: list[str | int] = [a if a else int(b) for a, b in _PART.findall(m.group("path") or "")]
    if u := _UNKNOWN.match(msg):
        known = ", ".join(_field_types(_struct_at(cls, parts)))
        return f"{_dotted([*parts, u.group('name')])}: unknown field (known: {known})"
    if r := _MISSING.match(msg):
        return f"{_dotted([*parts, r.group('name')])}: required"
    if e := _ENUM.match(msg):
        parent = _struct_at(cls, parts[:-1]) if parts and isinstance(parts[-1], str) else None
        allowed = _choices(_field_types(parent).get(parts[-1])) if parent is not None else []
        known = f" (known: {', '.join(repr(c) for c in allowed)})" if allowed else ""
        return f"{_dotted(parts)}: unknown value {e.group('value')}{known}"
    if x := _EXPECTED.match(msg):
        value = _value_at(data, parts)
        shown = "" if value is _MISSING_VALUE else f" {value!r}"
        return f"{_dotted(parts)}: expected {x.group('want')}, got {x.group('got')}{shown}"
    own = _OWN.match(msg)
    if own and own.group("name") in _field_types(_struct_at(cls, parts)):
        return f"{_dotted([*parts, own.group('name')])}: {own.group('reason')}"
    return f"{_dotted(parts)}: {msg}" if parts else msg
