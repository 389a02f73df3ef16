"""The text rendering of a `logitgate demo` report (`logitgate.demo.run_demo`)."""
from __future__ import annotations

import textwrap
from typing import Any

COLUMNS = (
    ("config", "name"),
    ("tokens", "tokens"),
    ("passes", "target_forward_passes"),
    ("saved", "saved"),
    ("tok/pass", "tokens_per_sequence_step"),
    ("draft", "draft_forward_passes"),
    ("accept", "acceptance_rate"),
    ("forced", "forced_tokens"),
    ("mask ms", "masking_ms_per_step"),
    ("sample ms", "sampling_ms_per_step"),
    ("tree ms", "tree_step_ms_per_step"),
    ("step ms", "step_ms"),
    ("share", "overhead_share"),
    ("total ms", "wall_ms"),
)
LEGEND = (
    "passes: target forward passes (one batched call over all prompts); saved: vs the plain run with the "
    "same constraint and sampling; tok/pass: tokens per sequence per target pass; draft: draft-model passes; "
    "accept: accepted / proposed drafts (forced tokens apart); forced: forced tokens emitted as drafts; "
    "mask ms, sample ms: per target step, dense constraint masking and sampling + draft verification; "
    "tree ms: the same three for tree rows done in one sparse step (tree_spec_step); share: their part of the step time"
)


def _show(text: str, width: int) -> str:
    """One line, at most `width` characters (model output may hold newlines or run on). Text that
    would not be seen as it is (empty, whitespace only, leading or trailing whitespace, control
    characters) is shown quoted with escapes, as Python's repr: `''`, `' '`, `'\\n'`."""
    flat = text if text.isprintable() and text.strip() == text and text else repr(text)
    return flat if len(flat) <= width else flat[: width - 3] + "..."


def _runs(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in report["runs"]}


def _section_free(report: dict[str, Any]) -> list[str]:
    run = _runs(report)["free greedy"]
    known = "catalog name" if report["tree"]["catalog_names"] is not None else "path of the tree"
    lines = ["(a) Unconstrained greedy decoding: what the model writes on its own"]
    bad = 0
    for o in run["outputs"]:
        ok = o["in_tree"] and o["in_catalog"] is not False
        bad += not ok
        lines.append(f"    {o['hint']:<10} {_show(o['text'], 40):<42} {'' if ok else '<- NOT a ' + known}")
    lines.append(f"    {bad} of {len(run['outputs'])} outputs are not a {known}: the motivation for constraints.")
    return lines


def _section_tree(report: dict[str, Any]) -> list[str]:
    runs = _runs(report)
    tree = report["tree"]
    size = f"{tree['catalog_names']} names, " if tree["catalog_names"] is not None else ""
    cols = ["tree greedy", "tree sampled", "tree sampled + spec"]
    heads = ["greedy", f"sampled (T={runs['tree sampled']['temperature']})", "sampled + spec"]
    lines = [
        f"(b) Tree-constrained decoding over {tree['source']} ({size}{tree['nodes']} nodes, depth {tree['max_depth']})",
        f"    {'hint':<10} " + " ".join(f"{h:<34}" for h in heads),
    ]
    for i, o in enumerate(runs[cols[0]]["outputs"]):
        lines.append(f"    {o['hint']:<10} " + " ".join(f"{_show(runs[c]['outputs'][i]['text'], 33):<34}" for c in cols))
    return lines


def _section_spec(report: dict[str, Any]) -> list[str]:
    runs = _runs(report)
    lines = [
        f"(c) Speculative decoding ({report['drafter']}, k={report['num_speculative_tokens']}) and jump-forward "
        "(the tree's forced tokens appended as drafts, always accepted)"
    ]
    for name, same in report["check"]["greedy_speculative_matches_plain"].items():
        lines.append(f"    {name:<32} outputs {'identical to' if same else 'DIFFER from'} plain greedy")
    for name in ("tree sampled + spec + jump-fwd",):
        outs = ", ".join(_show(o["text"], 30) for o in runs[name]["outputs"])
        lines.append(f"    {name:<32} {outs}")
    lines.append("    (sampled runs draw other names from the same constrained distribution: rejection sampling is exact)")
    return lines


