"""kvcert run --evict / --page and kvcert calibrate-page: the eviction certificate wired into the CLI,
composed with the quantization certificate (T7d), on a random tiny GQA Llama and one short SmolLM2 run."""

import argparse
import json

import numpy as np
import pytest
import torch
from tests.tiny_model import tiny_evict_llama

from fast.tools import trace as T
from fast.tools.cli import main, passkey_prompt, run_one
from fast.core.evict import compose_tv
from fast.integrations.hf_meter import enable


def one_line_error(capsys, argv, prefix="kvcert: error:"):
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.startswith(prefix) and "\n" not in err and "Traceback" not in err
    return err


def test_bad_eviction_input_is_one_line(tmp_path, capsys):
    """property: bad --evict / --page / --evict-group-size, or a scheme that cannot drop single
    tokens, is one line and exit 2, before any model is loaded."""
    f = tmp_path / "p.txt"
    f.write_text("hi")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    base = ["run", "--prompt-file", str(f)]
    assert "unknown evictor 'foo'" in one_line_error(capsys, base + ["--evict", "foo:3"])
    assert "'abc'" in one_line_error(capsys, base + ["--evict", "snapkv:abc"])
    assert "lacks a budget" in one_line_error(capsys, base + ["--evict", "snapkv"])
    assert "ratio" in one_line_error(capsys, base + ["--evict", "h2o:1.5"])
    assert "positive" in one_line_error(capsys, base + ["--evict", "tova:0"])
    assert "give --evict" in one_line_error(capsys, base + ["--page", "0.1"])
    assert "neither a finite number" in one_line_error(capsys, base + ["--evict", "snapkv:8", "--page", "zz"])
    assert "calibration file" in one_line_error(capsys, base + ["--evict", "snapkv:8", "--page", str(bad)])
    assert "[1, 8192]" in one_line_error(capsys, base + ["--evict", "snapkv:8", "--evict-group-size", "0"])
    assert "per-token scheme" in one_line_error(capsys, base + ["--evict", "snapkv:8", "--scheme", "kivi2"])
    assert "per-token scheme" in one_line_error(capsys, base + ["--evict", "snapkv:8", "--scheme", "int8_dither"])
    err = one_line_error(capsys, ["calibrate-page", "--budget", "1.5"])
    assert "ratio" in err


class Tok:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def tiny():
    return enable(tiny_evict_llama(hidden=128))


def args(**kw):
    a = dict(scheme="int8", gate="none", sinks=4, window=16, seed=0, delta_req=1e-3, offload="full", witness="stored",
             shadow=True, max_new_tokens=5, evict="snapkv:0.4", page="-1e9", evict_group_size=16)
    a.update(kw)
    return argparse.Namespace(**a)


