"""The validity checker of bench/constrained.py: an output cut by its length is valid when
every complete item matches the item schema, wherever the cut falls, also between the
"," and the " " of the item separator (separate tokens in SmolLM2's vocabulary)."""

from __future__ import annotations

import json

import pytest

from .conftest import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench/constrained.py", "bench_constrained")


ITEM = json.dumps({"name": "ab\u00e9\u672c", "age": 7, "role": "user", "active": True}, ensure_ascii=False)


@pytest.mark.parametrize("tail", ["", ",", ", ", ", {", ', {"na', ', {"name": "x'])
def test_every_cut_of_valid_items_is_valid(bench, tail):
    ok, items, refused = bench.valid_prefix("[" + ITEM + ", " + ITEM + tail)
    assert ok and refused is None
    assert items == 2


@pytest.mark.parametrize("bad, refused", [
    (ITEM + ",,", ",,"),
    (ITEM + "]", "]"),  # the schema's minItems: the array never closes
    (ITEM + ",\n", ",\n"),
    (ITEM.replace("ab\u00e9\u672c", "a" * 13), ITEM.replace("ab\u00e9\u672c", "a" * 13)),
])
def test_what_the_schema_refuses_is_refused_and_kept(bench, bad, refused):
    ok, items, got = bench.valid_prefix("[" + bad)
    assert not ok
    assert got == refused


def test_max_length_counts_code_points(bench):
    name = "\u00e9" * 11 + "\U0001f600"  # 12 code points, 24 bytes, 13 UTF-16 units
    text = "[" + json.dumps({"name": name, "age": 1, "role": "guest", "active": False}, ensure_ascii=False) + ", "
    assert bench.valid_prefix(text)[0]
