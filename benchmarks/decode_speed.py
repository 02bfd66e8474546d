"""Decode tokens/s on SmolLM2-135M for each cache, as ratios of the uncompressed cache, same run.

For each context (prompt tokens; 8k means 8192 - max_new, SmolLM2's context being 8192) one
exact prefill at batch 1 is shared by every cache (fill_from); batch 4 repeats it with
different lengths (sequence b has its first b L/8 tokens masked as left padding). The caches then
decode the same teacher-forced tokens, their steps interleaved (each step of each cache in turn),
so that load on the shared machine hits every variant alike; tokens/s = B / median step time.

Variants
- uncompressed (the baseline of every ratio): DynamicCache, torch sdpa with enable_gqa=True and the
  padding mask as a boolean mask (attention "sdpa_gqa", registered here): the KV heads are never
  repeated. transformers' own "sdpa" does the same at batch 1 (no mask), but under a padding mask it
  repeats every KV head G times (repeat_kv, a copy of the whole cache per layer and step), which
  made its batch-4 throughput lower than its batch-1 one: that row is kept, labelled, not the base;
- every other row: fast.CertifiedCache read with attention "kvcert" (what fast.enable_meter sets),
  as README's first example builds it; its default backend="auto" reads through the fused C++
  kernel (fast.integrations.hf_fused) wherever the kernel applies (int8, int4, kivi2, prerope4, fp8, int8_dither);
- int8 (no certificate): certify=False: the same codes, served by the fused kernel;
- int8 certified: the fused kernel, certificate epilogue batched once per step;
- int8 certified (torch twin): backend="torch" (the served fp32 copy + the torch twin);
- int4 / kivi2 / prerope4 / fp8_e4m3 certified: the defaults, through the fused kernel (2- and 4-bit
  codes, pre-RoPE key codes, fp8 codes with per-token scales read in place); int8_dither certified
  reads its codes in place too (the dither regenerated at read) and records the dither estimate from
  the same pass;
- int8 certified:0.2 (gate): README's first example, the gate certified:0.2 on the fused read (each layer's
  certificate at once, KV heads over 0.2 served from the exact copy, read through the kernel); "repaired_heads"
  counts the (layer, KV head) slots served exact at the end; (gate, torch twin): the same through the twin;
- quanto int4 / int2: transformers QuantizedCache(backend="quanto") when optimum-quanto imports
  (--quanto), read with the baseline's attention.
meter overhead = step time int8 certified / int8 (no certificate), same codes, same run.

Peak memory at the largest context (--memory): one child process per variant loads the model and
the saved exact prefill, builds its cache, drops the prefill, resets the peak (/proc/self/clear_refs
5) and decodes a few steps; VmHWM is the measured peak RSS of the process.

    nice -n 10 python -m benchmarks.decode_speed            # results/decode_speed.json (+ .png)
"""

import argparse
import copy
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
CTX_MAX = 8192


def prompt_ids(tok, n):
    """n token ids of ordinary text (the passkey prompt's filler, repeated), chat-formatted."""
    from fast.integrations.model import chat_ids
    from fast.tools.cli import passkey_prompt
    filler = 40
    while True:
        ids = chat_ids(tok, passkey_prompt(filler)[0])
        if len(ids) >= n:
            return ids[-n:]
        filler *= 2


ATTENTION = "kvcert"  # the meter's name: fast.enable_meter(model) sets it (README's first example)
BASELINE = "sdpa_gqa"  # the uncompressed cache's attention: GQA-aware sdpa, also under a padding mask
CACHES = {  # variant: (scheme, fast.CertifiedCache keywords), each read with ATTENTION
    "int8 (no certificate)": ("int8", {"certify": False}),
    "int8 certified": ("int8", {}),
    "int8 certified (torch twin)": ("int8", {"backend": "torch"}),
    "int8_dither certified": ("int8_dither", {}),
    "int4 certified": ("int4", {}),
    "kivi2 certified": ("kivi2", {}),
    "prerope4 certified": ("prerope4", {}),
    "fp8_e4m3 certified": ("fp8_e4m3", {}),
    "int8 certified:0.2 (gate)": ("int8", {"gate": "certified:0.2"}),  # README's first example
    "int8 certified:0.2 (gate, torch twin)": ("int8", {"gate": "certified:0.2", "backend": "torch"}),
}
QUANTO_BITS = (4, 2)


