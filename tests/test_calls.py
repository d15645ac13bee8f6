"""ToolCall canonicalisation, stable digests, validation of arguments, and ToolSpec.validate."""

from __future__ import annotations

import json
import math
import os
import pickle
import random
import subprocess
import sys
import unicodedata
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tvcache import calls
from tvcache.calls import ToolCall, ToolSpec, canonical_json, stable_digest
from tvcache.errors import InvalidInput, InvalidToolCall

# --------------------------------------------------------------------------------------------- strategies

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
json_arguments = st.dictionaries(st.text(max_size=8), json_values, max_size=5)
tool_names = st.text(min_size=1, max_size=20)

# JSON's insignificant whitespace (RFC 8259): space, tab, line feed, carriage return.
whitespace = st.text(alphabet=" \t\n\r", max_size=3)


def shuffled(value: Any, rng: random.Random) -> Any:
    """A deep copy of a JSON value with every object's keys in a random order."""
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {key: shuffled(item, rng) for key, item in items}
    if isinstance(value, list):
        return [shuffled(item, rng) for item in value]
    return value


def same_json(left: Any, right: Any) -> bool:
    """Equality of JSON values that, unlike ``==``, tells 1, 1.0 and True apart (and 0.0 from -0.0)."""
    if isinstance(left, tuple):
        left = list(left)
    if type(left) is not type(right):
        return False
    if isinstance(left, dict):
        return left.keys() == right.keys() and all(same_json(left[key], right[key]) for key in left)
    if isinstance(left, list):
        return len(left) == len(right) and all(same_json(a, b) for a, b in zip(left, right, strict=True))
    if isinstance(left, float):
        return left == right and math.copysign(1.0, left) == math.copysign(1.0, right)
    return bool(left == right)


def tuples_as_lists(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [tuples_as_lists(item) for item in value]
    if isinstance(value, dict):
        return {key: tuples_as_lists(item) for key, item in value.items()}
    return value


# ----------------------------------------------------------------------------------------- canonicalisation


@given(name=tool_names, arguments=json_arguments, rng=st.randoms(use_true_random=False))
def test_key_order_does_not_matter(name: str, arguments: dict[str, Any], rng: random.Random) -> None:
    call = ToolCall(name, arguments)
    reordered = ToolCall(name, shuffled(arguments, rng))
    assert reordered == call
    assert reordered.digest == call.digest
    assert reordered.canonical() == call.canonical()
    assert hash(reordered) == hash(call)


@given(
    name=tool_names,
    arguments=json_arguments,
    indent=st.none() | st.integers(min_value=0, max_value=4) | whitespace,
    item_separator=st.tuples(whitespace, whitespace).map(lambda pair: pair[0] + "," + pair[1]),
    key_separator=st.tuples(whitespace, whitespace).map(lambda pair: pair[0] + ":" + pair[1]),
    ensure_ascii=st.booleans(),
    padding=st.tuples(whitespace, whitespace),
    as_bytes=st.booleans(),
    rng=st.randoms(use_true_random=False),
)
def test_from_json_ignores_whitespace_and_escapes(
    name: str,
    arguments: dict[str, Any],
    indent: int | str | None,
    item_separator: str,
    key_separator: str,
    ensure_ascii: bool,
    padding: tuple[str, str],
    as_bytes: bool,
    rng: random.Random,
) -> None:
    text = json.dumps(
        shuffled(arguments, rng),
        indent=indent,
        separators=(item_separator, key_separator),
        ensure_ascii=ensure_ascii,
    )
    text = padding[0] + text + padding[1]
    parsed = ToolCall.from_json(name, text.encode() if as_bytes else text)
    assert parsed == ToolCall(name, arguments)
    assert parsed.canonical_arguments == canonical_json(arguments)


@given(name=tool_names, arguments=json_arguments)
def test_arguments_round_trip(name: str, arguments: dict[str, Any]) -> None:
    call = ToolCall(name, arguments)
    assert call.name == name
    assert same_json(arguments, call.arguments)
    # A fresh copy each time: mutating it does not change the call.
    decoded = call.arguments
    decoded["__extra__"] = 1
    assert same_json(arguments, call.arguments)
    assert json.loads(call.canonical()) == {"arguments": call.arguments, "name": name}


@given(arguments=st.dictionaries(st.text(max_size=4), st.tuples(json_scalars, json_scalars), max_size=3))
def test_tuples_become_lists(arguments: dict[str, Any]) -> None:
    call = ToolCall("t", arguments)
    assert same_json(tuples_as_lists(arguments), call.arguments)
    assert call == ToolCall("t", tuples_as_lists(arguments))


@given(
    first=st.tuples(tool_names, json_arguments),
    second=st.tuples(tool_names, json_arguments),
    copy=st.booleans(),
)
def test_digest_equal_iff_canonical_bytes_equal(
    first: tuple[str, dict[str, Any]], second: tuple[str, dict[str, Any]], copy: bool
) -> None:
    if copy:
        second = (first[0], json.loads(json.dumps(first[1])))
    a, b = ToolCall(*first), ToolCall(*second)
    assert len(a.digest) == 16
    assert a.hexdigest == a.digest.hex()
    assert a.digest == stable_digest(a.name.encode() + b"\x00" + a.canonical_arguments)
    assert (a.digest == b.digest) == (a.canonical() == b.canonical())
    assert (a == b) == (a.canonical() == b.canonical())


flat_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.characters(max_codepoint=127))
    | st.text()
)


