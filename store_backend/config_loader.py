"""The one way a config is read: files, ``MOONCAKE_KV_*`` variables, size strings, typed decoding.

Every config of the project (the store's :class:`store_backend.config.StoreConfig`, the connectors'
``ConnectorConfig``, the SGLang backend's own keys) is a msgspec Struct with
``forbid_unknown_fields``, and every one is read through the functions here:

* :func:`read_file`: a JSON (``.json``) or YAML (anything else) file holding one mapping.
* :func:`env_overrides`: ``MOONCAKE_KV_<PATH>`` variables, one naming rule for every config: the
  path of a field, upper case, ``__`` between levels (``MOONCAKE_KV_DRAM__CAPACITY_BYTES=4GiB`` sets
  ``dram.capacity_bytes``). A value is JSON when it parses as JSON (numbers, booleans, null, a
  quoted string), else text. A field that only takes text (``revision``, ``ssd.path``,
  ``eviction_policy``) gets the text as written, except ``null`` (None, for a field that may be
  unset) and a JSON string (``'"lru"'`` is ``lru``). :data:`CONFIG_FILE_ENV` (``MOONCAKE_KV_CONFIG``)
  names a config file instead.
* :func:`check_variables`: refuses the ``MOONCAKE_KV_*`` names a user may write for a setting that
  none reads (``MOONCAKE_KV_STORE__...``, ``MOONCAKE_KV_CONFIG_FILE``) and logs a warning, with the
  nearest setting's name, for another name that matches no setting (the environment is shared with
  other tools, so that is no error).
* :func:`parse_size`: ``"512MiB"``, ``"4GB"``, ``4096`` into bytes, exactly (K, M, G, T are powers
  of 1000; KiB, MiB, GiB, TiB powers of 1024). Every field whose name ends in ``_bytes`` takes such a
  string; :func:`decode` parses them, so sizes mean the same everywhere.
* :func:`decode`: plain data into the Struct; every error (a type, an unknown field, a value outside
  a closed choice, a check in a Struct's ``__post_init__``, a non-finite ``*_s`` timeout, a key that
  is not text) becomes one :class:`ConfigError` whose message starts with the field's full path
  (``ssd.backend: unknown value 'tape' (known: ...)``) and, when the caller says where each layer
  came from, ends with the variable or file that set it.

A Struct's ``__post_init__`` reports a bad field as ``ValueError("<field>: <reason>")``; decode puts
the section's path in front of it. Pure functions, no state: call from any thread.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
import re
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from fractions import Fraction
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

logger = logging.getLogger(__name__)

# MOONCAKE_KV_* variables of the project that are no config setting (the scripts' and tests'), so
# check_variables does not warn about them.
PROJECT_VARIABLES = frozenset({
    ENV_PREFIX + "VENV", ENV_PREFIX + "TORCH_INDEX", ENV_PREFIX + "SGLANG_CONFIG", ENV_PREFIX + "SGLANG_EXTRAS",
    ENV_PREFIX + "TRACES", ENV_PREFIX + "TEST_WORKERS", ENV_PREFIX + "TEST_FRESH_ENGINES",
})
# Names a user may well write that no loader reads: refused, naming the one to set instead.
_REFUSED_VARIABLES = {
    ENV_PREFIX + "CONNECTOR_CONFIG": f"renamed, set {CONFIG_FILE_ENV} instead (it names the same file)",
    ENV_PREFIX + "CONFIG_FILE": f"not read, set {CONFIG_FILE_ENV} instead (it names the config file)",
    ENV_PREFIX + "STORE": ("not read: the store section is set field by field "
                           f"({ENV_PREFIX}DRAM__CAPACITY_BYTES, ...) or by a file ({CONFIG_FILE_ENV})"),
}
_STORE_PREFIX = ENV_PREFIX + "STORE__"
# First-level settings of the engines' configs (the connector's, SGLang's) whose names are close to
# a store setting's: a process that reads only the store's (a node service) does not take them for
# a misspelt store setting. tests/test_config_loader.py holds every engine setting to being quiet.
OTHER_CONFIGS_SETTINGS = frozenset({"load_policy"})


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the reason."""


# ASCII digits only (str.isdigit and \d accept other scripts' digits); \Z, not $ (which also
# matches before a final newline).
_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?i?B?)?\s*\Z", re.IGNORECASE | re.ASCII)
_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "KIB": KiB, "M": 10**6, "MB": 10**6, "MIB": MiB,
          "G": 10**9, "GB": 10**9, "GIB": GiB, "T": 10**12, "TB": 10**12, "TIB": 1024 * GiB}


