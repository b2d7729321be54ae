"""Write docs/CONFIG.md, the configuration reference, from the config Structs themselves.

Every key, its type, its default and its meaning come from the typed config classes
(:mod:`store_backend.config`, :mod:`mooncake_connector.config`, :mod:`sglang_hicache.config`): the
meaning is the comment block written above the field (or on its line) in the source. So the
reference cannot drift from the code: ``tests/test_config_reference.py`` fails when docs/CONFIG.md
differs from what this script prints.

    python scripts/config_reference.py > docs/CONFIG.md     # regenerate
    python scripts/config_reference.py --check docs/CONFIG.md
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
import typing
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "scripts"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import generated_docs  # noqa: E402

from mooncake_connector.config import ConnectorConfig, NodeAttachConfig  # noqa: E402
from sglang_hicache.config import SglangOnlySettings  # noqa: E402
from store_backend.config import DramConfig, OffloadConfig, PromotionConfig, SsdConfig, StoreConfig  # noqa: E402
from store_backend.policies.admission import admission_names  # noqa: E402
from store_backend.policies.registry import policy_names  # noqa: E402

# (heading, how the section is addressed, Struct); the order of the document.
SECTIONS: list[tuple[str, str, type[msgspec.Struct]]] = [
    ("Store", "top level of a store config (`store` in a connector config)", StoreConfig),
    ("Store: `dram`", "`store.dram`", DramConfig),
    ("Store: `ssd`", "`store.ssd` (absent: no SSD tier)", SsdConfig),
    ("Store: `offload`", "`store.offload`", OffloadConfig),
    ("Store: `promotion`", "`store.promotion`", PromotionConfig),
    ("Store: `node` (attach to the node service)", "`store.node` in a connector config, alone in `store` "
     "(docs/NODE.md, \"Attaching engines\"); variables `MOONCAKE_KV_NODE__<KEY>`", NodeAttachConfig),
    ("Connector (vLLM and SGLang)", "vLLM `kv_connector_extra_config`; SGLang "
     "`--hicache-storage-backend-extra-config`", ConnectorConfig),
    ("SGLang only", "SGLang `--hicache-storage-backend-extra-config`", SglangOnlySettings),
]

HEADER = """# Configuration reference

Generated from the config Structs by `python scripts/config_reference.py > docs/CONFIG.md`; a test
fails when this file is out of date. Every config (store, connector, SGLang backend) is read by one
loader, `store_backend/config_loader.py`, so the rules below hold for all of them.

- **Files**: JSON (`.json`) or YAML (anything else), UTF-8, holding one mapping. `MOONCAKE_KV_CONFIG`
  names the file when none is given (`config_file` in a connector config); it may hold a store
  config or a whole connector config (the store then reads its `store` section; a connector config
  without one is refused by the store, naming the file, rather than read as the default store). A
  connector config file keeps store fields under `store` (at its top level beside connector keys
  they are refused), and cannot name another `config_file`.