def test_tiny_run_composes_eviction_and_quantization(tmp_path):
    """property (T7d): per step, layer and head the trace's composed bound is compose_tv(eviction
    bound, quantization bound) >= both, and >= the true evicted mass (shadow); PAGE drop and decision,
    bytes before/after and witness bytes reach the trace; save/load/report keep them."""
    model = tiny()
    ids = torch.randint(0, 128, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    answer, tr = run_one(model, Tok(), ids, args(), progress=False)
    a, e = tr.arrays, tr.meta["eviction"]
    assert e["evicted"] and e["page_decision"] == "evict" and len(e["page_drop"]) == 1
    assert e["bytes_after"] < e["bytes_before"] and e["witness_bytes"] > 0
    assert a["evict_bound"].shape == a["min"].shape == a["composed"].shape == (4, 3, 1, 4)
    ref = compose_tv(torch.from_numpy(a["evict_bound"]), torch.from_numpy(a["min"])).numpy()
    assert np.array_equal(a["composed"], ref)
    assert (a["composed"] >= np.maximum(a["evict_bound"], a["min"])).all() and (a["composed"] <= 1).all()
    assert (a["evict_true"] <= a["evict_bound"]).all() and (a["evict_true"] > 0).any()
    assert e["composed_max_per_step"] == [float(x) for x in a["composed"].max(axis=(1, 2, 3))]
    s = T.summary(tr)["eviction"]
    assert s["evict_violations"] == 0 and 0 < s["witness_share_of_freed"]
    T.save(tr, tmp_path)
    assert (tmp_path / "eviction_heatmap.png").is_file()
    back = T.load(tmp_path)
    assert T.summary(back) == json.loads((tmp_path / "trace.json").read_text())["summary"]
    assert np.array_equal(back.arrays["composed"], a["composed"])
    text = T.format_summary(T.summary(back))
    assert "PAGE drop" in text and "composed" in text and "group witness" in text


def test_tiny_run_page_keeps_full_cache_same_tokens():
    """property: when PAGE keeps the full cache the evict path generates what the plain path does,
    with no eviction certificate (nothing was evicted) and bytes unchanged."""
    model = tiny()
    ids = torch.randint(0, 128, (200,), generator=torch.Generator().manual_seed(4)).tolist()
    kept, tr = run_one(model, Tok(), ids, args(page="1e9"), progress=False)
    plain, tr0 = run_one(model, Tok(), ids, args(evict=None, page=None), progress=False)
    e = tr.meta["eviction"]
    assert kept == plain and not e["evicted"] and e["page_decision"] == "keep full cache"
    assert e["bytes_after"] == e["bytes_before"] and "evict_bound" not in tr.arrays
    assert np.array_equal(tr.arrays["min"], tr0.arrays["min"])


@pytest.mark.model
def test_smollm2_run_evict_then_report(tmp_path, capsys):
    """kvcert run --evict snapkv:128 --page TAU --scheme int8 --shadow on a short passkey prompt:
    the summary shows the eviction and composed certificates, zero eviction violations; report re-renders."""
    text, _ = passkey_prompt(n_filler=10, seed=1)
    f = tmp_path / "p.txt"
    f.write_text(text)
    out = tmp_path / "run"
    rc = main(["run", "--evict", "snapkv:128", "--page", "-1", "--scheme", "int8", "--prompt-file", str(f),
               "--max-new-tokens", "4", "--shadow", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0 and printed.startswith("answer:")
    for line in ("eviction snapkv:128: evicted; PAGE drop", "device bytes", "group witness",
                 "composed with quantization", "composed bound per decode step", "eviction shadow: violations 0"):
        assert line in printed, line
    doc = json.loads((out / "trace.json").read_text())
    e = doc["eviction"]
    assert e["page_tau"] == -1 and e["bytes_after"] < e["bytes_before"] and len(e["composed_max_per_step"]) == 3
    assert doc["summary"]["eviction"]["evict_violations"] == 0
    with np.load(out / "trace.npz") as z:
        assert z["composed"].shape == (3, 30, 1, 9)
    (out / "eviction_heatmap.png").unlink()
    assert main(["report", str(out)]) == 0
    again = capsys.readouterr().out
    assert "composed bound per decode step" in again and (out / "eviction_heatmap.png").is_file()


def test_demo_eviction_part_on_smollm2():
    """`make demo`'s eviction lines (fast.tools.evict_cli.demo_eviction) on the demo's passkey prompt:
    the gated run finds the pass key, every read it served has a bound <= tau, and what it keeps
    resident is under half of the full cache; the lines say so."""
    from fast.tools.cli import load, prompt_ids
    from fast.tools.evict_cli import demo_eviction
    model, tok = load()
    text, key = passkey_prompt(n_filler=40, seed=0)
    ids = prompt_ids(tok, model, text, 24)
    lines, (alone, gated) = demo_eviction(model, tok, ids, key, 0.2, 24)
    assert str(key) in gated, gated
    assert lines[0] == f"eviction: streaming:128 of {len(ids)} prompt tokens" and len(lines) == 4
    served = float(lines[3].split("bound served <= ")[1].split()[0])
    resident = float(lines[3].split("KV bytes resident ")[1].split()[0])
    assert served <= 0.2 and resident < 0.5, lines[3]


def test_bad_eviction_gate_input_is_one_line(tmp_path, capsys):
    """property: --evict-gate without --evict, with --page, with a quantization option, out of [0, 1],
    and --evict-sketch / --evict-fetch without --evict-gate: one line, exit 2, before any model loads."""
    f = tmp_path / "p.txt"
    f.write_text("hi")
    base = ["run", "--prompt-file", str(f)]
    ev = base + ["--evict", "streaming:8", "--evict-gate", "0.2"]
    assert "give --evict too" in one_line_error(capsys, base + ["--evict-gate", "0.2"])
    assert "two gates" in one_line_error(capsys, ev + ["--page", "0.1"])
    assert "--scheme and --gate" in one_line_error(capsys, ev + ["--scheme", "int4"])
    assert "--scheme and --gate" in one_line_error(capsys, ev + ["--gate", "certified:0.2"])
    assert "do not apply" in one_line_error(capsys, ev + ["--shadow"])
    assert "[0, 1]" in one_line_error(capsys, base + ["--evict", "streaming:8", "--evict-gate", "1.5"])
    assert "give --evict-gate too" in one_line_error(capsys, base + ["--evict", "streaming:8", "--evict-fetch"])
    assert "give --evict-gate too" in one_line_error(capsys, base + ["--evict", "streaming:8", "--evict-sketch", "int8"])


def test_cli_sketch_choices_are_the_gates():
    """--evict-sketch lists (without importing torch at parse time) exactly the sketches EvictionGate takes."""
    from fast.policies.evict_gate import SKETCH_SCHEMES
    from fast.tools.evict_cli import SKETCH_CHOICES
    assert sorted(SKETCH_CHOICES) == sorted(SKETCH_SCHEMES)


def test_tiny_run_through_the_eviction_gate(tmp_path):
    """kvcert run's --evict-gate path (run_one): the trace holds every read's served bound (<= tau) and
    its bound before the gate (>= the served one, over tau somewhere: the gate restored), the gate's
    summary agrees with the arrays, and save / load / report keep it all."""
    model = tiny()
    ids = torch.randint(0, 128, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    a = args(evict="streaming:0.2", page=None, shadow=False, evict_gate=0.05, evict_sketch="int4c", evict_fetch=False)
    answer, tr = run_one(model, Tok(), ids, a, progress=False)
    served, pre, g = tr.arrays["evict_bound"], tr.arrays["evict_pre_gate"], tr.meta["eviction"]["gate"]
    assert served.shape == pre.shape == (4, 3, 1, 4) and "min" not in tr.arrays
    assert (served <= 0.05).all() and (pre >= served).all() and (pre > 0.05).any()
    assert g["reads"] == served.size and g["max_served_bound"] == float(served.max()) and g["restored_tokens"][0] > 0
    assert "bytes_before" not in tr.meta["eviction"]  # the gate's resident share is the byte count
    T.save(tr, tmp_path)
    back = T.load(tmp_path)
    assert np.array_equal(back.arrays["evict_pre_gate"], pre)
    text = T.format_summary(T.summary(back))
    assert text.startswith("certificate: kept keys exact") and "certified eviction gate, tau 0.05" in text
    assert "reads over tau" in text and (tmp_path / "eviction_heatmap.png").is_file()
    doc = json.loads((tmp_path / "trace.json").read_text())
    doc["eviction"]["gate"]["tau"] = 2
    (tmp_path / "trace.json").write_text(json.dumps(doc))
    with pytest.raises(T.TraceError, match="eviction.gate"):
        T.load(tmp_path)


@pytest.mark.model
def test_smollm2_run_through_the_eviction_gate(tmp_path, capsys):
    """kvcert run --evict streaming:128 --evict-gate 0.2 --evict-fetch on the demo's passkey prompt:
    the answer holds the pass key, the summary says what the gate served and kept, report re-renders."""
    text, key = passkey_prompt(n_filler=40, seed=0)
    f = tmp_path / "p.txt"
    f.write_text(text)
    out = tmp_path / "run"
    rc = main(["run", "--evict", "streaming:128", "--evict-gate", "0.2", "--evict-fetch", "--prompt-file", str(f),
               "--max-new-tokens", "12", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0 and str(key) in printed.splitlines()[0], printed
    for line in ("certificate: kept keys exact", "certified eviction gate, tau 0.2 (int4c key sketches, each read "
                 "fetches its tokens)", "KV bytes resident", "served bound per decode step"):
        assert line in printed, line
    doc = json.loads((out / "trace.json").read_text())
    g = doc["summary"]["eviction"]["gate"]
    assert g["max_served_bound"] <= 0.2 and g["resident_over_full_mean"][0] < 0.5 and g["reads"] > 0
    (out / "eviction_heatmap.png").unlink()
    assert main(["report", str(out)]) == 0
    assert "certified eviction gate" in capsys.readouterr().out and (out / "eviction_heatmap.png").is_file()
