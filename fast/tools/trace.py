"""Per-step certificate traces: arrays (npz) + metadata and summary (JSON) + PNG plots.

    tr = from_cache(cache, meta)     # after generation
    save(tr, "out/")                 # out/trace.npz, out/trace.json, out/bound_heatmap.png, out/head_profile.png
    tr = load("out/"); print(format_summary(summary(tr)))
    add_eviction(tr, out["trace"])   # with eviction (fast.policies.evictors.generate's per-step trace)

Arrays, T decode steps x L layers x B rows x H query heads:
min (the reported bound), tanh, one_minus_b_over_a, e_form, max_c, pre_min (before a repair),
optional dither_estimate (int8_dither: the dither tier's number, an estimate and not a certificate in
decoding, spec A2; traces written before issue 19 call it dither_min) and true_tv (shadow mode);
repaired [T, L, Hkv] (the KV heads served from the offload tier at that step).
With eviction (math.md T7), same layout: evict_bound (TV(p, p^K) <= U/(L+U), the kept keys'
quantization error included), evict_log_odds, optional evict_true (the true evicted mass,
shadow mode), and composed = compose_tv(evict_bound, min): the triangle inequality (T7d)
TV(p, p~^K) <= TV(p, p^K) + TV(p^K, p~^K), full exact cache against the served evicted one.
meta["eviction"] holds the spec, the PAGE drop / tau / decision, bytes before and after
eviction and the group witness bytes. Through the certified eviction gate (`kvcert run --evict-gate`,
fast.tools.evict_cli.gate_trace): evict_bound is the certified TV of each read served (<= tau),
evict_pre_gate the bound before the gate restored tokens, meta["eviction"]["gate"] its summary; the
kept keys are exact, so there is no quantization array.
"""

import json
import math
import numbers
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

COVER = 0.2  # coverage: share of checks with bound <= COVER
KEYS = ("min", "tanh", "one_minus_b_over_a", "e_form", "max_c", "pre_min", "dither_estimate", "true_tv", "repaired")
EVICT_KEYS = {"bound": "evict_bound", "log_odds": "evict_log_odds", "true": "evict_true"}
STEP_KEYS = tuple(k for k in KEYS if k != "repaired") + tuple(EVICT_KEYS.values()) + ("composed", "evict_pre_gate")  # [T, L, B, H]
TV_KEYS = ("min", "pre_min", "dither_estimate", "true_tv", "evict_bound", "evict_true", "composed", "evict_pre_gate")  # >= 0
GATE_KEYS = ("tau", "reads", "max_served_bound", "max_bound_before_gate")  # meta["eviction"]["gate"]: numbers


class TraceError(ValueError):
    """A trace directory whose files kvcert did not write as they are (corrupt, truncated, wrong
    types or shapes): one line naming the file and what is wrong."""


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


def add_eviction(tr, steps):
    """Add the eviction certificate of every decode step (fast.policies.evictors.generate's out["trace"]:
    per step {"bound", "log_odds"[, "true"]} of shape [L, B, H]) and its composition with the
    quantization certificate `min` (same steps: both start at the first decode step)."""
    import torch
    from fast.core.evict import compose_tv
    if not steps:
        return tr
    for src, dst in EVICT_KEYS.items():
        if src in steps[0]:
            tr.arrays[dst] = np.stack([t[src].detach().cpu().numpy() for t in steps])
    ev = tr.arrays["evict_bound"]
    if "min" in tr.arrays:
        q = tr.arrays["min"]
        if q.shape != ev.shape:
            raise ValueError(f"trace: eviction bound {ev.shape} and quantization bound {q.shape} do not align")
        tr.arrays["composed"] = compose_tv(torch.from_numpy(ev), torch.from_numpy(q)).numpy()
    if "eviction" in tr.meta:
        tr.meta["eviction"]["composed_max_per_step"] = [float(x) for x in tr.arrays.get("composed", ev).max(axis=(1, 2, 3))]
    return tr


