"""Fuzz tests of the kvcert CLI's input checks and of `kvcert report` over malformed trace files
(issue 8, the standing adversarial suite).

Bad input must give exit status 2, exactly one line on stderr starting with "kvcert: error:",
no traceback, nothing on stdout and nothing written. The model is stubbed out: these tests are
about input checking (tests/test_cli.py and tests/test_cli_evict.py keep the real-model runs).
Each generated case carries its own oracle (is it bad, and why), written from the documented
rules, not from the implementation's answer. Bounded: well under a minute in all.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import fast.tools.cli as cli
from fast.tools import trace as T

FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


class Reached(Exception):
    """The stubbed pipeline was reached: the checks let the arguments through."""


class Tok:
    eos_token_id = 2

    def apply_chat_template(self, msgs, **kw):
        return list(range(len(msgs[0]["content"]) // 4 + 5))


@pytest.fixture
def stubbed(monkeypatch):
    """load() gives a stand-in with SmolLM2's config; generation (run_one, the demo's prefill,
    calibrate-page's model) raises Reached."""
    import fast.integrations.model as M

    def reached(*a, **k):
        raise Reached
    monkeypatch.setattr(cli, "load", lambda *a, **k: (SimpleNamespace(config=cli.SMOLLM2), Tok()))
    monkeypatch.setattr(cli, "run_one", reached)
    monkeypatch.setattr(cli, "prefill_exact", reached)
    monkeypatch.setattr(M, "load_smollm2", reached)


def tree(root):
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in Path(root).rglob("*"))


def call(argv, capsys):
    """(rc or 'reached', stdout, stderr) of main(argv)."""
    try:
        rc = cli.main(argv)
    except Reached:
        rc = "reached"
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line(rc, out, err, argv):
    assert rc == 2, (argv, rc, err)
    lines = err.strip("\n").split("\n")
    assert len(lines) == 1 and lines[0].startswith("kvcert: error:"), (argv, err)
    assert "Traceback" not in err and out == "", (argv, err, out)


# ---- kvcert run: each flag good or bad, with the reason it is bad ----

NON_ASCII_DIGITS = st.sampled_from(["\u0663", "\u00b3", "\u0968", "\uff13", "\u2467"])
NOT_AN_INT = st.one_of(st.sampled_from(["", "nan", "inf", "1.5", "1e3", "0x10", "- 1", "1_0", "abc", "++1"]),
                       NON_ASCII_DIGITS)
NOT_A_REAL = st.one_of(st.sampled_from(["", "nan", "-nan", "inf", "-inf", "1e999", "abc", "0,5", "1_0"]),
                       NON_ASCII_DIGITS.map(lambda d: "0." + d))


def good(values):
    return values.map(lambda v: (str(v), None))


def bad(values, why):
    return values.map(lambda v: (str(v), why))


