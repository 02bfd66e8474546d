"""benchmarks/decode_speed.py times the cache README's first example builds (fast.CertifiedCache,
read with the attention fast.enable_meter sets), not another class or attention name."""

import ast
from pathlib import Path

from test_readme import python_blocks

import fast
from benchmarks import decode_speed

ROOT = Path(__file__).resolve().parent.parent


def called(tree):
    """Dotted names of every call in tree ("fast.CertifiedCache", "model.generate", ...)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            parts, f = [], node.func
            while isinstance(f, ast.Attribute):
                parts.append(f.attr)
                f = f.value
            if isinstance(f, ast.Name):
                out.append(".".join([f.id] + parts[::-1]))
    return out


def test_benchmark_builds_the_readme_cache():
    """Property: the only cache class README's first example constructs is the only one the benchmark
    constructs, and the benchmark never names FusedCertifiedCache."""
    _, code = python_blocks((ROOT / "README.md").read_text())[0]
    readme = {c for c in called(ast.parse(code)) if c.endswith("Cache")}
    assert readme == {"fast.CertifiedCache"}, readme
    src = (ROOT / "benchmarks" / "decode_speed.py").read_text()
    bench = {c for c in called(ast.parse(src)) if c.endswith("CertifiedCache")}
    assert bench == readme, bench
    assert "FusedCertifiedCache" not in src


def test_benchmark_reads_with_the_readme_attention():
    """Property: ATTENTION is the name fast.enable_meter (README's first example) gives the model,
    and no variant is labelled "(meter)" (every certified row goes through the same meter)."""
    _, code = python_blocks((ROOT / "README.md").read_text())[0]
    assert "fast.enable_meter" in called(ast.parse(code))

    class Model:
        def set_attn_implementation(self, name):
            self.attn = name

    assert fast.enable_meter(Model()).attn == decode_speed.ATTENTION
    assert not [n for n in decode_speed.CACHES if "(meter)" in n]
    assert set(decode_speed.MEMORY_VARIANTS) <= {"uncompressed", *decode_speed.CACHES}


def test_baseline_attention_is_transformers_sdpa_without_the_repeat():
    """The uncompressed baseline (decode_speed.BASELINE, GQA-aware sdpa under a padding mask) computes
    what transformers' sdpa computes: same logits at prefill and at every decode step of a padded
    batch of a GQA model, so the speed baseline changes the layout, not the model."""
    import torch
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=96, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval()
    decode_speed.register_baseline()
    ids = torch.randint(0, 64, (3, 40))
    mask = torch.ones(3, 40, dtype=torch.long)
    mask[1, :10] = 0
    mask[2, :25] = 0
    outs = {}
    for attn in ("sdpa", decode_speed.BASELINE):
        model.set_attn_implementation(attn)
        cache, m, x, logits = DynamicCache(config=cfg), mask, ids, []
        with torch.no_grad():
            for _ in range(4):
                out = model(input_ids=x, attention_mask=m, past_key_values=cache, use_cache=True).logits[:, -1]
                logits.append(out)
                x, m = out.argmax(-1)[:, None], torch.cat([m, torch.ones(3, 1, dtype=torch.long)], 1)
        outs[attn] = torch.stack(logits)
    assert torch.allclose(outs["sdpa"], outs[decode_speed.BASELINE], atol=1e-5, rtol=1e-5)
    assert (outs["sdpa"][:, 1] - outs["sdpa"][:, 2]).abs().max() > 1e-3  # the padding matters: rows differ


def test_results_baseline_is_fair_at_batch_4():
    """results/decode_speed.json (what README's table shows): in every context the uncompressed
    baseline gives at least as many tokens/s at batch 4 as at batch 1, and it is the GQA-aware
    attention, not transformers' repeat-under-mask sdpa (kept as its own row)."""
    import json
    doc = json.loads((ROOT / "results" / "decode_speed.json").read_text())
    assert any("sdpa_gqa" in n for n in doc["notes"])
    for L, cells in doc["contexts"].items():
        b1, b4 = cells["B=1"]["uncompressed"]["tokens_per_s"], cells["B=4"]["uncompressed"]["tokens_per_s"]
        assert b4 >= b1, (L, b1, b4)
        assert "uncompressed (transformers sdpa)" in cells["B=4"]