def eviction_summary(tr, cover=COVER):
    """Eviction numbers: decision, bytes, witness cost, the eviction and the composed bounds."""
    a, e = tr.arrays, tr.meta.get("eviction")
    if not e:
        return {}
    out = {k: e[k] for k in ("spec", "evicted", "note", "bytes_before", "bytes_after", "witness_bytes",
                             "page_drop", "page_tau", "page_decision") if k in e}
    if e.get("evicted") and e.get("bytes_before", 0) > e.get("bytes_after", 0):
        out["witness_share_of_freed"] = e["witness_bytes"] / (e["bytes_before"] - e["bytes_after"])
    for name, key in (("evict", "evict_bound"), ("composed", "composed")):
        if key in a and a[key].size:
            b = a[key]
            out.update({f"{name}_worst": float(b.max()), f"{name}_median": float(np.median(b)),
                        f"{name}_coverage": float((b <= cover).mean())})
    if "evict_bound" in a:
        key = "composed" if "composed" in a else "evict_bound"
        out["composed_max_per_step"] = [float(x) for x in a[key].max(axis=(1, 2, 3))]
    if "evict_true" in a and a["evict_true"].size:
        out["evict_violations"] = int((a["evict_true"] > a["evict_bound"]).sum())
        out["evict_true_max"] = float(a["evict_true"].max())
    if isinstance(e.get("gate"), dict):
        g = e["gate"]
        out["gate"] = {k: g[k] for k in (*GATE_KEYS, "sketch", "retain", "restored_tokens", "evicted_tokens",
                                          "resident_over_full_mean", "fetch_over_full_per_step_mean") if k in g}
        if "evict_pre_gate" in a and a["evict_pre_gate"].size:
            out["gate"]["reads_over_tau_before_gate"] = int((a["evict_pre_gate"] > g["tau"]).sum())
    return out


def summary(tr, cover=COVER):
    """Numbers a user reads: checks, coverage, worst / median bound, repairs, bytes, and in
    shadow mode violations (true TV > bound) and bound / true TV ratios."""
    a, m = tr.arrays, tr.meta
    out = {"scheme": m.get("scheme"), "gate": m.get("gate"), "steps": 0, "checks": 0}
    if "min" in a:
        b = a["min"]
        out.update(steps=int(b.shape[0]), checks=int(b.size), coverage=float((b <= cover).mean()) if b.size else None,
                   worst_bound=float(b.max()) if b.size else None, median_bound=float(np.median(b)) if b.size else None)
    if "dither_estimate" in a and a["dither_estimate"].size:
        d = a["dither_estimate"]
        out.update(dither_estimate_coverage=float((d <= cover).mean()), dither_estimate_worst=float(d.max()),
                   dither_estimate_median=float(np.median(d)))
    if "repaired" in a and a["repaired"].size:
        out["repaired_slots"] = int(a["repaired"][-1].sum())
    out["repairs"] = m.get("fresh_repairs", 0)
    if "true_tv" in a and a["true_tv"].size:
        out.update(shadow_stats(a["true_tv"], a["min"], "det"))
        if "dither_estimate" in a:
            out.update(shadow_stats(a["true_tv"], a["dither_estimate"], "dither_estimate"))
    mem = m.get("memory") or {}
    out.update({k: mem[k] for k in ("device_bytes_per_token", "device_bytes_fp16_per_token", "fp16_bytes_per_token", "offload_bytes_per_token",
                                    "device_bytes", "offload_bytes", "repair_traffic_bytes") if k in mem})
    ev = eviction_summary(tr, cover)
    if ev:
        out["eviction"] = ev
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
    if s.get("eviction", {}).get("gate") and not s.get("checks"):  # the eviction gate: exact kept keys
        return "\n".join([f"certificate: kept keys exact (no quantization); {s.get('gate')}"] + format_eviction(s["eviction"]))
    lines = [f"certificate: scheme {s.get('scheme')}, gate {s.get('gate')}: {s.get('checks')} checks over {s.get('steps')} steps"]
    if s.get("checks"):
        lines.append(f"  coverage (bound <= {COVER}): {s['coverage']:.1%}   worst bound: {_fmt(s['worst_bound'])}   "
                     f"median: {_fmt(s['median_bound'])}")
    if "dither_estimate_coverage" in s:
        lines.append(f"  dither tier: an ESTIMATE, not a certificate (proved only for queries fixed before the dither, "
                     f"spec A2; decoding feeds it back; no gate uses it): coverage {s['dither_estimate_coverage']:.1%}   "
                     f"worst {_fmt(s['dither_estimate_worst'])}   median {_fmt(s['dither_estimate_median'])}")
    lines.append(f"  repairs: {s.get('repairs', 0)} (layer, KV head) slots served exact: {s.get('repaired_slots', 0)}")
    if "device_bytes_per_token" in s:
        lines.append(f"  bytes/token: device {s['device_bytes_per_token']:.0f} vs fp16 {s['fp16_bytes_per_token']:.0f} "
                     f"({s['device_bytes_per_token'] / s['fp16_bytes_per_token']:.2f}x); offload "
                     f"{s.get('offload_bytes_per_token', 0):.0f}; repair traffic {s.get('repair_traffic_bytes', 0)} B")
    if "det_violations" in s:
        lines.append(f"  shadow: violations {s['det_violations']}, bound/true TV median {_fmt(s['det_ratio_median'])}, "
                     f"worst {_fmt(s['det_ratio_worst'])}, max true TV {_fmt(s['true_tv_max'])}")
    if "eviction" in s:
        lines += format_eviction(s["eviction"])
    return "\n".join(lines)