FLAGS = {  # flag: (good values, bad values with the reason)
    "--scheme": (good(st.sampled_from(["int8", "int4", "fp8_e5m2", "fp8_e4m3", "int8_dither", "kivi2", "int4_dither", "kivi2_dither"])),
                 bad(st.text(min_size=1, max_size=8).filter(lambda s: s not in cli_schemes()), "scheme")),
    "--gate": (st.one_of(good(st.just("none")), good(st.floats(0, 1).map(lambda t: f"certified:{t!r}")),
                         good(st.integers(0, 90).map(lambda k: f"risk:{k}"))),
               st.one_of(bad(st.integers(91, 10 ** 12).map(lambda k: f"risk:{k}"), "risk K > 90 slots"),
                         bad(st.floats(1.0001, 1e9).map(lambda t: f"certified:{t!r}"), "tau > 1"),
                         bad(st.floats(max_value=-1e-9, allow_infinity=False).map(lambda t: f"certified:{t!r}"), "tau < 0"),
                         bad(NOT_AN_INT.map(lambda s: f"risk:{s}"), "K not an integer"),
                         bad(NOT_A_REAL.map(lambda s: f"certified:{s}"), "tau not a number"),
                         bad(st.text(st.characters(blacklist_characters=":"), min_size=1, max_size=8).filter(
                             lambda s: s.strip() not in ("", "none")), "unknown gate"))),
    "--sinks": (good(st.integers(0, 10 ** 9)), st.one_of(bad(st.integers(max_value=-1), "negative"),
                                                         bad(NOT_AN_INT, "not an integer"))),
    "--window": (good(st.integers(0, 10 ** 9)), st.one_of(bad(st.integers(max_value=-1), "negative"),
                                                          bad(NOT_AN_INT, "not an integer"))),
    "--seed": (good(st.integers(0, 2 ** 64 - 1)),
               st.one_of(bad(st.integers(max_value=-1), "negative"), bad(st.integers(2 ** 64, 2 ** 200), "seed >= 2^64"),
                         bad(NOT_AN_INT, "not an integer"))),
    "--delta-req": (good(st.floats(1e-6, 0.5).map(repr)),
                    st.one_of(bad(st.floats(max_value=0).map(repr), "<= 0"),
                              bad(st.floats(min_value=1, allow_infinity=False).map(repr), ">= 1"),
                              bad(NOT_A_REAL, "not a finite number"),
                              st.sampled_from(["1e-320", "5e-324", "1e-305"]).map(lambda v: (v, "dither underflow")))),
    "--max-new-tokens": (good(st.integers(1, 4000)),
                         st.one_of(bad(st.integers(max_value=0), "< 1"), bad(st.integers(8192, 10 ** 30), "beyond the context"),
                                   bad(NOT_AN_INT, "not an integer"))),
    "--offload": (good(st.sampled_from(["full", "residual"])),
                  bad(st.text(max_size=6).filter(lambda s: s not in ("full", "residual")), "choice")),
    "--witness": (good(st.sampled_from(["stored", "derived"])),
                  bad(st.text(max_size=6).filter(lambda s: s not in ("stored", "derived")), "choice")),
    "--evict": (good(st.sampled_from(["snapkv:8", "h2o:0.25", "tova:64", "streaming:0.5", "knorm:16"])),
                bad(st.sampled_from(["foo:3", "snapkv:abc", "snapkv", "h2o:1.5", "tova:0", "snapkv:-4",
                                     "snapkv:\u0663", "h2o:nan"]), "evictor spec")),
    "--page": (good(st.floats(-10, 10).map(repr)), bad(NOT_A_REAL, "tau not a finite number")),
    "--evict-group-size": (good(st.integers(1, 8192)),
                           st.one_of(bad(st.integers(max_value=0), "< 1"), bad(st.integers(8193, 10 ** 40), "> context"),
                                     bad(NOT_AN_INT, "not an integer"))),
}


def cli_schemes():
    from fast.core.schemes import scheme_names
    return scheme_names()


def files(tmp):
    """--prompt-file and --out choices, good and bad, made under tmp."""
    (tmp / "prompt.txt").write_text("What is the capital of Italy?")
    (tmp / "empty.txt").write_text(" \n")
    (tmp / "latin1.txt").write_bytes("caf\u00e9 au lait".encode("latin-1"))
    (tmp / "afile").write_text("keep")
    (tmp / "notes").mkdir()
    (tmp / "notes" / "todo.txt").write_text("keep")
    prompts = {"prompt.txt": None, "empty.txt": "empty prompt", "latin1.txt": "not UTF-8",
               "missing.txt": "missing", "notes": "a directory"}
    outs = {"new/run": None, "run2": None, "afile": "a file", "afile/sub": "under a file",
            "notes": "holds other files", "/proc/kvcert-fuzz": "unwritable"}
    return prompts, outs


@FUZZ
@given(data=st.data())
def test_fuzz_run_arguments(stubbed, tmp_path, capsys, data):
    """property: a `kvcert run` command line with any mix of good and bad values passes the checks
    (and reaches generation, with nothing written) iff every value is good; otherwise exit 2 and
    one line, before generation, nothing written."""
    with tempfile.TemporaryDirectory(dir=tmp_path) as d:
        tmp = Path(d)
        prompts, outs = files(tmp)
        mode = data.draw(st.sampled_from(["all good", "some bad"]), "mode")
        chosen = data.draw(st.lists(st.sampled_from(sorted(FLAGS)), unique=True, max_size=6), "flags")
        if mode == "all good":
            p, o = "prompt.txt", data.draw(st.sampled_from(["new/run", "run2"]), "out")
            args = {f: data.draw(FLAGS[f][0], f) for f in chosen}
        else:
            p = data.draw(st.sampled_from(sorted(prompts)), "prompt")
            o = data.draw(st.sampled_from(sorted(outs)), "out")
            args = {f: data.draw(st.one_of(*FLAGS[f]), f) for f in chosen}
        why = [f"{f}: {w}" for f, (_, w) in args.items() if w is not None]
        why += [w for w in (prompts[p], outs[o]) if w]
        scheme = args.get("--scheme", ("int8", None))[0]
        dither = scheme in ("int8_dither", "int4_dither", "kivi2_dither")
        if "--delta-req" in args and args["--delta-req"][1] == "dither underflow" and not dither:
            why.remove("--delta-req: dither underflow")          # a tiny budget is fine without the dither tier
        if "--evict" in args and args["--evict"][1] is None and scheme in ("kivi2", "int8_dither", "int4_dither", "kivi2_dither"):
            why.append("--evict with a block or dither scheme")
        if "--page" in args and ("--evict" not in args):
            why.append("--page without --evict")
        argv = ["run", "--prompt-file", str(tmp / p), "--out", o if o.startswith("/") else str(tmp / o)]
        for f, (v, _) in args.items():
            argv += [f"{f}={v}"] if v.startswith("-") else [f, v]
        before = tree(tmp)
        rc, out, err = call(argv, capsys)
        assert tree(tmp) == before, argv
        event("bad" if why else "good")
        if why:
            assert_one_line(rc, out, err, argv)
        else:
            assert rc == "reached", (argv, rc, err)


