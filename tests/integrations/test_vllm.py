"""The vLLM plugin against vLLM's real interface classes (vllm 0.33.0, installed by `make test`
with --no-deps): its LogitsProcessor base, BatchUpdateBuilder / BatchUpdate, MoveDirectionality,
SamplingParams, the FQCN loader and the front end's parameter validation. VllmConfig itself needs
vLLM's full dependency set, so the processor gets a stand-in exposing model_config.get_vocab_size().
The fallback without vLLM is tested by hiding vllm from the import system."""
import importlib
import inspect
import json
import random
import re
import sys
from importlib.metadata import entry_points
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import logitgate.integrations
import logitgate.integrations.vllm  # noqa: F401  (in sys.modules before the fallback test swaps it)
from logitgate import TreeDFA
from logitgate.sampling.processors import BatchUpdateBuilder as LogitgateBuilder
from logitgate.sampling.processors import LogitsProcessor as LogitgateLogitsProcessor
from tests.helpers.persistent_batch import PersistentBatch

try:
    from vllm import SamplingParams
    from vllm.v1.sample import logits_processor as vllm_lp

    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False

needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not importable (make test installs it)")

V = 48
EOS = 2
CONFIG = {"start_token_id": 40, "end_token_id": EOS, "prefix_dict": {
    "40": [10, 11, 12], "40_10": [13], "40_10_13": [14, 15], "40_11": [], "40_12": [16], "40_12_16": [EOS]}}
TRIE = {"modelId": "m", "descriptors": [{"path": "p", "leaves": [{"name": "x", "tokens": [20, 21]}, {"name": "y", "tokens": [20, 22, 23]}]}]}
FQCN = "logitgate.integrations.vllm:TreeDecodeLogitsProcessor"
NEG_INF = float("-inf")


def vllm_config(vocab_size=V):
    return SimpleNamespace(model_config=SimpleNamespace(get_vocab_size=lambda: vocab_size))


def allowed(row):
    return torch.nonzero(row > NEG_INF).flatten().tolist()


@pytest.fixture
def plugin():
    from logitgate.integrations.vllm import TreeDecodeLogitsProcessor

    return TreeDecodeLogitsProcessor(vllm_config(), torch.device("cpu"), False)


@needs_vllm
def test_it_is_a_vllm_logits_processor_with_vllms_constructor():
    from logitgate.integrations.vllm import VLLM_AVAILABLE, TreeDecodeLogitsProcessor

    assert VLLM_AVAILABLE and issubclass(TreeDecodeLogitsProcessor, vllm_lp.LogitsProcessor)
    ours = list(inspect.signature(TreeDecodeLogitsProcessor.__init__).parameters)
    theirs = list(inspect.signature(vllm_lp.LogitsProcessor.__init__).parameters)
    assert ours == theirs == ["self", "vllm_config", "device", "is_pin_memory"]
    assert isinstance(inspect.getattr_static(TreeDecodeLogitsProcessor, "validate_params"), classmethod)
    assert not TreeDecodeLogitsProcessor.__abstractmethods__
    procs = vllm_lp.LogitsProcessors([TreeDecodeLogitsProcessor(vllm_config(), torch.device("cpu"), False)])
    assert len(procs.non_argmax_invariant) == 1 and not procs.argmax_invariant