def format_eviction(e):
    gate = ""
    if "page_drop" in e:
        drops = ", ".join(_fmt(float(d)) for d in e["page_drop"])
        gate = f"; PAGE drop {drops} vs tau {_fmt(e.get('page_tau'))}: {e.get('page_decision')}"
    lines = [f"eviction {e.get('spec')}: {'evicted' if e.get('evicted') else 'full cache kept'}{gate}"]
    if "note" in e:
        lines[-1] += f" ({e['note']})"
    if "bytes_before" in e:
        lines.append(f"  device bytes {e['bytes_before']} -> {e['bytes_after']} "
                     f"({e['bytes_after'] / max(e['bytes_before'], 1):.2f}x); group witness {e.get('witness_bytes', 0)} B"
                     + (f" ({e['witness_share_of_freed']:.1%} of the bytes freed)" if "witness_share_of_freed" in e else ""))
    if "evict_worst" in e:
        lines.append(f"  eviction certificate TV(p, p^K){' of the reads served' if e.get('gate') else ''}: worst {_fmt(e['evict_worst'])}   median {_fmt(e['evict_median'])}   "
                     f"coverage {e['evict_coverage']:.1%}")
    if "composed_worst" in e:
        lines.append(f"  composed with quantization (triangle, T7d) TV(p, p~^K): worst {_fmt(e['composed_worst'])}   "
                     f"median {_fmt(e['composed_median'])}   coverage {e['composed_coverage']:.1%}")
    if "composed_max_per_step" in e:
        lines.append(f"  {'served' if e.get('gate') else 'composed'} bound per decode step (max over layers, heads): "
                     + " ".join(f"{x:.3g}" for x in e["composed_max_per_step"]))
    if "evict_violations" in e:
        lines.append(f"  eviction shadow: violations {e['evict_violations']} (true evicted mass > bound), "
                     f"max true mass {_fmt(e['evict_true_max'])}")
    g = e.get("gate")
    if g:
        lines.append(f"  certified eviction gate, tau {_fmt(g['tau'])} ({g.get('sketch')} key sketches, "
                     f"{'restored tokens kept' if g.get('retain') else 'each read fetches its tokens'}): "
                     f"{g['reads']} reads, bound served <= {_fmt(g['max_served_bound'])} "
                     f"(before the gate up to {_fmt(g['max_bound_before_gate'])}"
                     + (f", {g['reads_over_tau_before_gate']} reads over tau" if "reads_over_tau_before_gate" in g else "")
                     + ")")
        if g.get("resident_over_full_mean"):
            lines.append(f"  KV bytes resident {_fmt(g['resident_over_full_mean'][0])} of the full cache; restored "
                         f"{g.get('restored_tokens', ['?'])[0]} of {g.get('evicted_tokens', ['?'])[0]} evicted (layer x KV head) "
                         f"tokens; fetched per step {_fmt((g.get('fetch_over_full_per_step_mean') or [0])[0])} of the full cache")
    return lines


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
    """Read and check a trace directory. FileNotFoundError when trace.npz or trace.json is missing;
    TraceError when either is corrupt or malformed (after load, summary and format_summary work)."""
    path = Path(path)
    npz, js = path / "trace.npz", path / "trace.json"
    try:
        present = npz.is_file() and js.is_file()
    except (OSError, ValueError) as e:
        raise TraceError(f"{path}: cannot read ({e})") from None
    if not present:
        raise FileNotFoundError(f"{path}: no trace here (expected trace.npz and trace.json)")
    try:
        z = np.load(npz, allow_pickle=False)
        if not isinstance(z, np.lib.npyio.NpzFile):
            raise ValueError("a single .npy array, not an npz archive")
        with z:
            arrays = {k: np.asarray(z[k]) for k in z.files}
        if "dither_min" in arrays and "dither_estimate" not in arrays:  # written before issue 19: the same number
            arrays["dither_estimate"] = arrays.pop("dither_min")
    except Exception as e:  # noqa: BLE001 - np.load raises many types on corrupt input (BadZipFile, zlib.error, EOFError...)
        raise TraceError(f"{npz}: not a readable npz archive ({type(e).__name__}: {e})") from None
    try:
        meta = json.loads(js.read_bytes())
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON or bad UTF-8
        raise TraceError(f"{js}: not readable JSON ({type(e).__name__}: {e})") from None
    tr = Trace(arrays, meta)
    check(tr, path)
    meta.pop("summary", None)
    return tr