def gqa_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The baseline's attention: torch sdpa over the cache's KV heads as they are (enable_gqa), the
    HF mask (boolean or additive) passed as a boolean mask. Output [B, T, H, D] as HF expects."""
    mask = attention_mask
    if mask is not None and mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                                           is_causal=mask is None and query.shape[2] > 1,
                                                           enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def register_baseline():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(BASELINE, gqa_sdpa)
    AttentionMaskInterface.register(BASELINE, sdpa_mask)
MEMORY_VARIANTS = ["uncompressed", "int8 certified", "int8 (no certificate)", "int8 certified (torch twin)"]


def certified_cache(config, variant):
    """The variant's cache, built as README's first example builds one."""
    import fast
    from benchmarks.soundness import scheme_of
    scheme, kw = CACHES[variant]
    return fast.CertifiedCache(config, scheme_of(scheme, config), **kw)


def variant_names(quanto):
    """Every variant but the baseline, in table order."""
    return (["uncompressed (transformers sdpa)", *CACHES]
            + ([f"quanto int{b} (transformers QuantizedCache)" for b in QUANTO_BITS] if quanto else []))


def groups_of(names, size):
    """The variants split into groups of at most `size` (0: one group); each group is timed with its
    own copy of the baseline, so that the caches of one group only are in memory at a time."""
    size = size or len(names) or 1
    return [names[i:i + size] for i in range(0, len(names), size)]


def make_variants(model, exact, B, L, names):
    """{variant: (cache, attention)} for the baseline and `names`, all holding the same prefill."""
    valid = torch.ones(B, L, dtype=torch.bool)
    for b in range(B):
        valid[b, : b * L // 8] = False
    src = exact if B == 1 else _repeat(exact, B, model.config)
    v = {"uncompressed": (_copy(src, model.config), BASELINE)}
    for name in names:
        if name == "uncompressed (transformers sdpa)":
            v[name] = (_copy(src, model.config), "sdpa")
        elif name in CACHES:
            v[name] = (certified_cache(model.config, name).fill_from(src, valid), ATTENTION)
        else:
            from transformers import QuantizedCache
            bits = int(name.split()[1][3:])
            qc = QuantizedCache(backend="quanto", config=model.config, nbits=bits, residual_length=32, q_group_size=32)
            for layer, s in enumerate(src.layers):  # the same prefill, stored through the cache's own update
                qc.update(s.keys, s.values, layer)
            v[name] = (qc, BASELINE)
    return v, valid


def _copy(cache, config):
    return copy.deepcopy(cache)


def _repeat(exact, B, config):
    from transformers import DynamicCache
    out = DynamicCache(config=config)
    for layer, s in enumerate(exact.layers):
        out.update(s.keys.repeat(B, 1, 1, 1), s.values.repeat(B, 1, 1, 1), layer)
    return out


def time_group(model, variants, valid, first, B, L, steps):
    """{variant: [step seconds]}: every variant's decode steps interleaved (one step of each in turn)."""
    from fast.integrations.hf_meter import set_current
    times = {name: [] for name in variants}
    tok_in = first.repeat(B)
    mask = torch.cat([valid, torch.ones(B, steps + 1, dtype=torch.bool)], 1).long()
    with torch.no_grad():
        for step in range(steps + 1):  # step 0: warm-up, not timed
            nxt = None
            for name, (cache, attn) in variants.items():
                model.set_attn_implementation(attn)
                set_current(None)
                am = mask[:, : L + step + 1] if attn != ATTENTION else None
                t = time.perf_counter()
                logits = model(input_ids=tok_in[:, None], past_key_values=cache, attention_mask=am, use_cache=True).logits[:, -1]
                if step:
                    times[name].append(time.perf_counter() - t)
                if name == "uncompressed":
                    nxt = logits.argmax(-1)
            tok_in = nxt
    return times


