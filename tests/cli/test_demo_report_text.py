"""The demo's text report shows every output visibly: empty and whitespace-only outputs are quoted."""
import pytest

from logitgate.cli.demo_report import _section_free, _show


@pytest.mark.parametrize(
    "text, shown",
    [("", "''"), ("   ", "'   '"), ("\n", "'\\n'"), (" Berlin", "' Berlin'"), ("a\tb", "'a\\tb'"),
     ("Europe/Berlin", "Europe/Berlin"), ("x" * 50, "x" * 17 + "...")],
)
def test_outputs_that_would_be_invisible_are_quoted(text, shown):
    assert _show(text, 20) == shown


def test_free_section_shows_a_blank_output():
    outputs = [{"hint": "Krakow", "text": " ", "in_tree": False, "in_catalog": False},
               {"hint": "Europe", "text": "Europe/Berlin", "in_tree": True, "in_catalog": True}]
    report = {"runs": [{"name": "free greedy", "outputs": outputs}], "tree": {"catalog_names": 598}}
    lines = _section_free(report)
    assert lines[1].split()[:2] == ["Krakow", "'"] and "' '" in lines[1] and "<- NOT a catalog name" in lines[1]
    assert lines[2].split()[:2] == ["Europe", "Europe/Berlin"]


def test_demo_page_excerpt_shows_the_schema_the_demo_prints():
    from pathlib import Path

    from logitgate.cli.demo import JSON_SCHEMA
    from logitgate.cli.demo_report import _section_json

    report = {"runs": [{"name": "json greedy (xgrammar)", "outputs": []}], "json_schema": JSON_SCHEMA}
    header = _section_json(report)[0]
    page = (Path(__file__).resolve().parents[2] / "docs" / "demo.md").read_text()
    assert header in page.splitlines()