def parse_size(text: str | int) -> int:
    """Bytes in ``"512MiB"``, ``"4GB"``, ``"4096"`` (or an int, returned as is); raises ValueError.

    Exact: the number is read as a fraction, never a float, and must come to a whole number of
    bytes (``"1.5KiB"`` is 1536, ``"0.5B"`` is refused). K, M, G, T are decimal, KiB... binary.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = _SIZE_RE.match(text) if isinstance(text, str) else None
    unit = (m.group(2) or "").upper() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 512MiB, 4GB)")
    size = Fraction(m.group(1)) * _UNITS[unit]
    if size.denominator != 1:
        raise ValueError(f"not a whole number of bytes: {text!r} is {float(size)} bytes")
    return int(size)


def read_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The mapping in a JSON or YAML file (an empty file is ``{}``); raises ConfigError naming it."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8-sig")  # a byte-order mark, which some editors write, is skipped
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"cannot read config file {p}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    try:
        data = json.loads(text) if p.suffix.lower() == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:  # json.JSONDecodeError is a ValueError
        raise ConfigError(f"cannot parse config file {p}: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"config file {p} must hold a mapping, not {type(data).__name__}")
    return dict(data)


def _env_value(text: str, field_type: Any) -> Any:
    if _text_only(field_type):
        # A revision "1234567" or a path "1e5" stays text; null unsets a field that may be unset (a
        # text "null" there would be a model_id that turns off the weights stamp); '"lru"' is lru.
        if text == "null" and type(None) in typing.get_args(field_type):
            return None
        if text.startswith('"'):
            try:
                value = json.loads(text)
            except ValueError:
                return text
            return value if isinstance(value, str) else text
        return text
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


def _variable_names(cls: type[msgspec.Struct], exclude: frozenset[str], prefix: str = ENV_PREFIX) -> Iterator[str]:
    """Every variable that names a field or section of ``cls``."""
    for name, tp in _field_types(cls).items():
        if name in exclude:
            continue
        here = prefix + name.upper()
        yield here
        inner = _struct_in(tp)
        if inner is not None:
            yield from _variable_names(inner, frozenset(), here + "__")


def check_variables(
    environ: Mapping[str, str],
    configs: Sequence[tuple[type[msgspec.Struct], frozenset[str]]],
    *,
    warn_any: bool,
) -> None:
    """Refuse or warn about ``MOONCAKE_KV_*`` variables that no field of ``configs`` reads.

    ``configs``: every (Struct, first-level names not set by a variable) whose fields the caller
    reads from ``environ``. Raises ConfigError naming the variable for a name a user may mean for a
    setting (``MOONCAKE_KV_STORE__DRAM__CAPACITY_BYTES``: store fields go without ``STORE__``;
    ``MOONCAKE_KV_CONFIG_FILE``). Another name whose first level is no field is logged as a warning
    with the nearest setting's name: always when ``warn_any`` (the caller reads every config of the
    process's engine), else only when it looks like one of ``configs``' (has ``__`` or a close
    match). Names below the first level are checked by :func:`decode` (an unknown field there is
    an error). :data:`PROJECT_VARIABLES` are never reported.
    """
    top = {name for cls, exclude in configs for name in cls.__struct_fields__ if name not in exclude}
    known: list[str] | None = None
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name == CONFIG_FILE_ENV or name in PROJECT_VARIABLES:
            continue
        if name in _REFUSED_VARIABLES:
            raise ConfigError(f"{name}: {_REFUSED_VARIABLES[name]}")
        if name.startswith(_STORE_PREFIX):
            raise ConfigError(f"{name}: store fields are named by their path in the store config, without STORE__: "
                              f"set {ENV_PREFIX}{name[len(_STORE_PREFIX):]} instead")
        parts = [p.lower() for p in name[len(ENV_PREFIX):].split("__") if p]
        if parts and (parts[0] in top or (not warn_any and len(parts) == 1 and parts[0] in OTHER_CONFIGS_SETTINGS)):
            continue
        if known is None:
            known = [v[len(ENV_PREFIX):] for cls, exclude in configs for v in _variable_names(cls, exclude)]
        # Compared without the prefix, which every name shares and which would make most names "close".
        close = difflib.get_close_matches(name[len(ENV_PREFIX):], known, n=1, cutoff=0.8)
        if warn_any or close or "__" in name[len(ENV_PREFIX):]:
            hint = f"; did you mean {ENV_PREFIX}{close[0]}?" if close else ""
            logger.warning("%s matches no setting and is ignored%s", name, hint)


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``over`` on top, section by section (a key of ``over`` wins)."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def _prepare(obj: Any, path: str = "") -> Any:
    """Plain data ready for msgspec: size strings in ``*_bytes`` fields turned into ints; a key
    that is not text, or a non-finite number in a ``*_s`` (seconds) field, refused naming it."""
    if isinstance(obj, msgspec.Struct):
        obj = msgspec.to_builtins(obj)
    if not isinstance(obj, Mapping):
        return obj
    out = {}
    for k, v in obj.items():
        if not isinstance(k, str):
            where = f"{path}: key" if path else "key"
            raise ConfigError(f"{where} {k!r} is not a field name")
        here = f"{path}.{k}" if path else k
        if k.endswith("_bytes") and isinstance(v, str):
            try:
                v = parse_size(v)
            except ValueError as e:
                raise ConfigError(f"{here}: {e}") from None
        if k.endswith("_s") and isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{here}: must be a finite number of seconds, got {v}")
        out[k] = _prepare(v, here)
    return out


# Where a layer of plain data came from: a text (a file), or a function of the path (a variable).
Origin = str | Callable[[list[str | int]], str]


def decode(
    data: Mapping[str, Any] | msgspec.Struct,
    cls: type[S],
    *,
    layers: Sequence[tuple[Origin | None, Mapping[str, Any]]] = (),
) -> S:
    """Build and validate ``cls`` from plain data (sizes parsed); raises ConfigError naming the field.

    ``layers``: the data's sources, in the order they were merged (each in the shape of ``data``),
    with where each came from; the error then ends with the last one holding the bad field
    (``... (from MOONCAKE_KV_DRAM__CAPACITY_BYTES)``); a layer whose origin is None (the caller's
    own dict) adds nothing.
    """
    if not isinstance(data, (Mapping, msgspec.Struct)):
        raise ConfigError(f"a {cls.__name__} must be a mapping, not {type(data).__name__}")
    try:
        plain = _prepare(data)
        try:
            return msgspec.convert(plain, cls, str_keys=True)
        except msgspec.ValidationError as e:
            raise ConfigError(explain(str(e), plain, cls)) from None
    except ConfigError as e:
        raise ConfigError(with_origin(str(e), layers)) from None


def with_origin(message: str, layers: Sequence[tuple[Origin | None, Mapping[str, Any]]]) -> str:
    """``message`` (``"<path>: <reason>"``) ending with where the last layer holding ``<path>`` came
    from (``" (from MOONCAKE_KV_SSD__PATH)"``), or as is when that is unknown or a plain dict."""
    where = _origin(message, layers)
    return message if where is None else f"{message} (from {where})"


def origin_of(parts: Sequence[str | int], layers: Sequence[tuple[Origin | None, Mapping[str, Any]]]) -> str | None:
    """Where the last layer holding the field at ``parts`` came from (a file, a variable), or None
    (unknown, or the caller's own dict): for a message about two fields, naming the second's. For a
    section set by variables, the variable of its first field."""
    for origin, layer in reversed(layers):
        value = _value_at(layer, list(parts))
        if value is _MISSING_VALUE:
            continue
        if not callable(origin):
            return origin
        leaf = list(parts)
        while isinstance(value, Mapping) and value:
            first = next(iter(value))
            leaf.append(first)
            value = value[first]
        return origin(leaf)
    return None


_ERROR_PATH = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*|\[\d+\])*):")


def _origin(message: str, layers: Sequence[tuple[Origin | None, Mapping[str, Any]]]) -> str | None:
    m = _ERROR_PATH.match(message)
    if not m:
        return None
    parts: list[str | int] = [a if a else int(b) for a, b in _PART.findall("." + m.group(1))]
    return origin_of(parts, layers)


def variable_name(parts: Sequence[str | int]) -> str:
    """The ``MOONCAKE_KV_*`` variable that sets the field at ``parts``."""
    return ENV_PREFIX + "__".join(str(p).upper() for p in parts)


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
        fields = list(_field_types(_struct_at(cls, parts)))
        close = difflib.get_close_matches(u.group("name"), fields, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        return f"{_dotted([*parts, u.group('name')])}: unknown field (known: {', '.join(fields)}{hint})"
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


def one_of(name: str, value: str, names: Sequence[str]) -> None:
    """A closed choice whose names come from a registry: ValueError("<name>: unknown value ...")
    listing them, the message every closed choice gives (a Literal's through :func:`explain`)."""
    if value not in names:
        raise ValueError(f"{name}: unknown value {value!r} (known: {', '.join(repr(n) for n in names)})")