def _real(x, lo=0.0):
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x) and x >= lo


def check(tr, where="trace"):
    """TraceError unless tr has the arrays and metadata that from_cache / add_eviction write:
    float [T, L, B, H] step arrays of one shape (bounds and distances >= 0, no NaN), a bool
    repaired [T, L, Hkv], a JSON object of metadata with numbers where numbers are read."""
    a, m = tr.arrays, tr.meta

    def bad(msg):
        raise TraceError(f"{where}: {msg}")

    shape = None
    for k in STEP_KEYS:
        if k not in a:
            continue
        x = a[k]
        if x.dtype.kind != "f" or x.ndim != 4:
            bad(f"trace.npz: {k} must be a float array [steps, layers, rows, heads], got {x.dtype} {x.shape}")
        if shape is not None and x.shape != shape:
            bad(f"trace.npz: {k} has shape {x.shape}, the other step arrays {shape}")
        shape = x.shape
        if k in TV_KEYS and not bool((x >= 0).all()):  # NaN fails too
            bad(f"trace.npz: {k} holds NaN or negative entries")
    if "repaired" in a:
        x = a["repaired"]
        if x.dtype != np.bool_ or x.ndim != 3 or (shape is not None and x.shape[:2] != shape[:2]):
            bad(f"trace.npz: repaired must be a bool array [steps, layers, KV heads] matching the steps, "
                f"got {x.dtype} {x.shape}")
    if not isinstance(m, dict):
        bad(f"trace.json: expected a JSON object, got {type(m).__name__}")
    for k in ("scheme", "gate", "answer"):
        if m.get(k) is not None and not isinstance(m[k], str):
            bad(f"trace.json: {k} must be a string")
    if "fresh_repairs" in m and not (isinstance(m["fresh_repairs"], int) and _real(m["fresh_repairs"])):
        bad("trace.json: fresh_repairs must be a count")
    mem = m.get("memory")
    if mem is not None:
        if not isinstance(mem, dict) or not all(_real(v) for v in mem.values()):
            bad("trace.json: memory must map names to finite byte counts >= 0")
        if "device_bytes_per_token" in mem and not mem.get("fp16_bytes_per_token"):
            bad("trace.json: memory has device_bytes_per_token but no fp16_bytes_per_token > 0")
    e = m.get("eviction")
    if e is not None:
        if not isinstance(e, dict):
            bad("trace.json: eviction must be a JSON object")
        for k in ("bytes_before", "bytes_after", "witness_bytes"):
            if k in e and not _real(e[k]):
                bad(f"trace.json: eviction.{k} must be a byte count")
        if ("bytes_before" in e) != ("bytes_after" in e):
            bad("trace.json: eviction needs both bytes_before and bytes_after")
        if "page_drop" in e and not (isinstance(e["page_drop"], list) and
                                     all(isinstance(d, numbers.Real) and not isinstance(d, bool) for d in e["page_drop"])):
            bad("trace.json: eviction.page_drop must be a list of numbers")
        for k in ("spec", "note", "page_decision"):
            if e.get(k) is not None and not isinstance(e[k], str):
                bad(f"trace.json: eviction.{k} must be a string")
        g = e.get("gate")
        if g is not None and not (isinstance(g, dict) and all(_real(g.get(k)) for k in GATE_KEYS) and g["tau"] <= 1):
            bad(f"trace.json: eviction.gate must be a JSON object with numbers >= 0 for {', '.join(GATE_KEYS)} (tau <= 1)")
    try:  # what report does with it: must work on everything check accepts
        format_summary(summary(Trace(a, {k: v for k, v in m.items() if k != "summary"})))
    except (TypeError, ValueError, KeyError, ZeroDivisionError, AttributeError, IndexError, OverflowError) as err:
        bad(f"malformed trace ({type(err).__name__}: {err})")
    return tr


