"""Shared helpers of the conformance tests: comparison with slack, reproducers, corpus replay.

Every property has one check function `check_<name>(case)` taking a JSON-able dict. On
failure it raises an AssertionError whose message is a complete reproducer: the case
itself and a command that replays it:

    .venv/bin/python -m conformance._check conformance/test_softmax.py:check_forms '<case json>'

Check functions run at DPS = 60 digits, like the reference (decorate them with @workdps(DPS)).

Every case Hypothesis ever shrank to a failure is kept in conformance/corpus/<test>.json
(a JSON list of cases) and replayed first by `@replay("<test>")`.
"""
import importlib
import json
import sys
from pathlib import Path

from hypothesis import example
from mpmath import mpf

DPS = 60
CORPUS = Path(__file__).with_name("corpus")

# The reference carries 60 digits. Exact equalities and equality cases of the bounds
# (tightness) can come out wrong in the last digits, so comparisons allow a relative
# slack of 1e-40 plus an absolute 1e-55 (cancellation in p - p~ with O(1) entries).
REL = mpf(10) ** -40
ABS = mpf(10) ** -55


def le(a, b):
    """a <= b up to the reference's rounding."""
    a, b = mpf(a), mpf(b)
    return a <= b + REL * max(abs(a), abs(b)) + ABS


def close(a, b):
    """a == b up to the reference's rounding."""
    return le(a, b) and le(b, a)


def expect(ok, check, case, message):
    """Raise an AssertionError carrying a reproducer of `case` unless ok."""
    if ok:
        return
    blob = json.dumps(case, sort_keys=True)
    where = f"conformance/{Path(check.__code__.co_filename).name}:{check.__name__}"
    raise AssertionError(
        f"{check.__name__}: {message}\n"
        f"  case: {blob}\n"
        f"  replay: .venv/bin/python -m conformance._check {where} '{blob}'\n"
        f"  keep it: append the case to conformance/corpus/<test name>.json")


def replay(test_name):
    """Decorator: @example(case=...) for every case kept in conformance/corpus/<test_name>.json."""
    path = CORPUS / f"{test_name}.json"
    cases = json.loads(path.read_text()) if path.exists() else []

    def decorate(test):
        for case in cases:
            test = example(case=case)(test)
        return test
    return decorate


def main(argv):
    """Replay one case: python -m conformance._check conformance/test_x.py:check '<case json>'."""
    file, _, name = argv[1].partition(":")
    check = getattr(importlib.import_module(f"conformance.{Path(file).stem}"), name)
    check(json.loads(argv[2]))
    print("passed")


if __name__ == "__main__":
    main(sys.argv)
