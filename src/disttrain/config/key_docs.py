"""Every config key with its type, default and meaning, read from the schema itself.

A field's meaning is the string literal that follows it in its dataclass (the schema's
convention, schema.py); this module reads those literals with `ast`, so `disttrain
train --help` lists exactly the keys `load_config` takes, and a key added without a
line of meaning shows as such in the help (and fails tests/policy/test_cli_help.py).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from dataclasses import dataclass

from disttrain.config.schema import Config


@dataclass(frozen=True)
class KeyDoc:
    """One config key: `section.name`, its annotation, its default and its meaning."""

    key: str
    type: str
    default: object
    meaning: str


def _field_literals(cls: type) -> dict[str, str]:
    """{field: the string literal after it} for `cls` and its dataclass bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        node = tree.body[0]  # the class statement (getsource gives its decorators with it)
        body = node.body if isinstance(node, ast.ClassDef) else []
        for field_node, after in zip(body, body[1:], strict=False):
            if (
                isinstance(field_node, ast.AnnAssign)
                and isinstance(field_node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[field_node.target.id] = after.value.value
    return docs


def _default(f: dataclasses.Field) -> object:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"schema field {f.name} has no default")  # every one has one or the other


def _first_sentence(text: str) -> str:
    """The meaning on one line: the literal's first sentence, whitespace collapsed."""
    flat = " ".join(text.split())
    end = flat.find(". ")
    return flat if end < 0 else flat[: end + 1]


def config_keys() -> list[KeyDoc]:
    """Every key of `Config`, section by section, in the schema's order."""
    out: list[KeyDoc] = []
    for section in dataclasses.fields(Config):
        cls = section.default_factory  # each section's default is its dataclass
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise TypeError(f"config section {section.name} is no dataclass")
        docs = _field_literals(cls)
        for f in dataclasses.fields(cls):
            out.append(
                KeyDoc(f"{section.name}.{f.name}", str(f.type), _default(f), _first_sentence(docs.get(f.name, "")))
            )
    return out


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def keys_help() -> str:
    """The config keys as text, one line each (`key  type = default  meaning`), grouped
    under their TOML section."""
    keys = config_keys()
    left = [f"{k.key}  {k.type} = {_shown(k.default)}" for k in keys]
    width = max(len(s) for s in left) + 2
    lines, section = [], ""
    for k, head in zip(keys, left, strict=False):
        name = k.key.split(".", 1)[0]
        if name != section:
            section = name
            lines.append(f"\n[{section}]")
        lines.append(f"  {head.ljust(width)}{k.meaning}".rstrip())
    return "\n".join(lines).lstrip("\n") + "\n"
