"""The served benchmark's schemas and the records the json_writer model is trained on."""
import json
import random

import pytest

from logitgate.models.json_records import (
    BOUNDED_SCHEMA,
    NOISE_KINDS,
    SCHEMAS,
    UNBOUNDED_SCHEMA,
    check_text,
    compact,
    matches_schema,
    noisy_text,
    random_record,
)


def test_records_for_the_bounded_schema_satisfy_it_and_unbounded_ones_sometimes_break_it():
    rng = random.Random(0)
    bounded = [random_record(rng, bounded=True) for _ in range(500)]
    unbounded = [random_record(rng, bounded=False) for _ in range(500)]
    assert all(matches_schema(r, BOUNDED_SCHEMA) and matches_schema(r, UNBOUNDED_SCHEMA) for r in bounded)
    assert all(matches_schema(r, UNBOUNDED_SCHEMA) for r in unbounded)
    assert 0.2 < sum(not matches_schema(r, BOUNDED_SCHEMA) for r in unbounded) / 500 < 0.9


def test_compact_text_is_exact_for_both_schemas():
    record = {"name": "Ana", "age": 31, "city": "Oslo", "tags": ["dev", "ml"]}
    text = compact(record)
    assert text == '{"name":"Ana","age":31,"city":"Oslo","tags":["dev","ml"]}'
    assert all(check_text(text, schema) == {"valid": True, "exact": True} for schema in SCHEMAS.values())


@pytest.mark.parametrize("kind", NOISE_KINDS)
def test_every_kind_of_noise_leaves_the_format(kind):
    rng = random.Random(1)
    for _ in range(50):
        text = noisy_text(rng, random_record(rng, bounded=True), kind)
        assert not any(check_text(text, schema)["exact"] for schema in SCHEMAS.values()), text


# (valid, exact) for the unbounded schema, then for the bounded one
@pytest.mark.parametrize(("text", "unbounded", "bounded"), [
    ('{"name":"Christopher Fitzgerald","age":40,"city":"Oslo","tags":[]}', (True, True), (False, False)),
    ('{"name":"Ana","age":131,"city":"Oslo","tags":[]}', (True, True), (False, False)),
    ('{"name":"Ana","age":31,"city":"Oslo","tags":["a","b","c"]}', (True, True), (False, False)),
    ('{"name":"Ana","age":31,"city":"Oslo","tags":["gardening"]}', (True, True), (False, False)),
    ('{"name": "Ana", "age": 31, "city": "Oslo", "tags": []}', (True, False), (True, False)),
    ('{"age":31,"name":"Ana","city":"Oslo","tags":[]}', (True, False), (True, False)),
    ('{"name":"Ana","age":"31","city":"Oslo","tags":[]}', (False, False), (False, False)),
    ('{"name":"Ana","age":true,"city":"Oslo","tags":[]}', (False, False), (False, False)),
    ('{"name":"Ana","age":31,"tags":[]}', (False, False), (False, False)),
    ('{"name":"Ana","age":31,"city":"Oslo","tags":[]', (False, False), (False, False)),
])
def test_check_text(text, unbounded, bounded):
    for schema, (valid, exact) in ((UNBOUNDED_SCHEMA, unbounded), (BOUNDED_SCHEMA, bounded)):
        assert check_text(text, schema) == {"valid": valid, "exact": exact}


def test_a_tilt_skews_the_first_name():
    rng = random.Random(2)
    from logitgate.models.json_records import FIRST_NAMES

    tilt = {"name": [8.0 if name == "Yara" else 0.0 for name in FIRST_NAMES]}
    names = [random_record(rng, bounded=True, tilt=tilt)["name"] for _ in range(200)]
    assert names.count("Yara") > 150
    assert json.loads(compact(random_record(rng, bounded=False, tilt=tilt)))