@given(arguments=st.dictionaries(st.text(max_size=8), flat_scalars, max_size=6))
def test_the_flat_fast_path_encodes_exactly_like_the_general_path(arguments: dict[str, Any]) -> None:
    """Flat ASCII arguments skip the validating copy; the bytes must be the ones the general path gives."""
    general = json.dumps(
        calls._plain(arguments, "arguments"), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    ).encode()
    assert canonical_json(arguments) == general


def test_canonical_form_is_compact_sorted_utf8() -> None:
    call = ToolCall("edit", {"b": [1, 2.5, None], "a": {"y": True, "x": "é"}})
    assert call.canonical_arguments == '{"a":{"x":"é","y":true},"b":[1,2.5,null]}'.encode()
    assert call.canonical() == '{"arguments":{"a":{"x":"é","y":true},"b":[1,2.5,null]},"name":"edit"}'.encode()
    assert ToolCall("ls") == ToolCall("ls", {}) == ToolCall("ls", None)


GOLDEN_CALL = ("bash", {"cmd": "ls -la", "timeout": 30, "env": {"B": "2", "A": "1"}, "flags": [True, None, 1.5]})
# blake2b-128 over b"bash\x00" + canonical arguments. Durable journals and shard routing depend on this value:
# if it ever changes, existing caches silently become misses.
GOLDEN_HEXDIGEST = "2100e2fc7b4f016c19c86487f910a823"


def test_digest_is_stable_across_processes_and_hash_seeds() -> None:
    call = ToolCall(*GOLDEN_CALL)
    assert call.hexdigest == GOLDEN_HEXDIGEST
    script = (
        "from tvcache.calls import ToolCall\n"
        f"call = ToolCall(*{GOLDEN_CALL!r})\n"
        "print(call.hexdigest, hash(call), hash('salted'))\n"
    )
    outputs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60, check=True
        )
        outputs.append(done.stdout.split())
    (digest_1, hash_1, salted_1), (digest_2, hash_2, salted_2) = outputs
    assert salted_1 != salted_2  # the seeds really changed Python's string hashing
    assert digest_1 == digest_2 == GOLDEN_HEXDIGEST
    assert hash_1 == hash_2 == str(hash(call))  # hash() derives from the digest, not from salted str hashes


# ------------------------------------------------------------------------------------------ types matter


def test_int_float_and_bool_are_different_calls() -> None:
    calls = [ToolCall("seek", {"n": value}) for value in (1, 1.0, True)]
    assert len({call.digest for call in calls}) == 3
    assert len(set(calls)) == 3
    assert [type(call.arguments["n"]) for call in calls] == [int, float, bool]
    assert ToolCall("seek", {"n": 0.0}) != ToolCall("seek", {"n": -0.0})
    assert ToolCall("seek", {"n": None}) != ToolCall("seek", {})
    assert ToolCall("seek", {"n": "1"}) != ToolCall("seek", {"n": 1})