def _section_json(report: dict[str, Any]) -> list[str]:
    run = _runs(report)["json greedy (xgrammar)"]
    props = report["json_schema"]["properties"]
    lines = [
        "(d) JSON schema through xgrammar (StructuredOutputManager, TokenizerInfo from the tokenizer): "
        f'{{"zone": string ~ {props["zone"]["pattern"]}, "utc_offset_hours": integer in '
        f'[{props["utc_offset_hours"]["minimum"]}, {props["utc_offset_hours"]["maximum"]}]}}'
    ]
    for o in run["outputs"]:
        verdict = "valid" if o["valid"] else f"INVALID: {o['problem']}"
        lines.append(f"    {o['hint']:<10} {_show(o['text'], 70):<72} {verdict}")
    lines.append("    The model was never trained on JSON: the grammar guarantees the structure, the content is nonsense.")
    return lines


def _section_check(report: dict[str, Any]) -> list[str]:
    check = report["check"]
    status = "OK" if check["all_constrained_valid"] else "FAILED"
    differ = [name for name, same in check["greedy_speculative_matches_plain"].items() if not same]
    catalog = "catalog name and a " if report["tree"]["catalog_names"] is not None else ""
    lines = [
        f"Check: {check['valid']} of {check['constrained_outputs']} constrained outputs are valid "
        f"(tree: {check['tree_outputs']}, each must be a {catalog}complete path of the tree; JSON: "
        f"{check['json_outputs']}, each must parse and match the schema) -> {status}"
    ]
    for bad in check["invalid"]:
        lines.append(f"    INVALID {bad['run']} / {bad['hint']}: {bad['text']!r} {bad['problem'] or ''}")
    if differ:
        lines.append(f"Check: greedy outputs of {', '.join(differ)} differ from plain greedy -> FAILED")
    return lines


def _cell(run: dict[str, Any], key: str) -> str:
    stats, metrics = run["stats"], run["metrics"]
    if key == "name":
        return run["name"]
    if key == "saved":
        saved = metrics["forward_passes_saved"]
        return "-" if saved is None else f"{saved} ({100 * metrics['forward_passes_saved_share']:.0f}%)"
    if key == "tokens_per_sequence_step":
        return f"{stats[key]:.2f}"
    if key == "acceptance_rate":
        rate = stats["acceptance_rate"]
        return "-" if rate is None else f"{rate:.2f}"
    if key == "overhead_share":
        return f"{100 * metrics[key]:.0f}%"
    if key == "wall_ms":
        return f"{1000 * metrics['wall_seconds']:.0f}"
    if key in metrics:
        return f"{metrics[key]:.2f}" if key != "step_ms" else f"{metrics[key]:.1f}"
    return str(stats[key])


def format_table(report: dict[str, Any]) -> list[str]:
    rows = [[head for head, _ in COLUMNS]] + [[_cell(r, key) for _, key in COLUMNS] for r in report["runs"]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = []
    for n, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("    " + "  ".join(cells))
        if n == 0:
            lines.append("    " + "  ".join("-" * w for w in widths))
    return lines


def format_report(report: dict[str, Any]) -> str:
    sec = report["seconds"]
    quick = ", --quick" if report["quick"] else ""
    lines = [
        f"logitgate demo: {report['model']} on {report['device']} ({report['torch_device']}, "
        f"{report['threads']} thread{'s' if report['threads'] != 1 else ''}{quick})",
        f"load {sec['load']:.1f} s, warm-up {sec['warmup']:.1f} s, {len(report['runs'])} runs {sec['runs']:.1f} s",
        "",
        *_section_free(report),
        "",
        *_section_tree(report),
        "",
        *_section_spec(report),
        "",
        *_section_json(report),
        "",
        *_section_check(report),
        "",
        "(e) Cost per configuration",
        *format_table(report),
        *textwrap.wrap(LEGEND, 110, initial_indent="    ", subsequent_indent="    "),
    ]
    return "\n".join(lines)
