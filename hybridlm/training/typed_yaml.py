"""Typed YAML: a YAML tree (plus `--set key=value` overrides) coerced into nested dataclasses, with errors that
name the dotted key.

    schema = Schema(removed={Section: {"old": "write new_key instead"}})
    raw = apply_overrides(load_yaml(text), ["train.steps=12"])
    config = schema.build(Config, raw)            # ConfigError("train.stepz: ...") on a bad key or value
    schema.to_plain(config)                       # back to plain dicts / lists / scalars (YAML-ready)

Typing: every value is parsed into the declared type of its dataclass field (ints, floats, bools, str, optional,
unions, tuples, lists, dicts, nested dataclasses); YAML 1.1 reads `3e-4` as a string, which is taken as a float
where a number is expected, and reads `1` where a str is expected as an int, which is taken as "1". An unknown key
lists the valid keys of its section; a wrong type says what was expected; a dataclass's own ValueError is reported
under the config key (`Section.field` becomes `path.field`). What is specific to one config (keys that cannot be
set or were removed, a mapping typed by another dataclass's fields, words YAML reads as booleans, checks on a
section before it is built) is declared in a `Schema`. YAML text must not give one key twice in a mapping (YAML
would silently keep the last).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

import yaml


class ConfigError(ValueError):
    """A configuration problem; the message starts with the dotted key it concerns."""


# ------------------------------------------------------------------------------------------------ YAML text
class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, but a key given twice in one mapping is a ConfigError: plain YAML keeps the last
    one, so `train: {steps: 10}` further down a file would silently replace a whole `train:` section."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first_line: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: its keys may be overridden, as YAML says
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    seen = key in first_line
                except TypeError:  # an unhashable key: SafeLoader's own error says so
                    continue
                line = key_node.start_mark.line + 1
                if seen:
                    raise ConfigError(f"duplicate key {key!r} at line {line} (first at line {first_line[key]}): a "
                                      "mapping takes each key once (YAML would keep only the last); delete one of them")
                first_line[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """YAML text -> Python values (safe: no Python objects), refusing duplicate keys (ConfigError)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)


# ------------------------------------------------------------------------------------------------ overrides
def parse_override(text: str) -> tuple[list[str], Any]:
    """`"a.b.c=value"` -> (["a", "b", "c"], value parsed as YAML: numbers, true/false, null, [lists], {maps})."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected key=value (dotted key, e.g. train.steps=12)")
    key, _, raw = text.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise ConfigError(f"--set {text!r}: {key!r} is not a dotted key like train.steps")
    try:
        value = load_yaml(raw) if raw.strip() else ""
    except ConfigError as err:  # a duplicate key in a {mapping}
        raise ConfigError(f"--set {text!r}: {err}") from err
    except yaml.YAMLError:
        value = raw  # not YAML (e.g. an unbalanced bracket in a path): keep the string; the type check decides
    return parts, value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each `key=value` into the nested dict `raw` (a copy is returned)."""
    out = copy.deepcopy(raw)
    for text in overrides:
        parts, value = parse_override(text)
        node = out
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"--set {text!r}: {'.'.join(parts[:depth + 1])} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return out


