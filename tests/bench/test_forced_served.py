"""The forced-drafts served benchmark's case order and summary (no server: synthetic runs)."""
from logitgate.bench import forced_served


def _case(tps: float, tokens: int = 1000, steps: int = 20) -> dict:
    return {"output_throughput": tps, "total_output_tokens": tokens, "engine_steps": steps, "valid": 3,
            "completed": 3, "logitgate_counts": {}, "errors": []}


def test_the_floor_runs_before_and_after_the_structured_cases():
    cases = forced_served.cases_for(["greedy"])
    names = [name for name, _, _ in cases]
    assert names[:2] == ["unconstrained_greedy_first", "unconstrained_t1_first"]
    assert names[-2:] == ["unconstrained_greedy", "unconstrained_t1"]
    structured = [name for name, schema, _ in cases if schema is not None]
    assert structured and names[2:-2] == structured


def test_each_servers_floor_after_over_first_and_the_ratios_use_the_floor_after():
    cases = forced_served.cases_for(["greedy"])
    structured = [name for name, schema, _ in cases if schema is not None]

    def run(first: float, after: float, structured_tps: float) -> dict:
        out = {name: _case(structured_tps) for name in structured}
        out.update({"unconstrained_greedy_first": _case(first), "unconstrained_t1_first": _case(first),
                    "unconstrained_greedy": _case(after), "unconstrained_t1": _case(after)})
        return out

    runs = {"forced": [run(100.0, 80.0, 120.0), run(100.0, 50.0, 120.0)], "off": [run(100.0, 100.0, 90.0)] * 2}
    rows = {row["case"]: row for row in forced_served.summarize("m", "xgrammar", runs, cases)}
    assert rows["unconstrained_greedy"]["after_over_first"] == {"forced": [0.8, 0.5], "off": [1.0, 1.0]}
    assert "after_over_first" not in rows["unconstrained_greedy_first"]
    assert rows["unconstrained_greedy"]["ratios"]["forced/off"] == 0.65  # the medians of the floor after
    assert rows[structured[0]]["of_floor"] == {"forced": round(120 / 65, 2), "off": 0.9}
