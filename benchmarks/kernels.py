"""Fast-path benchmark on SmolLM2 shapes (H=9, Hkv=3, D=64), torch path on this CPU.

    python -m benchmarks.kernels                  # torch path on the CPU: results/kernels.json
    python -m benchmarks.kernels --device cuda    # Triton kernel on a GPU: results/kernels_cuda.json (untested here: no GPU)

Every timing is a ratio against a baseline measured in the same run, the variants
interleaved repetition by repetition (median of the per-repetition times); each repetition
reads LAYERS distinct caches in turn (as a decode step reads one per layer), so the caches do not
stay in the CPU's caches:
- meter overhead, fused (fast.core.cpu_fused, the C++ kernel): the certified read of an int8
  cache with its stored 1-byte-per-band witness / the same read with certify=False, same codes;
- meter overhead, torch twin: decode_attention with the certificate (zero-memory witness from
  the scales) / the same call with certify=False;
- each read / fp32 sdpa over the unquantized cache;
and the storage arithmetic: bytes per cached token per KV head (K and V, codes + scales +
witness) for each codec, and tokens per byte against an fp16 cache.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import fast

ROOT = Path(__file__).resolve().parent.parent
H, HKV, D, NB = 9, 3, 64, 8
NS = (512, 1024, 2048, 8192)
LAYERS = 30  # SmolLM2-135M has 30 layers: a decode step reads 30 caches and runs one certificate epilogue


def timed(fn, device):
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def bench_n(N, reps, device="cpu", seed=0, layers=LAYERS):
    from fast.core import cpu_fused
    g = torch.Generator().manual_seed(seed)
    s = D ** -0.5
    bands = fast.rope_bands(D, NB)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    caches = []
    for _ in range(layers):
        q = torch.randn(1, H, D, generator=g).to(device)
        k = torch.randn(1, HKV, N, D, generator=g).to(device)
        v = torch.randn(1, HKV, N, D, generator=g).to(device)
        kq = fast.quantize(k, "int8", group_size=64)
        vq = fast.quantize(v, "int8", group_size=64)
        rho = fast.pack_witness(fast.witness(k, fast.dequantize(kq), bands))
        seg0 = cpu_fused.seg(HKV, N, k=kq.codes, v=vq.codes, k_scales=kq.scales.view(torch.int16),
                             v_scales=vq.scales.view(torch.int16), rho=rho)
        caches.append((q, k, v, kq, vq, rho, [seg0, cpu_fused.seg(HKV, 0)], q[:, None].contiguous()))
    qpos = torch.full((1, 1), N - 1)
    qpos32 = qpos.to(torch.int32)
    b64 = bands.to(torch.int64).contiguous()
    from fast.core.witness import _log_table
    lut = _log_table("cpu").to(torch.float32).contiguous()

    def serving(cs, certify):
        """What fast.integrations.hf_fused runs per decode step: the kernel on each layer's own
        buffers, then one certificate epilogue for all the layers' reads."""
        stats = [cpu_fused._run(c[7], qpos32, c[6], s, b64, 1, 1, certify, lut)[1] for c in cs]
        return cpu_fused._certificate(torch.cat(stats), NB, N, D) if certify else None

    variants = {
        "sdpa_fp32": lambda c: sdpa(c[0].unsqueeze(2), c[1], c[2], scale=s, enable_gqa=True),
        "int8_no_cert": lambda c: fast.decode_attention(c[0], c[3], c[4], None, s, bands=bands, certify=False),
        "int8_cert": lambda c: fast.decode_attention(c[0], c[3], c[4], None, s, bands=bands),
    }
    if device == "cpu":
        variants["fused_int8_no_cert"] = lambda c: cpu_fused.attention_rows(c[0][:, None], c[3], c[4], c[5], s, bands=bands, q_pos=qpos, certify=False)
        variants["fused_int8_cert"] = lambda c: cpu_fused.attention_rows(c[0][:, None], c[3], c[4], c[5], s, bands=bands, q_pos=qpos)
    per_step = {"kernel_int8_no_cert": lambda cs: serving(cs, False), "kernel_int8_cert": lambda cs: serving(cs, True)}
    if device != "cpu":
        per_step = {}
    for fn in variants.values():  # warm up
        fn(caches[0])
    for fn in per_step.values():
        fn(caches)
    times = {name: [] for name in [*variants, *per_step]}
    for _ in range(reps):
        for name, fn in variants.items():
            times[name].append(timed(lambda: [fn(c) for c in caches], device) / layers)
        for name, fn in per_step.items():
            times[name].append(timed(lambda: fn(caches), device) / layers)
    med = {name: statistics.median(t) for name, t in times.items()}
    _, cert = variants["int8_cert"](caches[0])
    res = {
        "N": N, "reps": reps, "layers_cycled": layers, "median_s_per_read": med,
        "meter_overhead": med["int8_cert"] / med["int8_no_cert"],
        "int8_cert_vs_sdpa_fp32": med["int8_cert"] / med["sdpa_fp32"],
        "int8_no_cert_vs_sdpa_fp32": med["int8_no_cert"] / med["sdpa_fp32"],
        "cert_min_median": float(cert["min"].median()),
    }
    if device == "cpu":
        res["fused_meter_overhead"] = med["fused_int8_cert"] / med["fused_int8_no_cert"]
        res["fused_cert_vs_sdpa_fp32"] = med["fused_int8_cert"] / med["sdpa_fp32"]
        res["fused_no_cert_vs_sdpa_fp32"] = med["fused_int8_no_cert"] / med["sdpa_fp32"]
        res["fused_cert_vs_twin_cert"] = med["fused_int8_cert"] / med["int8_cert"]
        res["kernel_meter_overhead"] = med["kernel_int8_cert"] / med["kernel_int8_no_cert"]
        res["kernel_cert_vs_sdpa_fp32"] = med["kernel_int8_cert"] / med["sdpa_fp32"]
        res["kernel_no_cert_vs_sdpa_fp32"] = med["kernel_int8_no_cert"] / med["sdpa_fp32"]
    return res


