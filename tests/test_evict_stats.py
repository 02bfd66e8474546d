"""The evaluation's statistics (benchmarks/stats.py) against known values, and the harness's
sizing rules (benchmarks/ruler.py, benchmarks/evict_eval.py) that need no model."""
import math

import pytest

from benchmarks.evict_eval import parse_spec
from benchmarks.stats import auroc, clopper_pearson, holm, hypergeom_le, mcnemar, wilson


def test_wilson_and_clopper_pearson_known_values():
    """property: textbook values (Wilson 8/10: [0.490, 0.943]; Clopper-Pearson 8/10: [0.444, 0.975])."""
    assert wilson(8, 10) == pytest.approx([0.4902, 0.9433], abs=1e-3)
    assert clopper_pearson(8, 10) == pytest.approx([0.4439, 0.9748], abs=1e-3)
    assert clopper_pearson(0, 10)[0] == 0.0 and clopper_pearson(10, 10)[1] == 1.0
    assert wilson(0, 0) == [None, None]


def test_mcnemar_exact():
    """property: 0 vs 6 discordant pairs gives p = 2 / 2^6; balanced pairs give p = 1."""
    a = [1] * 6 + [1, 0, 1]
    b = [0] * 6 + [1, 0, 1]
    p, x, y = mcnemar(a, b)
    assert (x, y) == (6, 0) and p == pytest.approx(2 / 64)
    assert mcnemar([1, 0], [0, 1])[0] == 1.0
    with pytest.raises(ValueError):
        mcnemar([1], [1, 0])


def test_hypergeometric_blind_gate():
    """property: sums to 1; drawing all items gives all marked; a gate that picks exactly the
    unharmed inputs (0 harms of 5 among 10, drawing 5) has p = 1 / C(10, 5)."""
    assert hypergeom_le(5, 10, 5, 5) == pytest.approx(1.0)
    assert hypergeom_le(0, 10, 5, 5) == pytest.approx(1 / math.comb(10, 5))
    assert hypergeom_le(4, 10, 5, 10) == 0.0


def test_auroc_and_holm():
    """property: perfect separation 1, reversed 0, ties 0.5; Holm is monotone and capped at 1."""
    assert auroc([3, 4], [1, 2])[0] == 1.0 and auroc([1, 2], [3, 4])[0] == 0.0
    assert auroc([1, 1], [1, 1])[0] == 0.5
    a, (lo, hi) = auroc([5], [1])                        # one pair: perfect, but the interval stays wide
    assert a == 1.0 and lo < 0.25 and hi == 1.0
    assert auroc([], [1])[0] is None
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.4, 0.3]) == pytest.approx([0.6, 0.6]) and holm([0.9, 0.8]) == [1.0, 1.0]


def test_budget_rows_always_score_some_tokens():
    """property: the harness's window scales with the budget, so no budget forces every kept token,
    and the papers' conventions are spelled out per row."""
    for K in (16, 48, 64, 96, 192, 512):
        label, spec, forced, scored = parse_spec("snapkv", K, 4, 0.125)
        assert scored > 0 and forced == 4 + max(1, round(K * 0.125)) and spec.startswith(f"snapkv:{K}:")
    label, spec, forced, scored = parse_spec("tova:heads=all,sinks=0,window=0", 64, 4, 0.125)
    assert (forced, scored) == (0, 64) and "heads=all" in spec
    assert parse_spec("h2o:sinks=0,window=half", 64, 4, 0.125)[2:] == (32, 32)
