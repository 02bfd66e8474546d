"""Per-step certificate traces: arrays (npz) + metadata and summary (JSON) + PNG plots.

    tr = from_cache(cache, meta)     # after generation
    save(tr, "out/")                 # out/trace.npz, out/trace.json, out/bound_heatmap.png, out/head_profile.png
    tr = load("out/"); print(format_summary(summary(tr)))

Arrays, T decode steps x L layers x B rows x H query heads:
min (the reported bound), tanh, one_minus_b_over_a, e_form, max_c, pre_min (before a repair),
optional dither_min (probabilistic tier, int8_dither) and true_tv (shadow mode);
repaired [T, L, Hkv] (the KV heads served from the offload tier at that step).
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

COVER = 0.2  # coverage: share of checks with bound <= COVER
KEYS = ("min", "tanh", "one_minus_b_over_a", "e_form", "max_c", "pre_min", "dither_min", "true_tv", "repaired")


@dataclass
class Trace:
    arrays: dict
    meta: dict = field(default_factory=dict)


def from_cache(cache, meta=None):
    """Stack cache.records (one per step and layer, in call order) into [T, L, ...] arrays."""
    L = cache.num_layers
    recs = cache.records
    T = len(recs) // L
    if T * L != len(recs):
        raise ValueError(f"trace: {len(recs)} records is not a whole number of steps over {L} layers")
    arrays = {}
    for key in KEYS:
        if not recs or key not in recs[0]:
            continue
        rows = [r[key].detach().cpu().numpy() for r in recs]
        arrays[key] = np.stack(rows).reshape(T, L, *rows[0].shape)
    meta = dict(meta or {})
    meta.setdefault("memory", cache.memory())
    meta.setdefault("scheme", cache.scheme.name)
    meta.setdefault("gate", str(cache.gate))
    meta["fresh_repairs"] = int(sum(r["fresh_repairs"] for r in recs))
    return Trace(arrays, meta)


def summary(tr, cover=COVER):
    """Numbers a user reads: checks, coverage, worst / median bound, repairs, bytes, and in
    shadow mode violations (true TV > bound) and bound / true TV ratios."""
    a, m = tr.arrays, tr.meta
    out = {"scheme": m.get("scheme"), "gate": m.get("gate"), "steps": 0, "checks": 0}
    if "min" in a:
        b = a["min"]
        out.update(steps=int(b.shape[0]), checks=int(b.size), coverage=float((b <= cover).mean()) if b.size else None,
                   worst_bound=float(b.max()) if b.size else None, median_bound=float(np.median(b)) if b.size else None)
    if "dither_min" in a and a["dither_min"].size:
        d = a["dither_min"]
        out.update(dither_coverage=float((d <= cover).mean()), dither_worst=float(d.max()), dither_median=float(np.median(d)))
    if "repaired" in a and a["repaired"].size:
        out["repaired_slots"] = int(a["repaired"][-1].sum())
    out["repairs"] = m.get("fresh_repairs", 0)
    if "true_tv" in a and a["true_tv"].size:
        out.update(shadow_stats(a["true_tv"], a["min"], "det"))
        if "dither_min" in a:
            out.update(shadow_stats(a["true_tv"], a["dither_min"], "dither"))
    mem = m.get("memory") or {}
    out.update({k: mem[k] for k in ("device_bytes_per_token", "fp16_bytes_per_token", "offload_bytes_per_token",
                                    "device_bytes", "offload_bytes", "repair_traffic_bytes") if k in mem})
    return out


def shadow_stats(true_tv, bound, tier):
    """Violations (true > bound) and bound / true ratios over checks whose true TV is > 1e-9."""
    pos = true_tv > 1e-9
    ratio = bound[pos] / true_tv[pos]
    return {f"{tier}_violations": int((true_tv > bound).sum()),
            f"{tier}_ratio_median": float(np.median(ratio)) if ratio.size else None,
            f"{tier}_ratio_worst": float(ratio.max()) if ratio.size else None,
            f"{tier}_ratio_best": float(ratio.min()) if ratio.size else None,
            "true_tv_max": float(true_tv.max())}


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def format_summary(s):
    lines = [f"certificate: scheme {s.get('scheme')}, gate {s.get('gate')}: {s.get('checks')} checks over {s.get('steps')} steps"]
    if s.get("checks"):
        lines.append(f"  coverage (bound <= {COVER}): {s['coverage']:.1%}   worst bound: {_fmt(s['worst_bound'])}   "
                     f"median: {_fmt(s['median_bound'])}")
    if "dither_coverage" in s:
        lines.append(f"  dither tier (non-adaptive queries, spec A2): coverage {s['dither_coverage']:.1%}   "
                     f"worst {_fmt(s['dither_worst'])}   median {_fmt(s['dither_median'])}")
    lines.append(f"  repairs: {s.get('repairs', 0)} (layer, KV head) slots served exact: {s.get('repaired_slots', 0)}")
    if "device_bytes_per_token" in s:
        lines.append(f"  bytes/token: device {s['device_bytes_per_token']:.0f} vs fp16 {s['fp16_bytes_per_token']:.0f} "
                     f"({s['device_bytes_per_token'] / s['fp16_bytes_per_token']:.2f}x); offload "
                     f"{s.get('offload_bytes_per_token', 0):.0f}; repair traffic {s.get('repair_traffic_bytes', 0)} B")
    if "det_violations" in s:
        lines.append(f"  shadow: violations {s['det_violations']}, bound/true TV median {_fmt(s['det_ratio_median'])}, "
                     f"worst {_fmt(s['det_ratio_worst'])}, max true TV {_fmt(s['true_tv_max'])}")
    return "\n".join(lines)


def save(tr, out):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out / "trace.npz", **tr.arrays)
    doc = dict(tr.meta)
    doc["summary"] = summary(tr)
    (out / "trace.json").write_text(json.dumps(doc, indent=2, default=_json_default))
    plots(tr, out)
    return out


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    return str(o)


def load(path):
    path = Path(path)
    if not (path / "trace.npz").is_file() or not (path / "trace.json").is_file():
        raise FileNotFoundError(f"{path}: no trace here (expected trace.npz and trace.json)")
    with np.load(path / "trace.npz") as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads((path / "trace.json").read_text())
    meta.pop("summary", None)
    return Trace(arrays, meta)


def plots(tr, out):
    """bound_heatmap.png (layer x step, worst head) and head_profile.png (layer x head, mean and worst)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "min" not in tr.arrays or tr.arrays["min"].size == 0:
        return []
    b = tr.arrays["min"]  # [T, L, B, H]
    out = Path(out)
    title = f"{tr.meta.get('scheme')} / gate {tr.meta.get('gate')}"
    fig, ax = plt.subplots(figsize=(8, 4.5))
    im = ax.imshow(b.max(axis=(2, 3)).T, aspect="auto", origin="lower", cmap="magma", vmin=0, vmax=1,
                   interpolation="nearest")
    ax.set_xlabel("decode step")
    ax.set_ylabel("layer")
    ax.set_title(f"TV bound, worst head per (layer, step): {title}")
    fig.colorbar(im, ax=ax, label="certified TV bound")
    fig.tight_layout()
    fig.savefig(out / "bound_heatmap.png", dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5), sharey=True)
    for ax, data, name in ((axes[0], b.mean(axis=(0, 2)), "mean over steps"), (axes[1], b.max(axis=(0, 2)), "worst over steps")):
        im = ax.imshow(data, aspect="auto", origin="lower", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
        ax.set_xlabel("query head")
        ax.set_title(name)
    axes[0].set_ylabel("layer")
    fig.colorbar(im, ax=axes, label="certified TV bound")
    fig.suptitle(f"per-head profile: {title}")
    fig.savefig(out / "head_profile.png", dpi=100)
    plt.close(fig)
    return [out / "bound_heatmap.png", out / "head_profile.png"]
