import pytest

from logitgate.structured.params import CONSTRAINT_KINDS, StructuredOutputsParams


@pytest.mark.parametrize(
    "kwargs, kind",
    [
        ({"json": {"type": "object"}}, "json"),
        ({"json": '{"type": "object"}'}, "json"),
        ({"json_object": True}, "json_object"),
        ({"regex": "a+"}, "regex"),
        ({"grammar": 'root ::= "a"'}, "grammar"),
        ({"choice": ["x", "y"]}, "choice"),
        ({"structural_tag": {"type": "structural_tag"}}, "structural_tag"),
        ({"prefix_dict": {"start_token_id": 1, "end_token_id": 2, "prefix_dict": {}}}, "prefix_dict"),
        ({"token_trie": '{"descriptors": []}'}, "token_trie"),
    ],
)
def test_exactly_one_kind(kwargs, kind):
    params = StructuredOutputsParams(**kwargs)
    assert params.kind == kind
    assert params.spec == getattr(params, kind)
    assert kind in CONSTRAINT_KINDS


def test_none_or_two_constraints_name_what_was_given():
    with pytest.raises(ValueError, match="got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got json_object, regex"):
        StructuredOutputsParams(json_object=True, regex="a")
    with pytest.raises(ValueError, match="regex, choice"):
        StructuredOutputsParams(regex="a", choice=["b"])


def test_json_object_false_is_not_a_constraint():
    with pytest.raises(ValueError, match="got none"):
        StructuredOutputsParams(json_object=False)
    assert StructuredOutputsParams(json_object=False, regex="a").kind == "regex"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"regex": 3}, "regex must be a non-empty string"),
        ({"grammar": ["x"]}, "grammar must be a non-empty string"),
        ({"json": 5}, "json must be a JSON schema as a dict or a JSON string"),
        ({"choice": "abc"}, "choice must be a non-empty list of strings"),
        ({"choice": []}, "choice must be a non-empty list of strings"),
        ({"choice": ["a", 2]}, r"choice\[1\]"),
        ({"json_object": 1}, "json_object must be True or None"),
    ],
)
def test_bad_values_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_frozen_hashable_and_cache_key_ignores_dict_order():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    b = StructuredOutputsParams(json={"properties": {"a": {"type": "integer"}}, "type": "object"})
    assert a.cache_key() == b.cache_key()
    assert hash(a) == hash(b) and a == b
    assert StructuredOutputsParams(choice=["x"]).choice == ("x",)
    with pytest.raises(AttributeError):
        a.regex = "x"  # type: ignore[misc]
    compact = StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True)
    assert compact.cache_key() != StructuredOutputsParams(json={"type": "object"}).cache_key()
