"""The forced-drafts served benchmark's case order and summary (no server: synthetic runs)."""
import pytest

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


def test_every_server_gets_the_users_drafter_and_the_sides_environment(monkeypatch, tmp_path):
    import logitgate.bench.vllm as bench_vllm

    started = []

    def fake_server_run(python, path, with_logitgate, port, log, backend, env, cases, prompts, extra_args):
        started.append((with_logitgate, env.get("LOGITGATE_VLLM_FORCED_DRAFTS"), extra_args))
        out = {name: {**_case(100.0), "texts": ["{}"]} for name, _, _ in cases}
        return {"start_s": 1.0, **out}

    monkeypatch.setattr(bench_vllm, "served_model", lambda model: tmp_path)
    monkeypatch.setattr(bench_vllm, "served_server_run", fake_server_run)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'
    result = forced_served.run(["json_writer"], ["xgrammar"], ["forced", "off", "vllm"], ["greedy"], 8, 1, 4,
                               speculative_config=spec)
    assert started == [(True, "8", ["--speculative-config", spec]), (True, "0", ["--speculative-config", spec]),
                       (False, None, ["--speculative-config", spec])]
    assert result["speculative_config"] == spec
    assert all(result["greedy_identical"]["json_writer/xgrammar"].values())


def test_a_drafter_config_that_is_not_json_is_refused(capsys):
    with pytest.raises(SystemExit):
        forced_served.main(["--speculative-config", "{method: ngram"])
    assert "--speculative-config is not JSON" in capsys.readouterr().err