# ------------------------------------------------------------------------------------------------ the schema
@dataclass(frozen=True)
class FieldsMapping:
    """A dict field whose keys are the fields of another dataclass, each value typed like its field (e.g. a model
    section's `overrides`: any field of the model config). `cls` returns that dataclass (called when a value is
    read, so its module is imported only then); `literals` names values taken as they are for a key, beside the
    field's type (e.g. {"head_dim": ("auto",)})."""

    cls: Callable[[], type]
    literals: dict[str, tuple[Any, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class Schema:
    """What one config's dataclasses need beyond their type hints, keyed by dataclass (and field name):

    hidden      fields that cannot be set from YAML, with where to set them instead (left out of `to_plain` too)
    removed     keys of earlier versions, with what to write instead
    mappings    dict fields typed by another dataclass's fields (`FieldsMapping`)
    bool_words  str fields whose words YAML 1.1 reads as booleans: (word for false, word for true)
    checks      run on a section's coerced keyword arguments (and its dotted path) before it is built, to name the
                config keys in errors the dataclass would report in terms of its own fields
    """

    hidden: dict[type, dict[str, str]] = field(default_factory=dict)
    removed: dict[type, dict[str, str]] = field(default_factory=dict)
    mappings: dict[tuple[type, str], FieldsMapping] = field(default_factory=dict)
    bool_words: dict[tuple[type, str], tuple[str, str]] = field(default_factory=dict)
    checks: dict[type, Callable[[dict[str, Any], str], None]] = field(default_factory=dict)

    def valid_keys(self, cls: type) -> list[str]:
        """The keys YAML may set in a section of dataclass `cls`."""
        hidden = self.hidden.get(cls, {})
        return [f.name for f in dataclasses.fields(cls) if f.init and f.name not in hidden]

    def build(self, cls: type, raw: Any, path: str = "") -> Any:
        """Instantiate dataclass `cls` from the mapping `raw` (None: all defaults); `path` is its dotted key
        ("" for the whole config)."""
        if raw is None:
            raw = {}
        if dataclasses.is_dataclass(raw) and isinstance(raw, cls):
            return raw
        if not isinstance(raw, dict):
            raise _fail(path, f"expected a mapping of keys ({', '.join(self.valid_keys(cls))}), got {raw!r}")
        hidden = self.hidden.get(cls, {})
        removed = self.removed.get(cls, {})
        valid = self.valid_keys(cls)
        for key in raw:
            where = f"{path}.{key}" if path else str(key)
            if key in hidden:
                raise _fail(where, f"cannot be set here; {hidden[key]}")
            if key in removed:
                raise _fail(where, f"was removed; {removed[key]}")
            if key not in valid:
                raise ConfigError(f"unknown key {where!r}; valid keys of {path or 'the config'}: {', '.join(valid)}")
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for key, value in raw.items():
            where = f"{path}.{key}" if path else key
            if (cls, key) in self.bool_words and isinstance(value, bool):
                value = self.bool_words[(cls, key)][value]  # YAML reads an unquoted on / off as true / false
            if (cls, key) in self.mappings:
                kwargs[key] = self._coerce_fields_of(self.mappings[(cls, key)], value, where)
            else:
                kwargs[key] = self.coerce(value, hints[key], where)
        missing = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in kwargs
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise _fail(path, f"missing required key(s): {', '.join(missing)}")
        if cls in self.checks:
            self.checks[cls](kwargs, path)
        try:
            return cls(**kwargs)
        except (ValueError, TypeError) as err:
            # The dataclass's own messages speak of `Section.field` or `Section(kind='x')`: name the config keys
            # instead (path.field, path.kind='x'), which is what the user types.
            message = str(err)
            if path:
                message = re.sub(rf"\b{cls.__name__}\((\w+=[^)]*)\)", rf"{path}.\1", message)
                message = message.replace(f"{cls.__name__}.", f"{path}.")
            if path and message.startswith(f"{path}."):
                raise ConfigError(message) from err
            raise _fail(path, message) from err

    def coerce(self, value: Any, hint: Any, path: str) -> Any:
        """`value` (from YAML) as an instance of the type `hint`; ConfigError naming `path` if it is not one."""
        if hint is Any:
            return value
        origin = typing.get_origin(hint)
        args = typing.get_args(hint)
        if origin in (typing.Union, types.UnionType):
            if value is None and type(None) in args:
                return None
            for arg in args:
                if arg is type(None):
                    continue
                try:
                    return self.coerce(value, arg, path)
                except ConfigError:
                    continue
            raise _fail(path, f"expected {_type_name(hint)}, got {value!r}")
        if dataclasses.is_dataclass(hint):
            return self.build(hint, value, path)
        if hint is bool:
            if isinstance(value, bool):
                return value
            raise _fail(path, f"expected a bool (true / false), got {value!r}")
        if hint is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            number = _as_float(value)
            if number is not None and math.isfinite(number) and number.is_integer():
                return int(number)
            raise _fail(path, f"expected an int, got {value!r}")
        if hint is float:
            number = _as_float(value)
            if number is None:
                raise _fail(path, f"expected a number, got {value!r}")
            return number
        if hint is str:
            if isinstance(value, str):
                return value
            if isinstance(value, int) and not isinstance(value, bool):  # YAML reads fw_rule=1 or out_dir=2024 as ints
                return str(value)
            raise _fail(path, f"expected a string, got {value!r}")
        if origin in (list, tuple):
            if not isinstance(value, (list, tuple)):
                raise _fail(path, f"expected a list, got {value!r}")
            if origin is tuple and args and args[-1] is not Ellipsis:
                if len(value) != len(args):
                    raise _fail(path, f"expected a list of {len(args)} values, got {len(value)}: {value!r}")
                return tuple(self.coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
            item = args[0] if args else Any
            out = [self.coerce(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
            return tuple(out) if origin is tuple else out
        if origin is dict:
            if not isinstance(value, dict):
                raise _fail(path, f"expected a mapping, got {value!r}")
            key_hint, value_hint = args if args else (Any, Any)
            return {self.coerce(k, key_hint, path): self.coerce(v, value_hint, f"{path}.{k}") for k, v in value.items()}
        raise _fail(path, f"cannot parse a value of type {_type_name(hint)}")  # a field type this parser lacks

    def _coerce_fields_of(self, mapping: FieldsMapping, raw: Any, path: str) -> dict[str, Any]:
        cls = mapping.cls()
        if raw is None:
            return {}
        if not isinstance(raw, dict):
            raise _fail(path, f"expected a mapping of {cls.__name__} fields, got {raw!r}")
        valid = [f.name for f in dataclasses.fields(cls) if f.init]
        hints = typing.get_type_hints(cls)
        out = {}
        for key, value in raw.items():
            if key not in valid:
                raise ConfigError(f"unknown key '{path}.{key}'; valid keys of {path} (the {cls.__name__} fields): "
                                  + ", ".join(valid))
            if value in mapping.literals.get(key, ()):
                out[key] = value
                continue
            out[key] = self.coerce(value, hints[key], f"{path}.{key}")
        return out

    def to_plain(self, value: Any) -> Any:
        """Plain dicts / lists / scalars of a built config (tuples as lists; hidden fields left out)."""
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            hidden = self.hidden.get(type(value), {})
            return {f.name: self.to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                    if f.init and f.name not in hidden}
        if isinstance(value, (list, tuple)):
            return [self.to_plain(v) for v in value]
        if isinstance(value, dict):
            return {k: self.to_plain(v) for k, v in value.items()}
        return value


def _type_name(hint: Any) -> str:
    if hint is type(None):
        return "null"
    if isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "")


def _fail(path: str, message: str) -> ConfigError:
    return ConfigError(f"{path}: {message}")


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        text = value.strip().lower()
        text = {".inf": "inf", "+.inf": "inf", "-.inf": "-inf", ".nan": "nan"}.get(text, text)
        try:
            return float(text)
        except ValueError:
            return None
    return None
