"""Page box certificates on real decoding (benchmarks/pagebox.py's pipeline) on the random tiny
GQA Llama, batch 2 with left padding: property: every witness's log-odds bound >= the true
log-odds of the evicted mass from the exact keys at every (step, layer, head); the page box is
tighter than the group ball here too, and the witness bytes are what the formats say.
"""
import pytest
import torch

from benchmarks.pagebox import run_cell, summarize_cell
from fast.policies.evictors import prefill
from tests.tiny_model import tiny_evict_llama


@pytest.mark.parametrize("name", ["snapkv", "streaming", "random", "h2o"])
def test_pagebox_shadow_bound_ge_true_mass_tiny(name):
    model = tiny_evict_llama()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (2, 150), generator=g)
    mask = torch.ones(2, 150, dtype=torch.long)
    mask[0, :20] = 0
    pre = prefill(model, ids, mask, needs={"window", "accumulated"})
    sh, nbytes, evicted = run_cell(model, pre, f"{name}:60:sinks=4,window=8", 3, [4, 8], [4])
    assert len(sh.rows) == 3 * 3                                           # steps x layers
    names = list(nbytes)
    assert {"ball-g32", "box-p4", "box-p4-h", "box-c4", "box-p8", "box-p8-h"} <= set(names)
    for _, row in sh.rows:
        true = row["true_log_odds"]
        assert bool(torch.isfinite(true).all())
        for n in names:                                                     # fp64 truth: slack 1e-9 nats
            assert bool((row[n] >= true - 1e-9).all()), (name, n, (row[n] - true).min())
    s = summarize_cell([[{k: v[b] for k, v in row.items()} for _, row in sh.rows] for b in range(2)], names)
    assert all(s[n]["violations"] == 0 and s[n]["checks"] == 3 * 3 * 2 * 4 for n in names)
    assert s["box-p4"]["log_z_ratio_median"] < s["ball-g32"]["log_z_ratio_median"]
    # evicted per layer and KV head: 130 - 60 and 150 - 60 real tokens; bytes: per page fp16 lo and hi
    # (2 x D x 2, head dim D = 16) + an int32 count, ceil(90 / 4) = 23 pages per (row, KV head, layer)
    assert evicted == 3 * 2 * (70 + 90)
    assert nbytes["box-p4"] == 3 * 2 * 2 * 23 * (2 * 16 * 2 + 4)
