"""backends/reference/ holds only the torch references, one module per kernel family; the formats
and sampling rules that production code uses live in backends/formats.py and
backends/sampling_rules.py, and the reference package still answers to every name it had."""
import ast
import pathlib

import logitgate
from logitgate.backends import formats, reference, sampling_rules

PACKAGE = pathlib.Path(logitgate.__file__).parent
REFERENCE_DIR = PACKAGE / "backends" / "reference"

# Every public name of the single-file backends/reference.py this package replaced.
OLD_NAMES = """BITS_PER_WORD num_bitmask_words unpack_bitmask pack_bitmask apply_token_bitmask_reference
gather_csr_rows candidate_tokens gather_candidate_logits_reference candidate_argmax_reference
candidate_column_tokens sample_candidates_reference keep_candidate_logits_reference
fill_tree_bitmask_reference spec_layout leading_true_counts tempered_logits
rejection_greedy_accept_reference rejection_random_accept_reference recovery_weights_reference
rejection_recover_inverse_cdf_reference rejection_recover_exponential_reference rejection_output_reference
undefined_logit_rows undefined_prob_rows fallback_tokens top_k_disabled apply_top_k_top_p_reference
top_p_threshold exponential_race inverse_cdf_sample_reference fill_exponential draw_uniforms
random_sample_reference""".split()


def test_reference_answers_to_every_old_name():
    missing = [name for name in OLD_NAMES if not hasattr(reference, name)]
    assert missing == []
    assert sorted(reference.__all__) == sorted(set(reference.__all__))
    assert all(hasattr(reference, name) for name in reference.__all__)


def test_formats_and_rules_are_the_same_objects_through_reference():
    for module in (formats, sampling_rules):
        for name, value in vars(module).items():
            if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__:
                assert getattr(reference, name) is value, name
    assert reference.rejection_output_reference is formats.rejection_output


def test_reference_modules_hold_only_references():
    """A function defined under backends/reference/ is a `*_reference` (or a private helper of one)."""
    for path in REFERENCE_DIR.glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef):
                assert node.name.endswith("_reference") or node.name.startswith("_"), f"{path.name}: {node.name}"


def _reference_names_used(path: pathlib.Path) -> list[str]:
    """Names a module takes from backends.reference (imports and `reference.X` attributes)."""
    tree = ast.parse(path.read_text())
    used = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[-1] == "reference":
            used += [alias.name for alias in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "reference":
            used.append(node.attr)
    return used


def test_production_code_takes_only_references_from_reference():
    """Production code may call a torch reference (Backend's defaults do), but a format or a rule it
    needs comes from formats.py / sampling_rules.py, not from the test oracle."""
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        if REFERENCE_DIR in path.parents:
            continue
        wrong += [f"{path.relative_to(PACKAGE)}: {name}" for name in _reference_names_used(path)
                  if not name.endswith("_reference")]
    assert wrong == []
