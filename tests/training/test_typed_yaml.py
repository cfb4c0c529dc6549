"""typed_yaml on its own: YAML values coerced into nested dataclasses by their type hints, what a Schema adds, and
--set overrides."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from hybridlm.training.typed_yaml import (
    ConfigError,
    FieldsMapping,
    Schema,
    apply_overrides,
    load_yaml,
    parse_override,
)


@dataclass
class Inner:
    name: str
    size: int = 1
    kind: str = "off"

    def __post_init__(self) -> None:
        if self.size > 100:
            raise ValueError(f"Inner.size must be <= 100, got {self.size}")


@dataclass
class Model:
    width: int = 4
    ratio: float | None = None


@dataclass
class Root:
    inner: Inner = field(default_factory=lambda: Inner("a"))
    items: list[Inner] = field(default_factory=list)
    pair: tuple[float, float] = (0.0, 1.0)
    table: dict[str, float] = field(default_factory=dict)
    flag: bool = False
    either: int | str = 0
    overrides: dict = field(default_factory=dict)
    internal: int = 0


def _schema(**changes) -> Schema:
    settings = dict(
        hidden={Root: {"internal": "set it under inner.size"}},
        removed={Inner: {"old": "write inner.size instead"}},
        mappings={(Root, "overrides"): FieldsMapping(lambda: Model, literals={"width": ("auto",)})},
        bool_words={(Inner, "kind"): ("off", "on")},
    )
    return Schema(**{**settings, **changes})


def test_values_take_the_type_of_their_field():
    raw = load_yaml("""
inner: {name: 7, size: 1e2, kind: on}
items: [{name: x}, {name: y, size: 3}]
pair: [1, 2.5e-1]
table: {a: 3e-4, b: 2}
flag: true
either: seven
overrides: {width: auto, ratio: 1}
""")
    root = _schema().build(Root, raw)
    assert root.inner == Inner("7", 100, "on")  # 7 -> "7", "1e2" -> 100, YAML's `on` (True) -> "on"
    assert root.items == [Inner("x"), Inner("y", 3)] and root.pair == (1.0, 0.25)
    assert root.table == {"a": 3e-4, "b": 2.0} and isinstance(root.table["b"], float)
    assert root.flag is True and root.either == "seven"
    assert root.overrides == {"width": "auto", "ratio": 1.0}  # a literal kept, the other field typed
    assert _schema().build(Root, None) == Root()


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"inner": {"nam": "x"}}, "unknown key 'inner.nam'; valid keys of inner: name, size, kind"),
        ({"extra": 1}, "unknown key 'extra'; valid keys of the config: inner, items, pair, table, flag, either, "
                       "overrides"),
        ({"internal": 3}, "internal: cannot be set here; set it under inner.size"),
        ({"inner": {"name": "x", "old": 2}}, "inner.old: was removed; write inner.size instead"),
        ({"items": [{"size": 2}]}, r"items[0]: missing required key(s): name"),
        ({"inner": {"name": "x", "size": 2.5}}, "inner.size: expected an int, got 2.5"),
        ({"inner": {"name": "x", "size": 101}}, "inner.size must be <= 100, got 101"),  # the class's own check
        ({"inner": "x"}, "inner: expected a mapping of keys (name, size, kind), got 'x'"),
        ({"pair": [1]}, "pair: expected a list of 2 values, got 1: [1]"),
        ({"pair": [1, "a"]}, "pair[1]: expected a number, got 'a'"),
        ({"table": [1]}, "table: expected a mapping, got [1]"),
        ({"table": {"a": "x"}}, "table.a: expected a number, got 'x'"),
        ({"flag": 1}, "flag: expected a bool (true / false), got 1"),
        ({"either": [1]}, "either: expected int | str, got [1]"),
        ({"overrides": {"depth": 2}}, "unknown key 'overrides.depth'; valid keys of overrides (the Model fields): "
                                      "width, ratio"),
        ({"overrides": {"width": "wide"}}, "overrides.width: expected an int, got 'wide'"),
        ({"overrides": 3}, "overrides: expected a mapping of Model fields, got 3"),
    ],
)
def test_errors_name_the_dotted_key(raw, message):
    with pytest.raises(ConfigError) as info:
        _schema().build(Root, raw)
    assert str(info.value).startswith(message), str(info.value)


def test_a_check_sees_the_coerced_section_before_it_is_built():
    seen = []

    def check(kwargs, path):
        seen.append((dict(kwargs), path))
        if kwargs.get("size") == 13:
            raise ConfigError(f"{path}.size: 13 is refused")

    schema = _schema(checks={Inner: check})
    schema.build(Root, {"inner": {"name": "a", "size": "2"}})
    assert seen == [({"name": "a", "size": 2}, "inner")]
    with pytest.raises(ConfigError, match=r"^items\[0\]\.size: 13 is refused"):
        schema.build(Root, {"items": [{"name": "a", "size": 13}]})


def test_to_plain_gives_yaml_ready_values_without_hidden_fields():
    root = _schema().build(Root, {"pair": [2, 3], "items": [{"name": "x"}]})
    plain = _schema().to_plain(root)
    assert plain["pair"] == [2.0, 3.0] and plain["items"] == [{"name": "x", "size": 1, "kind": "off"}]
    assert "internal" not in plain and _schema().build(Root, plain) == root


def test_duplicate_keys_are_refused_but_merge_keys_may_be_overridden():
    with pytest.raises(ConfigError, match=r"duplicate key 'a' at line 3 \(first at line 1\)"):
        load_yaml("a: 1\nb: 2\na: 3\n")
    assert load_yaml("base: &b {x: 1, y: 2}\nc: {<<: *b, y: 3}\n")["c"] == {"x": 1, "y": 3}


def test_parse_override_reads_yaml_values():
    assert parse_override("a.b=3") == (["a", "b"], 3)
    assert parse_override("a=[1, 2]") == (["a"], [1, 2])
    assert parse_override("a=null") == (["a"], None)
    assert parse_override("a=runs/x=y") == (["a"], "runs/x=y")
    assert parse_override("a=[unclosed") == (["a"], "[unclosed")  # not YAML: kept as the string
    for bad, message in (("a", "expected key=value"), ("a..b=1", "not a dotted key"), ("=1", "not a dotted key")):
        with pytest.raises(ConfigError, match=message):
            parse_override(bad)


def test_apply_overrides_sets_nested_keys_in_a_copy():
    raw = {"a": {"b": 1}, "c": 2}
    out = apply_overrides(raw, ["a.b=5", "x.y.z=true", "a.d=[1]"])
    assert out == {"a": {"b": 5, "d": [1]}, "c": 2, "x": {"y": {"z": True}}} and raw == {"a": {"b": 1}, "c": 2}
    with pytest.raises(ConfigError, match=r"--set 'c.d=1': c is a value, not a section"):
        apply_overrides(raw, ["c.d=1"])
