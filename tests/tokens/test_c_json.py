"""llama.cpp's ``tojson`` (tokens/_c_json.py): the json.dumps fast path equals the reference writer wherever it is
taken, and the reference writes floats as a C++ stream does. Live proof: the llama.cpp corpus (tests/server_corpus.py,
floats and integers past int64 in tool arguments and schemas) recorded from llama-server."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2.exceptions import TemplateError

from contextkeeper.tokens._c_json import c_json, c_tojson, has_float

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**63 - 1), st.text(max_size=12)
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=20,
)
indents = st.one_of(st.none(), st.integers(min_value=0, max_value=4), st.just("\t"), st.just(True))
separators = st.one_of(st.none(), st.tuples(st.sampled_from([",", ", ", ";"]), st.sampled_from([":", ": ", "="])))


@settings(max_examples=300, deadline=None)
@given(value=values, ascii=st.booleans(), indent=indents, seps=separators)
def test_the_fast_path_writes_what_the_reference_writes(value: Any, ascii: bool, indent: Any, seps: Any) -> None:
    assert not has_float(value)
    width = indent if type(indent) is int else -1
    item_sep = seps[0] if seps else None
    key_sep = seps[1] if seps else ": "
    assert c_tojson(value, ascii, indent, seps) == c_json(value, width, item_sep, key_sep, ascii)


@pytest.mark.parametrize(
    ("value", "written"),
    [
        (1.0, "1"),
        (2.5, "2.5"),
        (3.14159265, "3.14159"),
        (1234567.0, "1.23457e+06"),
        (1e-7, "1e-07"),
        (-0.0, "-0"),
        (100000.0, "100000"),
        ({"a": [1.5, 2]}, '{"a": [1.5, 2]}'),
    ],
)
def test_floats_are_written_with_six_significant_digits(value: Any, written: str) -> None:
    assert has_float(value)
    assert c_tojson(value) == written


def test_an_indent_nests_as_python_does_and_sort_keys_fails() -> None:
    value = {"b": [1, {"c": 0.5}], "a": {}}
    assert c_tojson(value, indent=2) == '{\n  "b": [\n    1,\n    {\n      "c": 0.5\n    }\n  ],\n  "a": {}\n}'
    with pytest.raises(TemplateError, match="sort_keys"):
        c_tojson(value, sort_keys=True)