def run_context(model, tok, L, batches, steps, quanto, log, group_size=0):
    from transformers import DynamicCache
    ids = torch.tensor([prompt_ids(tok, L)])
    exact = DynamicCache(config=model.config)
    t0 = time.perf_counter()
    with torch.no_grad():
        first = model(input_ids=ids, past_key_values=exact, use_cache=True).logits[:, -1].argmax(-1)
    log(f"  prefill {L} tokens: {time.perf_counter() - t0:.1f} s")
    out = {}
    for B in batches:
        res, groups = {}, groups_of(variant_names(quanto), group_size)
        for g, names in enumerate(groups):
            variants, valid = make_variants(model, exact, B, L, names)
            times = time_group(model, variants, valid, first, B, L, steps)
            base = statistics.median(times["uncompressed"])
            for name, ts in times.items():
                if name == "uncompressed" and g:  # later groups' baselines: kept beside, not as the row
                    res.setdefault("baseline_of_group", []).append({"group": g, "median_step_s": base, "step_s": ts})
                    continue
                med = statistics.median(ts)
                cache = variants[name][0]
                res[name] = {"median_step_s": med, "tokens_per_s": B / med, "ratio_vs_uncompressed": base / med,
                             "step_s": ts, "group": g}
                if hasattr(cache, "memory"):
                    res[name]["device_bytes_per_token"] = cache.memory()["device_bytes_per_token"]
                if hasattr(cache, "fused_reads"):
                    res[name]["fused_reads"] = cache.fused_reads
                if getattr(cache, "gate", None) is not None and cache.gate.kind != "none":  # (layer, KV head) slots served exact
                    res[name]["repaired_heads"] = sum(int(layer.repaired.sum()) for layer in cache.layers if layer.is_initialized)
            del variants
            gc.collect()
        pair = res["int8 certified"], res["int8 (no certificate)"]
        if pair[0]["group"] != pair[1]["group"]:
            raise SystemExit("--group-size: int8 certified and int8 (no certificate) must be timed in one group")
        res["meter_overhead"] = pair[0]["median_step_s"] / pair[1]["median_step_s"]
        out[f"B={B}"] = res
        (ROOT / "build").mkdir(exist_ok=True)
        with open(ROOT / "build" / "decode_speed_cells.jsonl", "a") as fh:  # survives an interrupted run
            fh.write(json.dumps({"context": L, "batch": B, "cell": res, "command": " ".join(sys.argv)}) + "\n")
        log(f"  L={L} B={B}: " + ", ".join(f"{n} {r['tokens_per_s']:.2f} tok/s ({r['ratio_vs_uncompressed']:.2f}x)"
                                           for n, r in res.items() if isinstance(r, dict)) + f"; meter {res['meter_overhead']:.3f}x")
    return out, exact


def cells_from_log(text):
    """{context: {"B=b": {variant: {"tokens_per_s", "ratio_vs_uncompressed"}, "meter_overhead"}}} from the
    "L=... B=...:" lines this script logs (an earlier run that did not reach the end)."""
    import re
    out = {}
    for line in text.splitlines():
        m = re.match(r"\s*L=(\d+) B=(\d+): (.*); meter ([0-9.]+)x$", line)
        if not m:
            continue
        cell = {"from_log": True, "meter_overhead": float(m.group(4))}
        for part in m.group(3).split("), "):
            v = re.match(r"(.+) ([0-9.]+) tok/s \(([0-9.]+)x\)?$", part.strip())
            if v:
                cell[v.group(1)] = {"tokens_per_s": float(v.group(2)), "ratio_vs_uncompressed": float(v.group(3))}
        out.setdefault(int(m.group(1)), {})[f"B={m.group(2)}"] = cell
    return out