def test_unicode_is_not_normalised() -> None:
    """We key calls by their exact code points: NFC and NFD spellings are different calls (a file system or a
    tool may treat them differently, so merging them could serve a wrong result)."""
    composed = "caf\u00e9"
    decomposed = unicodedata.normalize("NFD", composed)
    assert composed != decomposed
    assert ToolCall("open", {"path": composed}) != ToolCall("open", {"path": decomposed})
    assert ToolCall("open", {composed: 1}) != ToolCall("open", {decomposed: 1})
    assert ToolCall(composed) != ToolCall(decomposed)
    assert ToolCall("open", {"path": decomposed}).arguments["path"] == decomposed


def test_names_matter() -> None:
    assert ToolCall("a", {"x": 1}) != ToolCall("b", {"x": 1})
    assert ToolCall("a", {"x": 1}) != ToolCall("A", {"x": 1})


# ------------------------------------------------------------------------------------------- rejections


@pytest.mark.parametrize(
    ("arguments", "fragments"),
    [
        ({"a": float("nan")}, ["arguments.a", "nan"]),
        ({"a": {"b": [1, float("inf")]}}, ["arguments.a.b[1]", "inf"]),
        ({"a": [float("-inf")]}, ["arguments.a[0]", "-inf"]),
        ({"data": b"raw"}, ["arguments.data", "bytes"]),
        ({"tags": {"x", "y"}}, ["arguments.tags", "set"]),
        ({"deep": [{"obj": object()}]}, ["arguments.deep[0].obj", "object"]),
        ({"a": {1: "one"}}, ["arguments.a", "non-string key 1"]),
        ({2: "two"}, ["arguments", "non-string key 2"]),
        ({"a": {None: 1}}, ["arguments.a", "non-string key None"]),
        ({"a": {("t",): 1}}, ["arguments.a", "non-string key"]),
    ],
)
def test_unrepresentable_arguments_are_rejected_naming_the_path(
    arguments: dict[Any, Any], fragments: list[str]
) -> None:
    with pytest.raises(InvalidToolCall) as caught:
        ToolCall("tool", arguments)
    for fragment in fragments:
        assert fragment in str(caught.value)
    assert isinstance(caught.value, InvalidInput)
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("arguments", [[1, 2], "text", 3, (("a", 1),), b"{}"])
def test_non_object_arguments_are_rejected(arguments: Any) -> None:
    with pytest.raises(InvalidToolCall, match=r"arguments of 'tool' must be a JSON object \(a dict\), got"):
        ToolCall("tool", arguments)


@pytest.mark.parametrize("name", ["", "x" * 257, None, 3, b"bash", ["bash"]])
def test_bad_names_are_rejected(name: Any) -> None:
    with pytest.raises(InvalidToolCall, match="tool name must be a non-empty string of at most 256 characters"):
        ToolCall(name, {})


def test_longest_name_is_accepted() -> None:
    assert ToolCall("x" * 256).name == "x" * 256


@pytest.mark.parametrize("text", ["", "{", '{"a": 1,}', "{'a': 1}", '{"a": tru}', b"\xff\xfe\x00", "1 2"])
def test_from_json_rejects_invalid_json(text: str | bytes) -> None:
    with pytest.raises(InvalidToolCall, match="arguments of 'tool' are not valid JSON"):
        ToolCall.from_json("tool", text)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("[1, 2]", "must be a JSON object"),
        ('"text"', "must be a JSON object"),
        ('{"a": NaN}', "arguments.a"),  # Python's json accepts NaN/Infinity literals; we must not
        ('{"a": [Infinity]}', "arguments.a[0]"),
    ],
)
def test_from_json_rejects_valid_json_that_is_not_a_json_object(text: str, fragment: str) -> None:
    with pytest.raises(InvalidToolCall) as caught:
        ToolCall.from_json("tool", text)
    assert fragment in str(caught.value)


def test_from_json_rejects_non_text() -> None:
    with pytest.raises(InvalidToolCall, match="not valid JSON"):
        ToolCall.from_json("tool", None)  # type: ignore[arg-type]


# -------------------------------------------------------------------- immutability, hashing, pickling, repr


def test_tool_call_is_immutable() -> None:
    call = ToolCall("bash", {"cmd": "ls"})
    for attribute in ("name", "digest", "_canonical", "new_attribute"):
        with pytest.raises(AttributeError):
            setattr(call, attribute, "changed")
    assert call == ToolCall("bash", {"cmd": "ls"})


def test_tool_call_attributes_cannot_be_deleted() -> None:
    """BUG (pinned): ToolCall overrides __setattr__ but not __delattr__, so ``del call.name`` succeeds."""
    call = ToolCall("bash", {"cmd": "ls"})
    with pytest.raises(AttributeError):
        del call.name
    assert call.name == "bash"


