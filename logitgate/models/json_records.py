"""The served benchmark's two JSON schemas, records written for them, and a check of a model's text
against a schema.

The schemas are the ones `python -m logitgate.bench.vllm --only served` requests: a person object with
unbounded strings, and the same with `maxLength`-bounded strings, a bounded age and at most two
tags. A record is written as xgrammar writes JSON without free whitespace (`disable_any_whitespace`):
compact separators, the properties in the schema's order.

`noisy_text` writes a record the way a model sometimes gets it wrong (free whitespace, an age as a
string, a missing key, a missing brace, single quotes, a trailing newline): the json_writer model
is trained on a few of these so that its distribution leaves the format now and then.
"""
from __future__ import annotations

import json
import math
import random
from typing import Any

from ..checks import is_integer

UNBOUNDED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                   "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "city", "tags"],
}
BOUNDED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["name", "age", "city", "tags"],
}
SCHEMAS = {"unbounded": UNBOUNDED_SCHEMA, "bounded": BOUNDED_SCHEMA}

FIRST_NAMES = (
    "Ada", "Alice", "Amara", "Ana", "Anna", "Ben", "Carlos", "Chen", "Chloe", "Daniel", "David", "Elena", "Emma",
    "Ethan", "Fatima", "Felix", "Grace", "Hana", "Hugo", "Ines", "Ivan", "Jack", "James", "Jin", "Jonas", "Kai",
    "Karin", "Laura", "Leo", "Liam", "Lina", "Lucas", "Maria", "Marta", "Mateo", "Mia", "Mohammed", "Nadia",
    "Nina", "Noah", "Olga", "Omar", "Oscar", "Paul", "Priya", "Rafael", "Rosa", "Sam", "Sara", "Sofia", "Tom",
    "Yara", "Yuki", "Zoe", "Alexander", "Christopher", "Gabriella", "Maximilian", "Konstantin", "Valentina",
)
LAST_NAMES = (
    "Smith", "Garcia", "Kim", "Nguyen", "Muller", "Rossi", "Silva", "Khan", "Cohen", "Ivanova", "Tanaka", "Lopez",
    "Novak", "Berg", "Costa", "Dubois", "Hansen", "Okafor", "Patel", "Schmidt", "Wang", "Yilmaz", "Andersson",
    "Fitzgerald", "Kowalczyk", "Papadopoulos",
)
CITIES = (
    "Oslo", "Paris", "Berlin", "Madrid", "Rome", "Lisbon", "Vienna", "Prague", "Warsaw", "Dublin", "London",
    "Tokyo", "Seoul", "Lima", "Cairo", "Lagos", "Nairobi", "Delhi", "Mumbai", "Dubai", "Sydney", "Toronto",
    "Chicago", "Boston", "Austin", "Denver", "Seattle", "Miami", "Quito", "Bogota", "Havana", "Athens",
    "Helsinki", "Zurich", "Munich", "Milan", "Porto", "Krakow", "Hanoi", "Manila", "Jakarta", "Bangkok",
    "San Francisco", "Rio de Janeiro", "Buenos Aires", "Johannesburg", "Los Angeles", "Kuala Lumpur",
    "Saint Petersburg", "Mexico City", "New York", "Ho Chi Minh City",
)
TAGS = (
    "dev", "ops", "ml", "data", "web", "music", "art", "chess", "golf", "yoga", "travel", "books", "food", "film",
    "games", "hiking", "tennis", "cooking", "python", "rust", "design", "admin", "sales", "remote", "new", "vip",
    "beta", "staff", "student", "parent", "photography", "gardening", "volunteering", "astronomy", "engineering",
    "marketing", "open-source", "machine-learning",
)


def random_record(rng: random.Random, bounded: bool, tilt: dict[str, list[float]] | None = None) -> dict[str, Any]:
    """A person for BOUNDED_SCHEMA (`bounded`: short strings, age 0-120, at most 2 short tags) or for
    UNBOUNDED_SCHEMA (full names, any city, up to 4 tags of any length; many break the bounds).
    `tilt` ("name": one logit per FIRST_NAMES entry, "city": per CITIES entry) skews the draw of
    the first name and the city; uniform without it."""
    tilt = tilt or {}

    def pick(options: tuple[str, ...], field: str, limit: int | None) -> str:
        logits = tilt.get(field, [0.0] * len(options))
        kept = [(o, w) for o, w in zip(options, logits) if limit is None or len(o) <= limit]
        top = max(w for _, w in kept)
        return rng.choices([o for o, _ in kept], weights=[math.exp(w - top) for _, w in kept])[0]

    first = pick(FIRST_NAMES, "name", 12 if bounded else None)
    city = pick(CITIES, "city", 12 if bounded else None)
    if bounded:
        name, tags = first, rng.sample([t for t in TAGS if len(t) <= 8], rng.randint(0, 2))
    else:
        name = f"{first} {rng.choice(LAST_NAMES)}" if rng.random() < 0.7 else first
        tags = rng.sample(TAGS, rng.randint(0, 4))
    age = rng.randint(18, 90) if rng.random() < 0.9 else rng.randint(0, 120)
    return {"name": name, "age": age, "city": city, "tags": tags}


def compact(record: dict[str, Any]) -> str:
    """The record as xgrammar's JSON without free whitespace writes it."""
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False)


def _without(record: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k != key}


# How a model gets a record wrong: each is one way out of the compact format (some still parse).
NOISE_KINDS = ("spaces", "age_string", "missing_key", "no_closing_brace", "single_quotes", "trailing_newline")


def noisy_text(rng: random.Random, record: dict[str, Any], kind: str | None = None) -> str:
    """The record written wrong in one of NOISE_KINDS (`kind`, or one drawn)."""
    kind = kind or rng.choice(NOISE_KINDS)
    if kind == "spaces":
        return json.dumps(record, ensure_ascii=False)  # ", " and ": ": valid JSON, not the compact format
    if kind == "age_string":
        return compact({**record, "age": str(record["age"])})
    if kind == "missing_key":
        return compact(_without(record, rng.choice(["age", "city", "tags"])))
    if kind == "no_closing_brace":
        return compact(record)[:-1]
    if kind == "single_quotes":
        return compact(record).replace('"', "'")
    return compact(record) + "\n"


def matches_schema(value: Any, schema: dict[str, Any]) -> bool:
    """`value` satisfies `schema`, for the keywords these schemas use (type, properties, required,
    items, maxLength, minimum, maximum, maxItems)."""
    kind = schema.get("type")
    if kind == "object":
        return (isinstance(value, dict) and all(key in value for key in schema.get("required", ()))
                and all(matches_schema(value[key], sub) for key, sub in schema.get("properties", {}).items() if key in value))
    if kind == "array":
        return (isinstance(value, list) and len(value) <= schema.get("maxItems", len(value))
                and all(matches_schema(item, schema.get("items", {})) for item in value))
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "integer":
        return (is_integer(value)
                and schema.get("minimum", value) <= value <= schema.get("maximum", value))
    return True


def check_text(text: str, schema: dict[str, Any]) -> dict[str, bool]:
    """`valid`: the text parses as JSON and satisfies the schema; `exact`: it is also the compact
    text with the schema's property order, i.e. what the structured-outputs grammar (xgrammar
    without free whitespace) accepts, so a constraint would have changed nothing."""
    try:
        value = json.loads(text)
    except ValueError:
        return {"valid": False, "exact": False}
    valid = matches_schema(value, schema)
    ordered = isinstance(value, dict) and list(value) == [k for k in schema.get("properties", {}) if k in value]
    return {"valid": valid, "exact": valid and ordered and text == compact(value)}
