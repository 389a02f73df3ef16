"""SamplingParams and StructuredOutputsParams: validation with errors that name the field."""
import pytest

from logitgate.sampling import SamplingParams, SamplingType, StructuredOutputsParams


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.1), "temperature must be a finite number >= 0"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k must be an int"),
        (dict(top_k=2.5), "top_k"),
        (dict(min_p=1.2), r"min_p must be in \[0, 1\]"),
        (dict(n=0), "n must be an int >= 1"),
        (dict(seed="7"), "seed must be an int"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens must be an int >= 0"),
        (dict(min_tokens=20, max_tokens=10), r"min_tokens \(20\) must not exceed max_tokens \(10\)"),
        (dict(stop_token_ids=[1, -3]), "stop_token_ids has -3"),
        (dict(stop_token_ids="abc"), "stop_token_ids must be a list"),
        (dict(logit_bias={"x": 1.0}), "logit_bias has key 'x'"),
        (dict(logit_bias={5: float("inf")}), r"logit_bias\[5\] must be a finite number"),
        (dict(logprobs=-1), "logprobs"),
        (dict(max_thinking_tokens=-1), "max_thinking_tokens"),
        (dict(structured_outputs={"json": {}}), "structured_outputs must be a StructuredOutputsParams"),
        (dict(temperature=0.0, n=2), "n must be 1 for greedy sampling"),
        (dict(ignore_eos=1), "ignore_eos must be a bool"),
    ],
)
def test_bad_values_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_defaults_and_normalisation():
    params = SamplingParams()
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.n) == (1.0, 1.0, 0, 0.0, 1)
    assert params.sampling_type == SamplingType.RANDOM
    assert SamplingParams(top_k=-1).top_k == 0  # -1 means "all tokens", as 0
    assert SamplingParams(seed=3).sampling_type == SamplingType.RANDOM_SEED
    greedy = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.3)
    assert greedy.sampling_type == SamplingType.GREEDY
    assert (greedy.top_k, greedy.top_p, greedy.min_p) == (0, 1.0, 0.0)  # greedy ignores the filters
    assert SamplingParams(logit_bias={"12": 0.5}).logit_bias == {12: 0.5}  # JSON keys


def test_stop_tokens_and_vocabulary_check():
    params = SamplingParams(stop_token_ids=[5, 6], logit_bias={9: 1.0})
    assert params.all_stop_token_ids(2) == {2, 5, 6}
    assert SamplingParams(ignore_eos=True, stop_token_ids=[5]).all_stop_token_ids(2) == {5}
    params.verify(10)
    with pytest.raises(ValueError, match="logit_bias has token id 9, outside the vocabulary"):
        params.verify(9)
    with pytest.raises(ValueError, match="stop_token_ids has token id 6"):
        SamplingParams(stop_token_ids=[6]).verify(6)


@pytest.mark.parametrize(
    "kwargs, kind",
    [
        (dict(json={"type": "object"}), "json"),
        (dict(json='{"type": "string"}'), "json"),
        (dict(json_object=True), "json_object"),
        (dict(regex=r"\d+"), "regex"),
        (dict(grammar='root ::= "a"'), "grammar"),
        (dict(choice=["yes", "no"]), "choice"),
        (dict(structural_tag={"type": "structural_tag"}), "structural_tag"),
        (dict(prefix_dict={"start_token_id": 1, "end_token_id": 2, "prefix_dict": {}}), "prefix_dict"),
        (dict(token_trie="/path/to/trie.json", end_token_id=2), "token_trie"),
    ],
)
def test_structured_outputs_one_constraint(kwargs, kind):
    params = StructuredOutputsParams(**kwargs)
    assert params.kind == kind
    # Sequences are stored as tuples (the params are frozen and hashable).
    assert params.value == (tuple(kwargs[kind]) if kind == "choice" else kwargs[kind])
    assert SamplingParams(structured_outputs=params).structured_outputs is params


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(), "exactly one of json, json_object, regex, grammar, choice, structural_tag, prefix_dict, token_trie; got none"),
        (dict(json={}, regex="a"), "got json, regex"),
        (dict(json_object=False), "got none"),
        (dict(json=5), "json must be a JSON schema"),
        (dict(regex=""), "regex must be a non-empty string"),
        (dict(choice=[]), "choice must be a non-empty list"),
        (dict(choice=["a", 3]), r"choice\[1\] must be a string"),
        (dict(json_object="yes"), "json_object must be True or None"),
        (dict(regex="a", end_token_id=2), "end_token_id applies to token_trie only"),
        (dict(token_trie={}, end_token_id=-1), "end_token_id must be a non-negative int"),
        (dict(prefix_dict=3), "prefix_dict must be a dict, a JSON string or a path"),
    ],
)
def test_structured_outputs_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_structured_outputs_takes_the_managers_params():
    # generate() registers params.structured_outputs with the StructuredOutputManager, which takes
    # logitgate.StructuredOutputsParams (structured/params.py): SamplingParams must accept that class.
    import logitgate

    params = SamplingParams(structured_outputs=logitgate.StructuredOutputsParams(json={"type": "object"}))
    assert params.structured_outputs.kind == "json"
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})