@needs_vllm
def test_vllm_loads_it_by_fqcn_and_only_the_general_plugin_is_advertised():
    """The general plugin is the one entry point (VLLM_PLUGINS governs it); a logits-processor
    entry point would load even when VLLM_PLUGINS excludes logitgate, and Model Runner V2 refuses
    V1-interface classes found there."""
    from logitgate.integrations.vllm import TreeDecodeLogitsProcessor

    assert vllm_lp._load_logitsprocs_by_fqcns([FQCN]) == [TreeDecodeLogitsProcessor]
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert '"vllm.logits_processors"' not in pyproject
    section = re.search(r'\[project\.entry-points\."vllm\.general_plugins"\]\n(.*?)(?:\n\[|\Z)', pyproject, re.S)
    assert section and re.findall(r'^(\w+) = "(.*)"', section.group(1), re.M) == [
        ("logitgate", "logitgate.integrations.vllm.plugin:register")]
    from vllm.plugins import DEFAULT_PLUGINS_GROUP

    assert DEFAULT_PLUGINS_GROUP == "vllm.general_plugins"
    installed = [ep for ep in entry_points(group=DEFAULT_PLUGINS_GROUP) if ep.name == "logitgate"]
    if installed:  # an install from this pyproject (`make test`); an older editable install lacks it
        from logitgate.integrations.vllm.plugin import register

        assert installed[0].load() is register
    assert not [ep for ep in entry_points(group=vllm_lp.LOGITSPROCS_GROUP) if ep.value.startswith("logitgate")]


@needs_vllm
def test_masks_follow_a_persistent_batch_built_with_vllms_builder(plugin):
    """vLLM's BatchUpdateBuilder and MoveDirectionality, requests with vLLM's SamplingParams: random
    adds (lowest freed row first), removals, condensing moves and swaps; every row's mask must be
    TreeDFA.allowed of its request's walk, and rows without tree arguments stay untouched."""
    rng = random.Random(7)
    tree = TreeDFA.from_prefix_dict(CONFIG, vocab_size=V, device="cpu")
    trie = TreeDFA.from_token_trie(TRIE, end_token_id=EOS, vocab_size=V, device="cpu")
    kinds = {"tree": ({"tree_decode": CONFIG}, tree), "trie": ({"token_trie": json.dumps(TRIE), "end_token_id": EOS}, trie),
             "none": (None, None), "other": ({"unrelated": 1}, None)}

    def new_request(rng):
        kind = rng.choice(list(kinds))
        output = [rng.choice([10, 12, 20]) for _ in range(rng.randint(0, 2))] if rng.random() < 0.2 else []
        return {"kind": kind, "params": SamplingParams(temperature=rng.choice([0.0, 1.0]), extra_args=kinds[kind][0]),
                "prompt": [40], "output": output}

    batch = PersistentBatch(rng, new_request, vllm_lp.BatchUpdateBuilder(), vllm_lp.MoveDirectionality)
    checked = 0
    for step in range(40):
        plugin.update_state(batch.step_changes())
        if not batch.size:
            continue
        logits = torch.randn(batch.size, V)
        got = plugin.apply(logits.clone())
        for row, request in enumerate(batch.slots):
            expected_tree = kinds[request["kind"]][1]
            if expected_tree is None:
                assert torch.equal(got[row], logits[row]), f"step {step}: row {row} has no tree but was changed"
                continue
            want = expected_tree.allowed(expected_tree.walk(request["output"]))
            assert allowed(got[row]) == want, f"step {step}, row {row}, request {request['id']}"
            assert torch.equal(got[row, want], logits[row, want])
            checked += 1
        for row, request in enumerate(batch.slots):  # the engine appends the sampled token
            request["output"].append(int(got[row].argmax()) if rng.random() < 0.8 else rng.randrange(V))
    assert checked > 50


@needs_vllm
def test_async_scheduling_placeholders(plugin):
    out = []
    builder = vllm_lp.BatchUpdateBuilder()
    builder.added.append((0, SamplingParams(extra_args={"tree_decode": CONFIG}), [40], out))
    plugin.update_state(builder.get_and_reset(1))
    out.append(-1)  # vLLM appends a placeholder; update_state runs before it is filled
    plugin.update_state(None)
    out[-1] = 10  # InputBatch.update_async_output_token_ids, just before sampling
    assert allowed(plugin.apply(torch.zeros(1, V))[0]) == [13]