def storage():
    """Bytes per cached token per KV head, K and V together, and tokens per byte vs fp16."""
    x = torch.randn(1, HKV, 16, D)
    fp16 = 2 * D * 2
    rows = []
    configs = [
        ("int8 g64, zero-memory witness", "int8", 64, 0),
        ("int8 g32, zero-memory witness", "int8", 32, 0),
        ("int8 g64, stored log witness (NB=8)", "int8", 64, NB),
        ("int8_dither g64, zero-memory witness", "int8_dither", 64, 0),
        ("int4 g32, zero-memory witness", "int4", 32, 0),
        ("int4 g64, zero-memory witness", "int4", 64, 0),
        ("fp8_e4m3, per-token scale, zero-memory witness", "fp8_e4m3", 64, 0),
        ("fp8_e4m3 raw cast, zero-memory witness", "fp8_e4m3", 0, 0),
    ]
    for label, scheme, group, witness_bytes in configs:
        if scheme.startswith("fp8"):
            qt = fast.quantize(x, scheme, per_token_scale=group > 0)
        else:
            qt = fast.quantize(x, scheme, group_size=group)
        per = 2 * qt.bytes_per_token_head() + witness_bytes  # K and V; the witness covers K only
        rows.append({"codec": label, "bytes_per_token_head": per, "tokens_per_byte_vs_fp16": fp16 / per})
    return {"fp16_bytes_per_token_head": fp16, "codecs": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--layers", type=int, default=LAYERS, help="distinct caches read in turn per repetition")
    ap.add_argument("--out", default=None, help="default: results/kernels.json (cpu), results/kernels_cuda.json (cuda)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on a shared machine)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: the Triton kernel (backend auto)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = args.out or str(ROOT / "results" / ("kernels.json" if args.device == "cpu" else "kernels_cuda.json"))
    timings = [bench_n(N, args.reps, args.device, layers=args.layers) for N in NS]
    store = storage()
    table = [[f"meter overhead, C++ kernel as served (hf_fused), N={t['N']} (int8 cert / int8 no cert)", f"{t['kernel_meter_overhead']:.2f}x"]
             for t in timings if "kernel_meter_overhead" in t]
    table += [[f"C++ kernel certified read / fp32 sdpa, N={t['N']}", f"{t['kernel_cert_vs_sdpa_fp32']:.2f}x"] for t in timings if "kernel_meter_overhead" in t]
    table += [[f"C++ kernel read without certificate / fp32 sdpa, N={t['N']}", f"{t['kernel_no_cert_vs_sdpa_fp32']:.2f}x"] for t in timings if "kernel_meter_overhead" in t]
    table += [[f"meter overhead, fused API (cpu_fused.attention_rows, with input checks), N={t['N']}", f"{t['fused_meter_overhead']:.2f}x"]
              for t in timings if "fused_meter_overhead" in t]
    table += [[f"meter overhead, torch twin, N={t['N']} (int8 cert / int8 no cert)", f"{t['meter_overhead']:.2f}x"] for t in timings]
    table += [[f"int8 decode attention with cert / fp32 sdpa, N={t['N']}", f"{t['int8_cert_vs_sdpa_fp32']:.2f}x"] for t in timings]
    table += [[f"int8 decode attention without cert / fp32 sdpa, N={t['N']}", f"{t['int8_no_cert_vs_sdpa_fp32']:.2f}x"] for t in timings]
    table += [[f"{c['codec']}: tokens per byte vs fp16", f"{c['tokens_per_byte_vs_fp16']:.3f}x ({c['bytes_per_token_head']:g} B)"]
              for c in store["codecs"]]
    result = {
        "command": " ".join(["python -m benchmarks.kernels", *(sys.argv[1:] if argv is None else argv)]),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpu_count": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "loadavg_1min_at_end": os.getloadavg()[0]},
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "shapes": {"H": H, "Hkv": HKV, "D": D, "NB": NB, "B": 1},
        "timings": timings,
        "storage": store,
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "readme_table": {"title": f"Fast path ({'torch, CPU' if args.device == 'cpu' else 'Triton, ' + args.device}), SmolLM2 shapes H=9, Hkv=3, D=64",
                         "header": ["measure", "value"], "rows": table},
    }
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    for row in table:
        print(" | ".join(row))


if __name__ == "__main__":
    main()