- **Environment**: `MOONCAKE_KV_<PATH>`, the field's path in upper case with `__` between levels:
  store fields by their path in the store config (`MOONCAKE_KV_DRAM__CAPACITY_BYTES=4GiB`, also
  for a connector's `store` section, and so is its `node` section: `MOONCAKE_KV_NODE__SOCKET`),
  connector and SGLang keys by their name (`MOONCAKE_KV_CHUNK_TOKENS=512`); `store`, `node` and
  `config_file` themselves are not variables.
  Values are JSON where they parse as JSON, else text; a field that takes only text (`revision`,
  `ssd.path`, `eviction_policy`, ...) keeps the text as written, except `null`, which unsets a field
  that may be unset (`MOONCAKE_KV_MODEL_ID=null`), and a JSON string (`'"lru"'` is `lru`).
  Variables win over the dict, which wins over the file, section by section.
  `MOONCAKE_KV_STORE__...`, `MOONCAKE_KV_STORE`, `MOONCAKE_KV_CONFIG_FILE` and the old
  `MOONCAKE_KV_CONNECTOR_CONFIG` are refused, naming the variable to set instead; another
  `MOONCAKE_KV_*` name that matches no setting is logged as a warning with the nearest setting's
  name (not an error: other tools share the environment; the scripts' own `MOONCAKE_KV_VENV`,
  `MOONCAKE_KV_TORCH_INDEX`, ... are not reported).
- **Sizes**: every field whose name ends in `_bytes` also takes a size string (`"512MiB"`, `"4GB"`,
  `"1.5KiB"`): K, M, G, T (with or without B) are powers of 1000, KiB, MiB, GiB, TiB powers of
  1024. The number is read exactly and must come to a whole number of bytes (`"0.5B"` is refused).
- **Timeouts**: every `*_s` field is in seconds and must be a finite number (`NaN`, `Infinity` are
  refused, from a variable, JSON or YAML alike).
- **Errors**: a bad value stops start-up with an error that starts with the field's full path
  (`store.ssd.backend: unknown value 'tape' (known: 'bucket', 'offset', 'file')`) and, when a
  variable or a file set it, ends with which (`(from MOONCAKE_KV_SSD__BACKEND)`). An unknown key is
  refused listing the known ones (and the nearest, where one is close). Closed choices (eviction and admission policy, SSD
  backend, I/O engine, offload policy, bucket eviction, hash scheme) are checked when the config
  is read, against the names registered at that moment.
"""


def field_comments(cls: type) -> dict[str, str]:
    """The comment above each annotated field of ``cls`` (or on its line), joined into one text."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    tree = ast.parse(source)
    body = tree.body[0]
    assert isinstance(body, ast.ClassDef)
    out: dict[str, str] = {}
    for node in body.body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        row = node.lineno - 1
        above: list[str] = []
        r = row - 1
        while r >= 0 and lines[r].strip().startswith("#"):
            above.insert(0, lines[r].strip().lstrip("#").strip())
            r -= 1
        inline = lines[row].split("#", 1)[1].strip() if "#" in lines[row] else ""
        out[node.target.id] = " ".join(t for t in [*above, inline] if t)
    return out


# Closed choices whose names come from a registry (a `str` field checked in __post_init__): the
# reference lists the built-in names as it lists a Literal's.
REGISTRY_CHOICES = {
    (DramConfig, "eviction_policy"): policy_names,
    (SsdConfig, "admission_policy"): admission_names,
}


def type_text(tp: object) -> str:
    text = str(tp) if not isinstance(tp, type) else tp.__name__
    for prefix in ("typing.", "store_backend.config.", "mooncake_connector.config."):
        text = text.replace(prefix, "")
    if typing.get_origin(tp) is typing.Literal:
        text = " \\| ".join(repr(a) for a in typing.get_args(tp))
    return text.replace("|", "\\|") if "\\|" not in text else text


def default_text(field: msgspec.structs.FieldInfo) -> str:
    """The default as a user writes it (sizes of ``*_bytes`` fields in binary units)."""
    if field.default is not msgspec.NODEFAULT:
        value = field.default
    elif field.default_factory is not msgspec.NODEFAULT:
        value = field.default_factory()
        if isinstance(value, msgspec.Struct):
            return "(section)"
    else:
        return "required"
    if field.name.endswith("_bytes") and isinstance(value, int) and value >= 1024 and value % 1024 == 0:
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if value % size == 0:
                return f"`{value // size}{unit}`"
    return f"`{value!r}`" if isinstance(value, str) else f"`{value}`"


def render() -> str:
    parts = [HEADER]
    for heading, where, cls in SECTIONS:
        comments = field_comments(cls)
        own_doc = cls.__dict__.get("__doc__") or ""
        doc = inspect.cleandoc(own_doc).split("\n\n")[0].replace("\n", " ")
        parts.append(f"## {heading}\n\nWhere: {where}." + (f" {doc}" if doc else "") + "\n")
        parts.append("| key | type | default | meaning |\n|---|---|---|---|")
        for f in msgspec.structs.fields(cls):
            meaning = comments.get(f.name, "").replace("|", "\\|")
            names = REGISTRY_CHOICES.get((cls, f.name))
            kind = " \\| ".join(repr(n) for n in names()) if names else type_text(f.type)
            parts.append(f"| `{f.name}` | {kind} | {default_text(f)} | {meaning} |")
        parts.append("")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    return generated_docs.main(render, "config_reference.py", argv, __doc__.split("\n\n")[0])


if __name__ == "__main__":
    raise SystemExit(main())