BAD_ARGS = [
    ({"tree_decode": CONFIG, "token_trie": TRIE}, "both 'tree_decode' and 'token_trie'"),
    ({"tree_decode": 5}, "must be a dict, a JSON string or a path, got int"),
    ({"token_trie": TRIE}, "needs extra_args['end_token_id']"),
    ({"end_token_id": EOS}, "applies to 'token_trie'"),
    ({"tree_decode": {"start_token_id": 40, "prefix_dict": {}}}, "end_token_id"),
    ({"tree_decode": {**CONFIG, "prefix_dict": {"40": ["x"]}}}, "'x'"),
    ({"tree_decode": "{not json"}, "not valid JSON"),
    ({"token_trie": TRIE, "end_token_id": EOS, "token_trie_path": "missing"}, "no descriptor with path 'missing'"),
]


@needs_vllm
@pytest.mark.parametrize("extra, message", BAD_ARGS)
def test_vllms_front_end_rejects_bad_tree_arguments(extra, message):
    from vllm.exceptions import VLLMValidationError

    from logitgate.integrations.vllm import TreeDecodeLogitsProcessor

    params = SamplingParams(extra_args=extra)
    with pytest.raises(ValueError, match="extra_args") as err:
        TreeDecodeLogitsProcessor.validate_params(params)
    assert message in str(err.value)
    with pytest.raises(VLLMValidationError, match="extra_args"):  # what the OpenAI server turns into HTTP 400
        vllm_lp.validate_logits_processors_parameters([FQCN], params)


@needs_vllm
def test_valid_and_tree_less_requests_pass_validation():
    from logitgate.integrations.vllm import TreeDecodeLogitsProcessor

    for extra in (None, {}, {"other_plugin": 1}, {"tree_decode": CONFIG}, {"token_trie": TRIE, "end_token_id": EOS}):
        vllm_lp.validate_logits_processors_parameters([FQCN], SamplingParams(extra_args=extra))
        TreeDecodeLogitsProcessor.validate_params(SamplingParams(extra_args=extra))


@needs_vllm
def test_token_ids_outside_the_models_vocabulary_fail_in_the_worker_naming_the_row(plugin):
    builder = vllm_lp.BatchUpdateBuilder()
    builder.added.append((0, SamplingParams(extra_args={"tree_decode": CONFIG}), None, []))
    builder.added.append((1, SamplingParams(extra_args={"tree_decode": {**CONFIG, "prefix_dict": {"40": [V + 1]}}}), None, []))
    TreeDecodeLogitsProcessor = type(plugin)
    TreeDecodeLogitsProcessor.validate_params(builder.added[1][1])  # the front end cannot know the vocabulary
    with pytest.raises(ValueError, match=f"row 1: .*{V + 1}"):
        plugin.update_state(builder.get_and_reset(2))
    assert torch.equal(plugin.apply(torch.zeros(2, V)), torch.zeros(2, V))  # nothing was added


def test_without_vllm_the_module_imports_over_logitgates_interface(monkeypatch):
    """Hide vllm (and any vllm module already imported) and import the integration afresh."""
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")] + ["vllm"]:
        monkeypatch.setitem(sys.modules, name, None)
    for name in ("logitgate.integrations.vllm", "logitgate.integrations.vllm.tree.logits_processor"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(logitgate.integrations, "vllm", None, raising=False)
    module = importlib.import_module("logitgate.integrations.vllm")
    assert not module.VLLM_AVAILABLE
    cls = module.TreeDecodeLogitsProcessor
    assert issubclass(cls, LogitgateLogitsProcessor)
    from logitgate.sampling import SamplingParams as LogitgateParams

    proc = cls(V, "cpu", False)  # outside vLLM the config may be the vocabulary size
    builder = LogitgateBuilder()
    out = [12]
    builder.add(0, LogitgateParams(extra_args={"tree_decode": CONFIG}), None, out)
    proc.update_state(builder.get_and_reset(1))
    assert allowed(proc.apply(torch.zeros(1, V))[0]) == [16]
    with pytest.raises(ValueError, match="both"):
        cls.validate_params(LogitgateParams(extra_args={"tree_decode": CONFIG, "token_trie": TRIE}))
