"""benchmarks/evict_gate.py: the harness run end to end on SmolLM2 (2 inputs), and its summary
(PAGE, blind gate, McNemar) on records built by hand."""

import json

import pytest

from benchmarks.evict_gate import main, summarize, table


def test_harness_on_smollm2(tmp_path):
    """the real pipeline: every read served is checked against the exact-key truth; the rows are
    the inputs of results/evict_eval.json (matched, same full-cache outcomes)."""
    out = tmp_path / "g.json"
    assert main(["--n", "2", "--cells", "streaming@48", "--taus", "0.3", "--batch", "2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert row["violations"] == 0 and row["reads"] > 2 * 30 * 9
    assert row["max_served"] <= 0.3 and row["true_max"] <= row["max_served"]
    assert row["labels_match"] and 0 < row["bytes_over_full_mean"] < 1 and 0 < row["restored_share"] < 1
    for rec in data["records"]:
        run = rec["runs"]["streaming@48/0.3"]
        assert run["restored_tokens"] <= run["evicted_tokens"] and run["max_served"] <= 0.3
    assert data["readme_tables"][0]["rows"][0][0] == "streaming@48"
    table_before = data["readme_tables"]
    assert main(["--resummarize", str(out)]) == 0                    # the same rows again from the records
    assert json.loads(out.read_text())["readme_tables"] == table_before
    assert out.with_suffix(".png").stat().st_size > 1000


def rec(i, full, ok, drop):
    return {"task": "passkey", "haystack": "synthetic", "seed": i, "depth": 0.5, "full": full,
            "runs": {"x@96/0.2": {"ok": ok, "bytes_over_full": 0.5, "restored_tokens": 1, "evicted_tokens": 4,
                                  "reads": 10, "violations": 0, "max_served": 0.1, "true_max": 0.05}},
            "page_drop": {"96": drop}}


def test_summary_compares_page_blind_and_the_full_cache():
    """hand-built: 4 inputs, the full cache answers 3; the evictor alone 1; PAGE evicts inputs 0-1
    (drop >= tau) of which only 0 survives; the gate answers all the full cache does."""
    records = [rec(0, 1, 1, 0.5), rec(1, 1, 1, 0.5), rec(2, 1, 1, 0.0), rec(3, 0, 0, 0.0)]
    labels = {}
    for i, (full, alone, drop) in enumerate([(1, 1, 0.5), (1, 0, 0.5), (1, 0, 0.0), (0, 0, 0.0)]):
        labels[("passkey", "synthetic", i, 0.5)] = {"full": full, "page_drop": {"96": drop}, "tokens": 384,
                                                    "runs": {"x@96": {"ok": alone}}}
    (row,) = summarize(records, ["x@96"], [0.2], (labels, {"96": 0.3}))
    assert row["accuracy"] == 0.75 and row["p_vs_full"] == 1 and row["lost"] == 0
    assert row["alone_accuracy"] == 0.25
    assert row["page"]["evicts"] == 2 and row["page"]["accuracy"] == 0.5          # input 1 lost
    assert row["page"]["bytes_over_full_mean"] == (0.25 + 0.25 + 1 + 1) / 4
    assert row["blind_expected_accuracy"] == pytest.approx((0.5 * 1 + 0.5 * 1) / 4 + 0.5 / 4 + 0.5 / 4)
    assert row["restored_share"] == 0.25 and row["labels_match"]
    assert table([row], 0.75, 4)["rows"][0][2].startswith("0.75")
    assert table([row], 0.75, 4)["rows"][0][5] != "-" and table([row], 0.75, 4, retain=True)["rows"][0][5] == "-"