def _savefig(fig, path):
    """fig as PNG at path, written to a temp file renamed into place (never a half-written image); closes fig."""
    import matplotlib.pyplot as plt
    from fast.tools.inputs import usual_mode
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        try:
            usual_mode(tmp, 0o666)
            fig.savefig(tmp, dpi=100, format="png")
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    finally:
        plt.close(fig)


def plots(tr, out):
    """bound_heatmap.png (layer x step, worst head) and head_profile.png (layer x head, mean and worst)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "min" not in tr.arrays or tr.arrays["min"].size == 0:  # e.g. the eviction gate: exact kept keys
        has = "evict_bound" in tr.arrays and tr.arrays["evict_bound"].size
        return [_eviction_plot(tr, Path(out), plt)] if has else []
    b = tr.arrays["min"]  # [T, L, B, H]
    out = Path(out)
    title = f"{tr.meta.get('scheme')} / gate {tr.meta.get('gate')}"
    _bound_heatmap(tr, b, title, out / "bound_heatmap.png", plt)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5), sharey=True)
    for ax, data, name in ((axes[0], b.mean(axis=(0, 2)), "mean over steps"), (axes[1], b.max(axis=(0, 2)), "worst over steps")):
        im = ax.imshow(data, aspect="auto", origin="lower", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
        ax.set_xlabel("query head")
        ax.set_title(name)
    axes[0].set_ylabel("layer")
    fig.colorbar(im, ax=axes, label="certified TV bound")
    fig.suptitle(f"per-head profile: {title}")
    _savefig(fig, out / "head_profile.png")
    files = [out / "bound_heatmap.png", out / "head_profile.png"]
    if "evict_bound" in tr.arrays and tr.arrays["evict_bound"].size:
        files.append(_eviction_plot(tr, out, plt))
    return files


def gate_tau(gate):
    """TAU of a threshold gate's name (certified:TAU, ladder:TAU), else None."""
    kind, _, arg = str(gate).partition(":")
    try:
        return float(arg) if kind in ("certified", "ladder") else None
    except ValueError:
        return None


