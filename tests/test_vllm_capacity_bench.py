"""benchmarks.vllm_capacity's bookkeeping, without engines: every ratio is against vLLM without kvcert,
capacity-only engines get no throughput ratio, and the table says which rows did not run the workload."""

from benchmarks.vllm_capacity import add_ratios, table


def _rows():
    ran = dict(seconds=10.0, requests_per_s=2.0)
    return [{"engine": "kvcert int8", "kvcert": {"codec": "int8"}, "capacity_tokens": 8000, "max_concurrency": 15.0,
             "generated_tokens_per_s": 30.0, "certified_reads": 12, **ran},
            {"engine": "vLLM fp32", "kvcert": None, "capacity_tokens": 2000, "max_concurrency": 4.0,
             "generated_tokens_per_s": 20.0, **ran},
            {"engine": "kvcert fp8", "kvcert": {"codec": "fp8_e4m3"}, "capacity_tokens": 1800, "max_concurrency": 3.5}]


def test_ratios_are_against_the_engine_without_kvcert():
    rows = _rows()
    add_ratios(rows)
    assert [r["capacity_vs_fp32"] for r in rows] == [4.0, 1.0, 0.9]
    assert rows[0]["throughput_vs_fp32"] == 1.5 and rows[1]["throughput_vs_fp32"] == 1.0
    assert "throughput_vs_fp32" not in rows[2]


def test_table_marks_capacity_only_rows():
    rows = _rows()
    add_ratios(rows)
    res = {"engines": rows, "budget_mib": 96, "requests": 24, "prompt_tokens_median": 270, "max_tokens": 256,
           "bf16_equivalent": {"capacity_tokens": 4000, "max_concurrency": 8.0, "capacity_vs_fp32": 2.0}}
    t = table(res)
    assert t["rows"][0][3] == "4.00x" and t["rows"][0][6] == "1.50x" and t["rows"][0][7] == "12"
    assert t["rows"][2][4] == "(capacity only)" and t["rows"][2][3] == "0.90x"
    assert t["rows"][3][0].startswith("bf16") and all(len(r) == len(t["header"]) for r in t["rows"])
    assert "cost" not in t["title"]
    res["cert_cost"] = {"median": 0.081, "min": -0.02, "max": 0.125, "rounds": 3}
    assert t["title"] + "; int8's certificates cost 8.1% of tokens/s under this load (median of 3 rounds in turn, range " \
        "-2.0% to 12.5%)" == table(res)["title"]


def test_pair_runs_in_turn_with_median_and_range(monkeypatch):
    """The int8 pair side by side: rounds in turn (order swapped each round), each row its median round by
    tokens/s, cert_cost the median and range of the per-round costs (with no engine: _start/_workload stubbed)."""
    from types import SimpleNamespace

    import benchmarks.vllm_capacity as vc
    plain, cert = vc.PAIR
    rates, calls = {plain: iter([10.0, 12.0, 11.0]), cert: iter([9.0, 9.0, 10.0])}, []
    monkeypatch.setattr(vc, "_start", lambda model, n, args, per_req, warm: (
        n, {"engine": n, "kvcert": vc.ENGINES[n][0], "capacity_tokens": 100, "max_concurrency": 1.0}))

    def workload(llm, kw, prompts, params):
        calls.append(llm)
        rate = next(rates[llm])
        return {"generated_tokens_per_s": rate, "seconds": 1.0 / rate}

    monkeypatch.setattr(vc, "_workload", workload)
    rows, _, cost = vc.run("model", [{"prompt_token_ids": [1, 2]}], SimpleNamespace(engines="|".join(vc.PAIR), rounds=3, max_tokens=4))
    assert calls == [plain, cert, cert, plain, plain, cert]
    assert [r["generated_tokens_per_s"] for r in rows] == [11.0, 9.0]
    assert rows[1]["rounds_tokens_per_s"] == [9.0, 9.0, 10.0]
    assert cost["rounds"] == 3 and abs(cost["median"] - 0.1) < 1e-12
    assert abs(cost["min"] - (1 - 10 / 11)) < 1e-12 and abs(cost["max"] - 0.25) < 1e-12