def test_tool_call_is_hashable_and_usable_as_a_key() -> None:
    table = {ToolCall("bash", {"cmd": "ls", "n": 1}): "listing"}
    assert table[ToolCall("bash", {"n": 1, "cmd": "ls"})] == "listing"
    assert ToolCall("bash", {"cmd": "ls"}) != "bash"
    assert ToolCall("bash", {"cmd": "ls"}) != ToolCall("bash", {"cmd": "ls"}).canonical()


@given(name=tool_names, arguments=json_arguments, protocol=st.integers(0, pickle.HIGHEST_PROTOCOL))
@settings(max_examples=50)
def test_pickle_round_trip(name: str, arguments: dict[str, Any], protocol: int) -> None:
    call = ToolCall(name, arguments)
    copy = pickle.loads(pickle.dumps(call, protocol=protocol))
    assert copy == call
    assert copy.name == call.name
    assert copy.canonical() == call.canonical()
    assert same_json(call.arguments, copy.arguments)


def test_repr_is_truncated() -> None:
    short = ToolCall("ls", {"path": "/tmp"})
    assert repr(short) == """ToolCall('ls', {"path":"/tmp"})"""
    assert str(short) == repr(short)
    long = ToolCall("write", {"content": "x" * 10_000})
    text = repr(long)
    assert text.startswith("""ToolCall('write', {"content":"xxx""")
    assert text.endswith("...)")
    assert len(text) <= len("ToolCall('write', )") + 80


# ------------------------------------------------------------------------------------------ pinned bugs


def test_non_dict_mappings_are_accepted() -> None:
    """BUG (pinned): ``ToolCall`` is typed ``Mapping[str, Any]`` and ``_check_json`` accepts any Mapping, but
    ``canonical_json`` hands it to ``json.dumps``, which only serialises ``dict``: a raw TypeError escapes."""
    expected = ToolCall("t", {"a": {"b": 1}})
    assert ToolCall("t", MappingProxyType({"a": {"b": 1}})) == expected
    assert ToolCall("t", {"a": MappingProxyType({"b": 1})}) == expected


@pytest.mark.parametrize(
    ("build", "fragment"),
    [
        (lambda: ToolCall.from_json("t", '{"text": "\\ud800"}'), "arguments.text"),
        (lambda: ToolCall("t", {"text": "ok\udcff"}), "arguments.text"),
        (lambda: ToolCall("t", {"k\ud800": 1}), "arguments"),
        (lambda: ToolCall("t\ud800", {}), "name"),
    ],
    ids=["from_json-escape", "value", "key", "name"],
)
def test_lone_surrogates_raise_invalid_tool_call(build: Any, fragment: str) -> None:
    """BUG (pinned): a lone surrogate (which ``json.loads`` produces from a ``"\\ud800"`` escape an LLM may emit)
    passes ``_check_json`` and then ``canonical_json``'s ``.encode()`` (or ``name.encode()``) raises a raw
    UnicodeEncodeError instead of InvalidToolCall."""
    with pytest.raises(InvalidToolCall) as caught:
        build()
    assert fragment in str(caught.value)


def test_huge_integers_raise_invalid_tool_call() -> None:
    """BUG (pinned): an int beyond Python's int/str conversion limit (4300 digits) passes ``_check_json`` and
    ``json.dumps`` raises a bare ValueError instead of InvalidToolCall naming the argument."""
    with pytest.raises(InvalidToolCall, match=r"arguments\.n"):
        ToolCall("t", {"n": 10**5000})