def _bound_heatmap(tr, b, title, path, plt):
    """bound_heatmap.png: the worst head's bound per (layer, step). With a threshold gate, two panels, the
    bound before the gate and the bound served, on a scale that splits at TAU (below it blue, above it red:
    served reads all sit below it), and an x where the gate moved a KV head up in that step."""
    from matplotlib.colors import ListedColormap, TwoSlopeNorm
    tau = gate_tau(tr.meta.get("gate"))
    panels = [("min", "served", b)]
    if tau is not None and 0 < tau < 1 and "pre_min" in tr.arrays:
        panels.insert(0, ("pre_min", "before the gate", tr.arrays["pre_min"]))
    norm = TwoSlopeNorm(vmin=0.0, vcenter=tau, vmax=1.0) if tau is not None and 0 < tau < 1 else None
    kw = dict(aspect="auto", origin="lower", interpolation="nearest")
    # below tau: viridis (dark to light green), above it: reds; a visible step at tau itself
    split = ListedColormap(np.vstack([plt.get_cmap("viridis")(np.linspace(0.0, 0.85, 128)),
                                      plt.get_cmap("Reds")(np.linspace(0.45, 1.0, 128))]))
    kw.update(dict(cmap=split, norm=norm) if norm else dict(cmap="magma", vmin=0, vmax=1))
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), sharey=True, squeeze=False)
    moved = None
    if norm and "repaired" in tr.arrays and tr.arrays["repaired"].size:  # [T, L, Hkv]: served off the scheme
        r = tr.arrays["repaired"].astype(bool).any(axis=-1)                # [T, L]
        moved = np.argwhere(r & ~np.concatenate([np.zeros_like(r[:1]), r[:-1]]))
    for ax, (_, name, data) in zip(axes[0], panels):
        im = ax.imshow(data.max(axis=(2, 3)).T, **kw)
        if moved is not None and len(moved):
            ax.scatter(moved[:, 0], moved[:, 1], marker="x", s=18, c="black", linewidths=0.8, label="head repaired")
            ax.legend(loc="upper right", fontsize=7)
        ax.set_xlabel("decode step")
        ax.set_title(f"{name}: worst head per (layer, step)")
    axes[0][0].set_ylabel("layer")
    label = "certified TV bound" + (f" (scale splits at tau = {tau:g})" if norm else "")
    cb = fig.colorbar(im, ax=list(axes[0]), label=label)
    if norm:
        cb.ax.axhline(tau, color="black", linewidth=1)
    fig.suptitle(f"TV bound: {title}")
    _savefig(fig, path)


def _eviction_plot(tr, out, plt):
    """eviction_heatmap.png: layer x step (worst head) of the eviction bound and of the composed bound."""
    panels = [("evict_pre_gate", "before the gate: TV(p, p^K)"), ("evict_bound", "eviction TV(p, p^K)"),
              ("composed", "composed TV(p, p~^K)")]
    if "evict_pre_gate" in tr.arrays:
        panels[1] = ("evict_bound", f"served through the gate (tau {(tr.meta.get('eviction') or {}).get('gate', {}).get('tau')})")
    panels = [(k, name) for k, name in panels if k in tr.arrays]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.5), sharey=True, squeeze=False)
    for ax, (key, name) in zip(axes[0], panels):
        im = ax.imshow(tr.arrays[key].max(axis=(2, 3)).T, aspect="auto", origin="lower", cmap="magma", vmin=0, vmax=1,
                       interpolation="nearest")
        ax.set_xlabel("decode step")
        ax.set_title(name)
    axes[0][0].set_ylabel("layer")
    fig.colorbar(im, ax=axes[0].tolist(), label="certified TV bound")
    fig.suptitle(f"eviction {(tr.meta.get('eviction') or {}).get('spec')}, scheme {tr.meta.get('scheme')}: worst head")
    _savefig(fig, out / "eviction_heatmap.png")
    return out / "eviction_heatmap.png"
