"""The Coq development builds, admits nothing, and every spec theorem rests only on axioms of
Coq's standard library: its reals' and excluded middle (checked with Print Assumptions)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

import spec

ROOT = Path(__file__).resolve().parent.parent
PROOFS = ROOT / "proofs"
THEOREMS, _ = spec.load()

# Exactly the axioms the spec theorems rest on today, all from Coq's standard library, none of
# ours (README "Axioms of the proofs"): the stdlib reals' construction (ClassicalDedekindReals,
# functional extensionality: every theorem) and excluded middle, which the stdlib's own proofs
# about exp, ln and the mean value theorem use (exp_increasing, ln_increasing, MVT: Rtopology).
# propositional_extensionality was accepted too, but no theorem uses it (issue 19): not any more.
STANDARD_AXIOMS = {
    "ClassicalDedekindReals.sig_forall_dec",
    "ClassicalDedekindReals.sig_not_dec",
    "FunctionalExtensionality.functional_extensionality_dep",
    "Classical_Prop.classic",
}
FORBIDDEN = re.compile(r"\b(Admitted|admit|Axiom|Axioms|Parameter|Parameters|Conjecture)\b")


@pytest.fixture(scope="module")
def built():
    assert shutil.which("coqc"), "coqc is missing: `make test` installs Coq (Debian: coq libcoq-coquelicot libcoq-interval libcoq-flocq)"
    run = subprocess.run(["make", "-C", str(ROOT), "proofs"], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return True


def strip_comments(text):
    while "(*" in text:
        start = text.index("(*")
        depth, i = 0, start
        while i < len(text):
            if text.startswith("(*", i):
                depth, i = depth + 1, i + 2
            elif text.startswith("*)", i):
                depth, i = depth - 1, i + 2
                if depth == 0:
                    break
            else:
                i += 1
        text = text[:start] + text[i:]
    return text


@pytest.mark.parametrize("path", sorted(PROOFS.glob("*.v")), ids=lambda p: p.name)
def test_no_admits_or_axioms(path):
    hits = FORBIDDEN.findall(strip_comments(path.read_text()))
    assert not hits, f"{path.name} uses {sorted(set(hits))}"


def print_assumptions(header, names, tmp_path):
    """{qualified name: set of axioms} from Coq's Print Assumptions, one Redirect file each."""
    script = [header] + [f'Redirect "{tmp_path}/a{i}" Print Assumptions {n}.' for i, n in enumerate(names)]
    (tmp_path / "check.v").write_text("\n".join(script) + "\n")
    run = subprocess.run(["coqc", "-R", str(PROOFS), "KVCert", str(tmp_path / "check.v")],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    report = {}
    for i, name in enumerate(names):
        out = (tmp_path / f"a{i}.out").read_text()
        # One axiom per unindented line ("name : type", or "name" with the type below).
        report[name] = {line.split()[0] for line in out.splitlines()
                        if line and not line[0].isspace() and line != "Axioms:" and not line.startswith("Closed under")}
    return report


def test_print_assumptions(built, tmp_path):
    names = [spec.coq_qualified(r, n) for r in THEOREMS for n in r["coq"]]
    report = print_assumptions("From KVCert Require All.", names, tmp_path)
    print("\nPrint Assumptions summary:")
    for name, axioms in report.items():
        print(f"  {name}: {', '.join(sorted(axioms)) or 'closed'}")
    bad = {n: sorted(a - STANDARD_AXIOMS) for n, a in report.items() if a - STANDARD_AXIOMS}
    assert not bad, f"theorems resting on non-standard assumptions: {bad}"


def test_print_assumptions_catches_an_axiom(built, tmp_path):
    """The check above can fail: a theorem proved from a fresh Axiom is reported."""
    header = "From Coq Require Import Reals.\nAxiom kvcert_cheat : forall x : R, (x < x)%R.\n" \
             "Theorem cheat : (0 < 0)%R. Proof. apply kvcert_cheat. Qed."
    report = print_assumptions(header, ["cheat"], tmp_path)
    assert "kvcert_cheat" in report["cheat"] - STANDARD_AXIOMS