HOSTILE = st.one_of(st.sampled_from(["run", "report", "demo", "calibrate-page", "--scheme", "--gate", "--sinks",
                                     "--window", "--seed", "--delta-req", "--max-new-tokens", "--out", "--prompt-file",
                                     "--evict", "--page", "--evict-group-size", "--budget", "--n", "--tokens",
                                     "--evict-rate", "--prompts", "--filler", "--tau", "--offload", "--witness",
                                     "--shadow", "risk:", "certified:", "-1", "nan", "1e-320", "", "--", "-"]),
                    st.text(max_size=12))


@FUZZ
@given(argv=st.lists(HOSTILE, max_size=8))
def test_fuzz_any_command_line(stubbed, tmp_path, capsys, monkeypatch, argv):
    """property: any command line at all is either accepted (generation is reached, or report
    finds a real trace, or help is printed) or exit 2 with one line; never a traceback, and
    nothing is written in the working directory."""
    monkeypatch.chdir(tmp_path)
    before = tree(tmp_path)
    try:
        rc, out, err = call(argv, capsys)
    except SystemExit as e:  # --help / -h (argparse accepts abbreviations such as --he)
        assert e.code == 0 and any(a.startswith("-h") or a.startswith("--h") for a in argv), argv
        return
    assert tree(tmp_path) == before, argv
    event(f"outcome {rc}")
    if rc != "reached":
        assert_one_line(rc, out, err, argv)


# ---- kvcert report over malformed traces ----

def good_trace():
    rng = np.random.default_rng(0)
    b = rng.uniform(0, 1, (3, 4, 1, 3)).astype(np.float32)
    arrays = {k: b.copy() for k in ("min", "tanh", "one_minus_b_over_a", "e_form", "pre_min")}
    arrays["max_c"] = rng.uniform(0, 2, b.shape).astype(np.float32)
    arrays["true_tv"] = 0.5 * b
    arrays["repaired"] = np.zeros((3, 4, 1), bool)
    meta = {"scheme": "int8", "gate": "none", "answer": "Rome", "fresh_repairs": 0,
            "memory": {"device_bytes_per_token": 100.0, "fp16_bytes_per_token": 200.0}}
    return T.Trace(arrays, meta)


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("trace") / "good"
    T.save(good_trace(), d)
    for p in d.glob("*.png"):
        p.unlink()
    return d


def report(src, edit, capsys):
    """Copy the good trace, apply edit(dir), run report: (rc, out, err, written?)."""
    with tempfile.TemporaryDirectory() as d:
        run = Path(d) / "t"
        shutil.copytree(src, run)
        edit(run)
        before = tree(run)
        rc, out, err = call(["report", str(run)], capsys)
        return rc, out, err, tree(run) != before


def expect_refused(src, edit, capsys, what):
    rc, out, err, wrote = report(src, edit, capsys)
    assert_one_line(rc, out, err, what)
    assert not wrote, what


REPORT = settings(FUZZ, max_examples=25)


@REPORT
@given(cut=st.floats(0, 1, exclude_max=True))
def test_fuzz_report_truncated_npz(trace_dir, capsys, cut):
    data = (trace_dir / "trace.npz").read_bytes()
    expect_refused(trace_dir, lambda d: (d / "trace.npz").write_bytes(data[:int(cut * len(data))]), capsys, cut)


@REPORT
@given(junk=st.binary(max_size=300), which=st.sampled_from(["trace.npz", "trace.json"]))
def test_fuzz_report_random_bytes(trace_dir, capsys, junk, which):
    # a first byte that starts neither a zip (P), an npy (\x93) nor valid UTF-8 JSON (\xff): always malformed
    expect_refused(trace_dir, lambda d: (d / which).write_bytes(b"\xff" + junk), capsys, (which, junk))


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3), max_leaves=8)