# ---- peak memory (child processes) ----

def _status(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return None


def memory_child(variant, path, steps):
    from transformers import DynamicCache

    from fast.integrations.hf_meter import set_current
    from fast.tools.cli import load
    model, _ = load()
    saved = torch.load(path, mmap=True)  # file-backed: unmapped once the tensors are dropped
    exact = DynamicCache(config=model.config)
    for layer, (k, v) in enumerate(saved):
        exact.update(k.clone(), v.clone(), layer) if variant == "uncompressed" else exact.update(k, v, layer)
    del saved
    attn = "sdpa"
    if variant == "uncompressed":
        cache = exact
    else:
        cache, attn = certified_cache(model.config, variant).fill_from(exact), ATTENTION
        del exact
    model.set_attn_implementation(attn)
    x = torch.tensor([[42]])

    def step():
        set_current(None)
        with torch.no_grad():
            model(input_ids=x, past_key_values=cache, use_cache=True)
    step()  # steady state: buffers of the build (the prefill, the tail's pre-flush storage) are released
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    rss0 = _status("VmRSS")
    for _ in range(steps):
        step()
    print(json.dumps({"variant": variant, "rss_before_decode": rss0, "peak_rss": _status("VmHWM"),
                      "rss_after": _status("VmRSS")}))


def measure_memory(exact, variants, steps, log):
    path = ROOT / "build" / "decode_speed_prefill.pt"
    path.parent.mkdir(exist_ok=True)
    torch.save([(s.keys, s.values) for s in exact.layers], path)
    out = {}
    try:
        for v in variants:
            r = subprocess.run([sys.executable, "-m", "benchmarks.decode_speed", "--memory-child", v, "--memory-file", str(path),
                                "--steps", str(steps)], cwd=ROOT, capture_output=True, text=True)
            line = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
            if r.returncode or not line:
                raise RuntimeError(f"memory child {v} failed:\n{r.stderr[-2000:]}")
            out[v] = json.loads(line[-1])
            log(f"  peak RSS {v}: {out[v]['peak_rss'] / 2**20:.0f} MiB")
    finally:
        path.unlink(missing_ok=True)
    return out


def memory_only(args, argv):
    """Peak RSS children from a saved prefill; writes doc["memory"] of --out (the rest is kept)."""
    from transformers import DynamicCache

    from fast.tools.cli import load
    children = {}
    for v in MEMORY_VARIANTS:
        r = subprocess.run([sys.executable, "-m", "benchmarks.decode_speed", "--memory-child", v, "--memory-file",
                            args.memory_from, "--steps", "3"], cwd=ROOT, capture_output=True, text=True)
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        if r.returncode or not line:
            raise RuntimeError(f"memory child {v} failed:\n{r.stderr[-2000:]}")
        children[v] = json.loads(line[-1])
        print(f"peak RSS {v}: {children[v]['peak_rss'] / 2**20:.0f} MiB", flush=True)
    model, _ = load()
    saved = torch.load(args.memory_from, mmap=True)
    exact = DynamicCache(config=model.config)
    for layer, (k, v) in enumerate(saved):
        exact.update(k, v, layer)
    probe = certified_cache(model.config, "int8 certified").fill_from(exact)
    fp32_bytes = sum(s.keys.nbytes + s.values.nbytes for s in exact.layers)
    mem = {"context_tokens": exact.layers[0].keys.shape[2], "children": children, "fp32_cache_bytes": fp32_bytes,
           "int8_cache_device_bytes": probe.memory()["device_bytes"],
           "cache_bytes_saved": fp32_bytes - probe.memory()["device_bytes"],
           "peak_saved_vs_uncompressed": {v: children["uncompressed"]["peak_rss"] - m["peak_rss"] for v, m in children.items()},
           "command": "python -m benchmarks.decode_speed " + " ".join(sys.argv[1:] if argv is None else argv),
           "method": "one child process per variant: model + saved prefill (mmap), cache built, one decode step, "
                     "buffers released (gc, malloc_trim), VmHWM reset (/proc/self/clear_refs 5), 3 decode steps; "
                     "peak_rss = VmHWM"}
    doc = json.loads(Path(args.out).read_text())
    doc["memory"] = mem
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


def plot(doc, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(doc["batches"]), figsize=(6 * len(doc["batches"]), 4.2), squeeze=False)
    for ax, B in zip(axes[0], doc["batches"]):
        names = list(doc["contexts"][str(doc["context_tokens"][0])][f"B={B}"])
        shown = [n for n in names if n not in ("meter_overhead", "from_log", "baseline_of_group")]
        ax.set_prop_cycle(color=[plt.cm.tab20(i % 20) for i in range(len(shown))])
        for name in shown:
            xs = [L for L in doc["context_tokens"] if name in doc["contexts"][str(L)][f"B={B}"]]
            ys = [doc["contexts"][str(L)][f"B={B}"][name]["ratio_vs_uncompressed"] for L in xs]
            ax.plot(xs, ys, marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_ylabel("decode tokens/s / uncompressed (same cell)")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_title(f"SmolLM2-135M, CPU, batch {B} (machine load varies between cells:\nratios, not tokens/s)", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1024,4096,8192", help="prompt tokens (8192 -> 8192 - max_new)")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--steps", type=int, default=5, help="timed decode steps per variant (after 1 warm-up)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    ap.add_argument("--memory", action="store_true", help="peak RSS per variant at the largest context (child processes)")
    ap.add_argument("--quanto", action="store_true", help="add transformers' QuantizedCache (optimum-quanto must import)")
    ap.add_argument("--group-size", type=int, default=0,
                    help="time the variants in groups of this many, each interleaved with its own copy of the "
                         "baseline, one group's caches in memory at a time (0: all in one group)")
    ap.add_argument("--out", default=str(ROOT / "results" / "decode_speed.json"))
    ap.add_argument("--merge-log", default=None,
                    help="a log of an earlier run of this script: its cells (per context and batch, all ratios "
                         "from that run) are added for the contexts this run does not measure")
    ap.add_argument("--memory-from", default=None, help="only the peak-memory children, from this saved prefill "
                    "(torch.save([(keys, values)] per layer)); the result replaces 'memory' in --out")
    ap.add_argument("--replot", action="store_true", help="only redraw the plot from --out")
    ap.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--memory-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.memory_child:
        memory_child(args.memory_child, args.memory_file, args.steps)
        return 0
    if args.memory_from:
        return memory_only(args, argv)
    if args.replot:
        plot(json.loads(Path(args.out).read_text()), Path(args.out).with_suffix(".png"))
        return 0
    import transformers

    from benchmarks.soundness import machine
    from fast.core import cpu_fused
    from fast.tools.cli import load
    if not cpu_fused.available():
        raise SystemExit("fast.core.cpu_fused did not build (g++ with OpenMP needed)")
    max_new = args.steps + 1
    contexts = [min(int(c), CTX_MAX - max_new) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    quanto_note = None
    if args.quanto:
        try:
            import optimum.quanto  # noqa: F401
        except ImportError as e:
            quanto_note = f"optimum-quanto does not import: {e}"
            args.quanto = False
    model, tok = load()
    register_baseline()
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    res, last = {}, None
    for L in contexts:
        res[str(L)], last = run_context(model, tok, L, batches, args.steps, args.quanto, log, args.group_size)
    merged, measured = {}, set(res)
    if args.merge_log:
        merged = cells_from_log(Path(args.merge_log).read_text())
        for L, cells in merged.items():
            if str(L) not in res:
                res[str(L)] = cells
        contexts = sorted(int(L) for L in res)
    memory = None
    if args.memory:
        memory = measure_memory(last, MEMORY_VARIANTS, 3, log)
        probe = certified_cache(model.config, "int8 certified").fill_from(last)
        fp32_bytes = sum(s.keys.nbytes + s.values.nbytes for s in last.layers)
        memory = {"context_tokens": contexts[-1], "children": memory, "fp32_cache_bytes": fp32_bytes,
                  "int8_cache_device_bytes": probe.memory()["device_bytes"],
                  "cache_bytes_saved": fp32_bytes - probe.memory()["device_bytes"]}
        memory["peak_saved_vs_uncompressed"] = {v: memory["children"]["uncompressed"]["peak_rss"] - m["peak_rss"]
                                                for v, m in memory["children"].items()}
    if memory is None and args.merge_log and Path(args.out).exists():  # keep the earlier run's measured peak RSS
        memory = json.loads(Path(args.out).read_text()).get("memory")
    command = "python -m benchmarks.decode_speed " + " ".join(sys.argv[1:] if argv is None else argv)
    mach = machine()
    mach["torch_threads"] = torch.get_num_threads()
    mach["load_average_1min_at_end"] = os.getloadavg()[0]
    rows = []
    for L in contexts:
        for B in batches:
            r = res[str(L)][f"B={B}"]
            for name, v in r.items():
                if isinstance(v, dict) and "tokens_per_s" in v:
                    rows.append([str(L), str(B), name, f"{v['tokens_per_s']:.2f}", f"{v['ratio_vs_uncompressed']:.2f}x"])
            rows.append([str(L), str(B), "meter overhead (int8 certified / int8 no certificate)", "", f"{r['meter_overhead']:.3f}x"])
    if args.merge_log:
        command += f"  (cells of contexts {sorted(int(L) for L in merged if str(L) not in measured)} from the log of " \
                   f"an earlier run of this script, {args.merge_log}; memory: from --out's earlier run)"
    doc = {"command": command, "machine": mach, "transformers": transformers.__version__, "steps": args.steps,
           "context_tokens": contexts, "batches": batches, "contexts": res, "memory": memory,
           "quanto": "included" if args.quanto else (quanto_note or "not requested (--quanto)"),
           "notes": ["step times of all variants interleaved; ratios within one (context, batch) cell",
                     "batch 4: one prefill repeated, sequence b with b L/8 left-padding tokens masked (different lengths)",
                     "with --group-size K the variants are timed K at a time, each group interleaved with its own "
                     "copy of the baseline (its ratios are against that copy; 'group' in each row, the later "
                     "groups' baselines in 'baseline_of_group')",
                     "uncompressed (the base of every ratio): DynamicCache read by torch sdpa with enable_gqa=True and the "
                     "padding mask (attention 'sdpa_gqa'); 'uncompressed (transformers sdpa)': transformers' sdpa, "
                     "which repeats the KV heads under a padding mask (batch > 1)",
                     "certified rows: fast.CertifiedCache, attention 'kvcert' (fast.enable_meter); backend 'auto' "
                     "reads through the C++ kernel (fast.core.cpu_fused) where it applies; (torch twin): "
                     "backend='torch', the served fp32 copy + the torch twin"],
           "readme_table": {"title": f"Decode speed, SmolLM2-135M on this CPU ({mach['torch_threads']} torch thread(s), "
                                     f"{args.steps} interleaved steps; ratio = tokens/s vs the uncompressed cache, same cell)",
                            "header": ["context", "batch", "cache", "tokens/s", "ratio"], "rows": rows},
           "log": lines}
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    try:
        plot(doc, Path(args.out).with_suffix(".png"))
    except ImportError:
        print("matplotlib missing: no plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