def test_deeply_nested_json_raises_invalid_tool_call() -> None:
    """BUG (pinned): deeply nested input makes ``json.loads`` (in ``from_json``) or the recursive ``_check_json``
    raise RecursionError, which neither path converts to InvalidToolCall."""
    with pytest.raises(InvalidToolCall):
        ToolCall.from_json("t", '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    nested: dict[str, Any] = {}
    inner = nested
    for _ in range(5_000):
        inner["a"] = {}
        inner = inner["a"]
    with pytest.raises(InvalidToolCall):
        ToolCall("t", nested)


# ----------------------------------------------------------------------------------------- ToolSpec


SPEC = ToolSpec(
    name="read",
    read_only=True,
    arguments={"path": str, "limit": int},
    optional_arguments={"offset": (int, type(None)), "follow": bool, "scale": float},
)


def test_spec_accepts_required_and_optional_arguments() -> None:
    SPEC.validate(ToolCall("read", {"path": "a.txt", "limit": 10}))
    SPEC.validate(ToolCall("read", {"path": "a.txt", "limit": 10, "offset": None, "follow": True, "scale": 0.5}))
    SPEC.validate(ToolCall("read", {"path": "a.txt", "limit": 10, "offset": 3}))


def test_spec_rejects_missing_arguments() -> None:
    with pytest.raises(InvalidToolCall, match=r"tool 'read' is missing required argument\(s\): path, limit"):
        SPEC.validate(ToolCall("read", {}))
    with pytest.raises(InvalidToolCall, match=r"missing required argument\(s\): limit$"):
        SPEC.validate(ToolCall("read", {"path": "a"}))


def test_spec_rejects_unexpected_arguments() -> None:
    with pytest.raises(InvalidToolCall) as caught:
        SPEC.validate(ToolCall("read", {"path": "a", "limit": 1, "mode": "r"}))
    message = str(caught.value)
    assert "unexpected argument(s) mode" in message
    assert "it accepts: path, limit, offset, follow, scale" in message
    bare = ToolSpec(name="now", arguments={})
    bare.validate(ToolCall("now"))
    with pytest.raises(InvalidToolCall, match=r"it accepts: \(none\)"):
        bare.validate(ToolCall("now", {"tz": "UTC"}))


@pytest.mark.parametrize(
    ("arguments", "fragment"),
    [
        ({"path": 1, "limit": 1}, "argument 'path' must be string, got int 1"),
        ({"path": "a", "limit": "10"}, "argument 'limit' must be integer, got str '10'"),
        ({"path": "a", "limit": 1.5}, "argument 'limit' must be integer, got float 1.5"),
        ({"path": "a", "limit": True}, "argument 'limit' must be integer, got bool True"),
        ({"path": "a", "limit": 1, "offset": False}, "argument 'offset' must be integer or NoneType, got bool"),
        ({"path": "a", "limit": 1, "offset": "3"}, "argument 'offset' must be integer or NoneType, got str"),
        ({"path": "a", "limit": 1, "follow": 1}, "argument 'follow' must be boolean, got int 1"),
        ({"path": None, "limit": 1}, "argument 'path' must be string, got NoneType None"),
        ({"path": ["a"], "limit": 1}, "argument 'path' must be string, got list"),
    ],
)
def test_spec_rejects_wrong_types(arguments: dict[str, Any], fragment: str) -> None:
    with pytest.raises(InvalidToolCall) as caught:
        SPEC.validate(ToolCall("read", arguments))
    assert fragment in str(caught.value)
    assert "tool 'read'" in str(caught.value)


def test_spec_bool_is_accepted_where_declared() -> None:
    spec = ToolSpec(name="flag", arguments={"on": bool, "n": (int, bool)})
    spec.validate(ToolCall("flag", {"on": False, "n": True}))
    spec.validate(ToolCall("flag", {"on": True, "n": 2}))


def test_spec_without_arguments_skips_validation() -> None:
    spec = ToolSpec(name="anything")
    assert spec.arguments is None
    spec.validate(ToolCall("anything", {"whatever": [1, {"x": None}], "n": True}))
    spec.validate(ToolCall("anything"))


def test_spec_is_frozen() -> None:
    with pytest.raises(AttributeError):
        SPEC.read_only = False  # type: ignore[misc]
    assert SPEC.deterministic is None  # not declared: cached, and checked at its first hit in each task
    assert ToolSpec(name="x").read_only is False


def test_from_json_requires_an_object() -> None:
    for text in ("null", "[]", "3", '"x"'):
        with pytest.raises(InvalidToolCall, match="must be a JSON object"):
            ToolCall.from_json("t", text)


def test_a_number_argument_accepts_integers_but_not_booleans() -> None:
    spec = ToolSpec(name="wait", arguments={"seconds": float})
    spec.validate(ToolCall("wait", {"seconds": 3}))
    spec.validate(ToolCall("wait", {"seconds": 2.5}))
    with pytest.raises(InvalidToolCall, match="must be number"):
        spec.validate(ToolCall("wait", {"seconds": True}))