@REPORT
@given(doc=JSON.filter(lambda x: not isinstance(x, dict)))
def test_fuzz_report_json_not_an_object(trace_dir, capsys, doc):
    expect_refused(trace_dir, lambda d: (d / "trace.json").write_text(json.dumps(doc)), capsys, doc)


@REPORT
@given(field=st.sampled_from(["scheme", "gate", "answer", "fresh_repairs", "memory", "eviction"]), value=JSON)
def test_fuzz_report_json_field_of_wrong_type(trace_dir, capsys, monkeypatch, field, value):
    """property: a metadata field of the wrong type is refused; one of the right type is reported
    (plots stubbed: they read no metadata but the title, and the array test draws them)."""
    monkeypatch.setattr(T, "plots", lambda tr, out: [])
    right = {"scheme": lambda v: v is None or isinstance(v, str), "gate": lambda v: v is None or isinstance(v, str),
             "answer": lambda v: v is None or isinstance(v, str),
             "fresh_repairs": lambda v: type(v) is int and v >= 0,
             "memory": lambda v: v is None or isinstance(v, dict) and all(
                 type(x) in (int, float) and x >= 0 and x != float("inf") for x in v.values()) and (
                 "device_bytes_per_token" not in v or v.get("fp16_bytes_per_token", 0) > 0),
             # keys of at most 5 characters: of the eviction fields only spec and note (strings) can appear
             "eviction": lambda v: v is None or isinstance(v, dict) and all(
                 v[k] is None or isinstance(v[k], str) for k in ("spec", "note") if k in v)}[field]

    def edit(d):
        doc = json.loads((d / "trace.json").read_text())
        doc[field] = value
        (d / "trace.json").write_text(json.dumps(doc))
    rc, out, err, wrote = report(trace_dir, edit, capsys)
    if right(value):
        assert rc == 0 and "certificate:" in out, (field, value, err)
    else:
        assert_one_line(rc, out, err, (field, value))
        assert not wrote


DTYPES = st.sampled_from([np.float16, np.float32, np.float64, np.int8, np.int64, np.uint8, np.bool_, np.complex64])


@REPORT
@given(key=st.sampled_from(["min", "true_tv", "max_c", "pre_min", "repaired"]), dtype=DTYPES,
       shape=st.lists(st.integers(0, 5), max_size=5), fill=st.sampled_from([0.25, -1.0, float("nan"), 2.0]))
def test_fuzz_report_array_of_wrong_dtype_or_shape(trace_dir, capsys, key, dtype, shape, fill):
    """property: an array of the wrong dtype or shape, or a bound / distance that is NaN or
    negative, is refused; a well-formed replacement is reported."""
    ref = (3, 4, 1, 3)
    x = np.full(shape, fill).astype(dtype) if np.dtype(dtype).kind in "fc" else np.zeros(shape, dtype)
    if key == "repaired":
        ok = x.dtype == np.bool_ and x.ndim == 3 and x.shape[:2] == ref[:2]
    else:
        ok = x.dtype.kind == "f" and tuple(shape) == ref
        if key in ("min", "true_tv", "pre_min") and x.size:
            ok = ok and fill >= 0
    # a fill of 2.0 in float16 stays 2.0; a bound > 1 is not malformed (only meaningless)

    def edit(d):
        with np.load(d / "trace.npz") as z:
            a = dict(z)
        a[key] = x
        np.savez(d / "trace.npz", **a)
    rc, out, err, wrote = report(trace_dir, edit, capsys)
    if ok:
        assert rc == 0 and "certificate:" in out, (key, dtype, shape, fill, err)
    else:
        assert_one_line(rc, out, err, (key, dtype, shape, fill))
        assert not wrote


def test_report_unreadable_and_missing(trace_dir, capsys, monkeypatch):
    """property: a missing trace.npz or trace.json, or a directory in their place, is one line."""
    expect_refused(trace_dir, lambda d: (d / "trace.npz").unlink(), capsys, "no npz")
    expect_refused(trace_dir, lambda d: (d / "trace.json").unlink(), capsys, "no json")

    def dir_instead(d):
        (d / "trace.json").unlink()
        (d / "trace.json").mkdir()
    expect_refused(trace_dir, dir_instead, capsys, "json is a directory")
    expect_refused(trace_dir, lambda d: (d / "trace.json").write_text("[" * 100_000), capsys, "deep JSON")
    rc, out, err = call(["report", os.devnull], capsys)
    assert_one_line(rc, out, err, "devnull")
