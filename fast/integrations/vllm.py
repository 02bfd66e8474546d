"""kvcert inside vLLM (CPU backend): a certificate for every read of the quantized KV cache.

One switch: the entry point `vllm.general_plugins: kvcert` (pyproject.toml) runs register() in
the engine and in every worker; it does nothing unless KVCERT_VLLM=1. Then the CPU attention
backend is replaced by KVCertBackend, whose impl
- do_kv_cache_update: casts keys and values with the configured codec (KVCERT_CODEC, vLLM's own
  fp8 truncating cast, fast.integrations.vllm_fp8), lets vLLM write them into its paged cache,
  READS BACK the stored keys and computes the band witness (math.md T4) of the exact key against
  exactly what is stored (cpu_fused.paged_witness, in place), per cache slot: rho [num_blocks, Hkv, block_size, NB], a side tensor
  mirroring the paged cache, rewritten whenever the slot is (block reuse, prefix caching,
  preemption and recompute stay right);
  KVCERT_CODEC=int8 (and int4_per_token_head, fp8_per_token_head: PACKED) instead owns the cache bytes: KVCertBackend.customize_spec (vLLM's hook for a backend's
  own page packing) makes each (slot, KV head) of vLLM's paged cache hold int8 key and value codes, their fp16
  scales and the witness's uint8 log codes of the fine table (packed_row_bytes: 140 bytes for D = 64, 8 bands, against 512 for
  K and V at fp32), so vLLM's block count, capacity and memory accounting see the compressed bytes, and
  do_kv_cache_update writes codes, scales and the witness of the exact key against the decoded code in place
  (packed_views); vLLM's own kernel never reads that page (KVCERT_CERTIFY=0 reads it with the fused kernel,
  without certificates);
- forward: every query row of every request that reads the cache (decode, prefill, chunked prefill,
  mixed batches) is read by the fused C++ read IN PLACE from vLLM's paged cache (fast.core.cpu_fused
  paged_seg: the block table, keys [D, bs] per block; the torch twin fast.core.attention.attention_rows
  over the gathered blocks where it does not apply), the functions the transformers path uses; its
  output is what the plugin serves, so the certificate is about the very weights served. vLLM's own
  kernel does not run (in shadow mode it runs too, and its output is compared with the served one);
- gate certified:TAU: once a (request, layer, KV head) certificate exceeds TAU, that head's
  output for the request is served from an exact side store from then on (its bytes counted);
- shadow (KVCERT_SHADOW=1): the true TV of each row from the exact side store (tests, benchmarks).

What the certificate bounds: TV(softmax(s<q, k_j>), softmax(s<q, k~_j>)) for every row and query
head, k exact (as computed by the model), k~ as stored; vLLM's own kernel arithmetic is trusted
(as the model's arithmetic is, math.md "What is trusted").

Online serving (`vllm serve`): the same switch; two documented vLLM extension points add more.
- `--kv-transfer-config "$(python -c 'from fast.integrations.vllm import CONNECTOR_CONFIG; print(CONNECTOR_CONFIG)')"`
  (KVTransferConfig with kv_connector_module_path): KVCertConnector, a KV connector that transfers
  nothing; its request_finished returns {"kvcert": the request's summary}, which vLLM puts in
  RequestOutput.kv_transfer_params and the completion response's `kv_transfer_params`. It needs the
  uniprocess executor (the worker in the engine-core process; on CPU: VLLM_ENABLE_V1_MULTIPROCESSING=0),
  else start-up is refused with one line.
- PROMETHEUS_MULTIPROC_DIR set (prometheus_client's multiprocess mode, which vLLM's /metrics reads;
  vLLM sets it itself with --api-server-count > 1): the worker's counters kvcert_certified_reads_total,
  kvcert_repairs_total and the histogram kvcert_bound appear on /metrics.
- A request's own gate threshold: SamplingParams.extra_args {"kvcert_tau": T} (in `vllm serve`, the request
  field "vllm_xargs": {"kvcert_tau": T}) replaces the server's TAU for that request (the server must run
  certified:TAU). It is checked at admission by KVCertRequestArgs, a logits processor that changes no logit,
  through its validate_params; the plugin adds it to model_config.logits_processors when the engine
  configuration is built. A bad value gets HTTP 400 (LLM.generate: VLLMValidationError). The summary names the tau
  applied.
    KVCERT_VLLM=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 PROMETHEUS_MULTIPROC_DIR=$(mktemp -d)
        vllm serve MODEL --dtype float32 --kv-transfer-config "$(...CONNECTOR_CONFIG...)"   (one command line)

Configuration (environment, read in every process; workers inherit it):
  KVCERT_VLLM=1            enable the plugin
  KVCERT_CODEC             fp8_e4m3 (default) | fp8_e5m2 | int8 (one fp16 scale per token and KV head, packed in
                           vLLM's own page: 3.66x the fp32 cache's tokens per byte) | fp8_per_token_head (fp8 e4m3
                           rounded to nearest with one fp32 scale per token and KV head, as vLLM's GPU backends keep
                           it, packed the same way: 144 bytes per slot and KV head at D = 64, 3.56x) |
                           int4_per_token_head (int4 codes two a byte, one fp16 scale per token and KV head: 76
                           bytes, 6.74x) | none (an exact
                           fp32 cache); fp8_e4m3 / fp8_e5m2 (vLLM's CPU truncating cast) and none are stored decoded
                           in vLLM's fp32 cache (no memory saved)
  KVCERT_GATE              none (default) | certified:TAU
  KVCERT_SHADOW=1          also the true TV per (row, head) (needs the exact side store)
  KVCERT_CERTIFY=0         the codec without certificates (the speed baseline)
  KVCERT_TRACE_DIR=DIR     full traces: one JSONL per worker rank
  KVCERT_BANDS=8           bands per head (math.md Bands; rotate_half pairs)
  KVCERT_RECORDS=0         per-read records a worker keeps (the oldest dropped first; make_llm: records=)
  KVCERT_MAX_SUMMARIES=1024 summaries of finished requests kept until handed back (the oldest dropped first)
  KVCERT_BOX=1             the box form (spec T9) in the certificates: the fused read also keeps each row's
                           histogram of c and the box runs over its bins (spec T9c, fast.core.box.hist_box; the
                           torch twin's reads: over the tokens), tighter and slower
  KVCERT_BOX_ABOVE=0       the box only on rows whose closed-form bound is above this (in [0, 1); 0: every row)
  KVCERT_FAULT             none (default) | key_scale:F: a faulty quantizer for demos and tests, the keys
                           stored times F after the cast (a wrong or missing scale); the witness, measured
                           against the exact key, sees it: certified, flagged, repaired by the gate
Engine requirements (checked in vLLM's main process before any engine process starts: one line, exit
status 1; make_llm: ValueError): dtype float32, kv_cache_dtype "auto", head size a multiple of
2 * KVCERT_BANDS, the CPU backend, decoder self-attention. kvcert's side tensors are counted inside
vLLM's KV-cache budget (_kv_budget).

    from vllm import SamplingParams
    from fast.integrations.vllm import collect, generate, make_llm, smollm2_dir
    llm = make_llm(str(smollm2_dir()), codec="fp8_e4m3", gate="certified:0.2", enforce_eager=True,
                   max_model_len=2048, kv_cache_memory_bytes=256 << 20)
    outs = generate(llm, ["The capital of France is"], SamplingParams(max_tokens=16))  # each with .kvcert
    records = collect(llm)                # per-read records of every rank, via collective_rpc

Demo: python -m fast.integrations.vllm --help
"""

import json
import math
import os
import re
import sys
from collections import OrderedDict, deque

import torch

from fast.core import cpu_fused
from fast.core.attention import attention_rows  # the torch twin: where the fused read does not apply
from fast.core.box import HIST_M, hist_box
from fast.core.certify import logit_rounding, with_other_logits
from fast.core.quant import dequantize, quantize
from fast.core.rope import rope_bands
from fast.core.witness import log_table32, unpack_witness, witness
from fast.integrations import vllm_fp8
from fast.policies.gate import parse_gate

ENV = "KVCERT_VLLM"
PACKED = ("int8", "int4_per_token_head", "fp8_per_token_head")  # codes, scales and witness in vLLM's page
CODECS = vllm_fp8.CODECS + PACKED + ("none",)
EXTENSION = "fast.integrations.vllm.KVCertWorker"


# every KVCERT_* variable the project reads (a misspelt name would otherwise be ignored without a word)
KNOWN_ENV = ("KVCERT_VLLM", "KVCERT_CODEC", "KVCERT_GATE", "KVCERT_SHADOW", "KVCERT_CERTIFY", "KVCERT_TRACE_DIR",
             "KVCERT_BANDS", "KVCERT_RECORDS", "KVCERT_MAX_SUMMARIES", "KVCERT_FAULT", "KVCERT_BOX", "KVCERT_BOX_ABOVE",
             "KVCERT_BUILD_DIR", "KVCERT_CACHE", "KVCERT_SANITIZE", "KVCERT_SCALAR", "KVCERT_TRITON_CHILD")


class Config:
    """The plugin's settings, parsed once per process from the environment (ValueError: one line).
    With KVCERT_VLLM unset or 0 nothing else is read: a disabled plugin never stands in vLLM's way.
    names: how the caller spelt each variable in the error (make_llm: its keyword arguments)."""

    def __init__(self, env=None, names=None):
        env = os.environ if env is None else env
        name = lambda var: (names or {}).get(var, var)

        def flag(var, default):
            v = env.get(var, default)
            if v not in ("0", "1"):
                raise ValueError(f"kvcert: {name(var)}={v!r}: expected 0 or 1")
            return v == "1"

        def count(var, default, least=0):
            v = env.get(var, default)
            if not (v.isascii() and v.isdigit()) or int(v) < least:
                raise ValueError(f"kvcert: {name(var)}={v!r}: expected an integer >= {least}")
            return int(v)

        self.enabled = flag(ENV, "0")
        if not self.enabled:
            return
        unknown = sorted(k for k in env if k.startswith("KVCERT_") and k not in KNOWN_ENV)
        if unknown:
            raise ValueError(f"kvcert: unknown variable {unknown[0]} (known: {', '.join(KNOWN_ENV[:10])})")
        self.codec = env.get("KVCERT_CODEC", "fp8_e4m3")
        if self.codec not in CODECS:
            raise ValueError(f"kvcert: {name('KVCERT_CODEC')}={self.codec!r}: expected one of {', '.join(CODECS)}")
        gate = env.get("KVCERT_GATE", "none")
        try:
            self.gate = parse_gate(gate)
        except ValueError as e:
            raise ValueError(f"kvcert: {name('KVCERT_GATE')}={gate!r}: {e}") from None
        if self.gate.kind in ("risk", "ladder"):
            raise ValueError(f"kvcert: {name('KVCERT_GATE')}={gate!r}: {self.gate.kind} is not supported in vLLM (use "
                             "none or certified:TAU)")
        self.shadow = flag("KVCERT_SHADOW", "0")
        self.certify = flag("KVCERT_CERTIFY", "1")
        self.box = flag("KVCERT_BOX", "0")  # the box form (spec T9): over the fused read's histogram of c (T9c)
        above = env.get("KVCERT_BOX_ABOVE", "0")
        try:
            self.box_above = float(above)
        except ValueError:
            self.box_above = math.nan
        if not 0 <= self.box_above < 1:
            raise ValueError(f"kvcert: {name('KVCERT_BOX_ABOVE')}={above!r}: expected a number in [0, 1)")
        if self.box_above and not self.box:
            raise ValueError(f"kvcert: {name('KVCERT_BOX_ABOVE')}={above!r} without {name('KVCERT_BOX')}=1 (no box to skip)")
        self.trace_dir = env.get("KVCERT_TRACE_DIR") or None
        self.bands = count("KVCERT_BANDS", "8", least=1)
        # per-read records a worker keeps (the oldest dropped first, counted); 0: none (serving)
        self.records = count("KVCERT_RECORDS", "0")
        # summaries of finished requests not yet handed back (generate()) a worker keeps, the oldest dropped first
        self.max_summaries = count("KVCERT_MAX_SUMMARIES", "1024", least=1)
        self.fault = parse_fault(env.get("KVCERT_FAULT", "none"), name("KVCERT_FAULT"))
        if (self.gate.kind == "certified" or self.shadow or self.box) and not self.certify:
            raise ValueError("kvcert: the gate, shadow mode and the box form need certificates (KVCERT_CERTIFY=1)")

    @property
    def exact_store(self):
        return self.gate.kind == "certified" or self.shadow

    @property
    def packed(self):
        """int8, int4_per_token_head, fp8_per_token_head: the codes, scales and witness live in vLLM's own paged cache (packed_views),
        not decoded."""
        return self.codec in PACKED

    def side_bytes_per_slot(self, head_size):
        """kvcert's bytes per (cache slot, KV head) outside vLLM's cache: the witness (NB fp32; none when packed:
        it is in the page) and the exact store (K and V fp32)."""
        if not self.certify:
            return 0
        return (0 if self.packed else 4 * self.bands) + (2 * 4 * head_size if self.exact_store else 0)

    def cache_bytes_per_slot(self, head_size, itemsize=4):
        """vLLM's cache bytes per (slot, KV head): K and V at the model's dtype, or the packed page."""
        return packed_row_bytes(head_size, self.bands, self.certify, self.codec) if self.packed else 2 * head_size * itemsize


SCALE_BYTES = {"int8": 2, "int4_per_token_head": 2, "fp8_per_token_head": 4}  # one scale per (token, KV head): fp16, fp32 (fp8)
CODE_BYTES = {"int8": 1, "int4_per_token_head": 0.5, "fp8_per_token_head": 1}  # per channel


PAGE_CODEC = {"int8": "int8", "int4_per_token_head": "int4", "fp8_per_token_head": "fp8_e4m3"}  # cpu_fused.page_write's


def packed_row_bytes(D, NB, certify=True, codec="int8"):
    """Bytes per (cache slot, KV head) of the packed page (KVCERT_CODEC in PACKED): key and value codes (D bytes each,
    D / 2 for int4: CODE_BYTES), their scales (fp16 for int8 and int4, fp32 for fp8: SCALE_BYTES each), the witness's
    uint8 log codes (NB bytes; none without certificates), padded to a multiple of 4 (vLLM views the page at the
    model's fp32)."""
    return -(-(2 * int(D * CODE_BYTES[codec]) + 2 * SCALE_BYTES[codec] + (NB if certify else 0)) // 4) * 4


def packed_views(kv_cache, D, NB, codec="int8"):
    """The parts of the packed page (vLLM's cache tensor [num_blocks, Hkv, bs, C] at fp32, C = packed_row_bytes / 4;
    each (block, KV head) slab of bs C 4 bytes contiguous): per slab, one after the other, key codes [bs, W], value
    codes [bs, W] (int8, W = D; int4: two codes a byte, uint8, W = D / 2; fp8 e4m3 bytes as uint8, W = D), key scales
    [bs, 1], value scales [bs, 1] (int8 and int4: fp16 bits as int16; fp8: fp32), witness [bs, NB] (uint8 log codes of the fine table, fast.core.witness.pack_witness(fine=True); NB = 0: none). Returns
    (kc, vc, ks, vs, rho) views [num_blocks, Hkv, bs, X] into the cache: writing them writes vLLM's blocks, so block
    reuse, prefix caching, preemption and vLLM's block copies carry the scales and the witness with the codes."""
    nb, hkv, bs, c = kv_cache.shape
    sb, W = SCALE_BYTES[codec], int(D * CODE_BYTES[codec])
    slab = kv_cache.view(torch.uint8).view(nb, hkv, bs * c * kv_cache.element_size())
    if slab.shape[2] < bs * (2 * W + 2 * sb + NB):
        raise ValueError(f"kvcert: the cache page holds {slab.shape[2] // bs} bytes per slot, the packed {codec} page needs "
                         f"{2 * W + 2 * sb + NB} (is the KVCertBackend's customize_spec in force?)")
    part = lambda off, width, dt: slab[:, :, off * bs:(off + width) * bs].view(dt).view(nb, hkv, bs, -1)
    rho = part(2 * W + 2 * sb, NB, torch.uint8) if NB else None
    cd, sd = {"int8": (torch.int8, torch.int16), "int4_per_token_head": (torch.uint8, torch.int16),
              "fp8_per_token_head": (torch.uint8, torch.float32)}[codec]
    return (part(0, W, cd), part(W, W, cd), part(2 * W, sb, sd), part(2 * W + sb, sb, sd), rho)


def int8_codes(x):
    """x [n, Hkv, D] -> (codes int8 [n, Hkv, D], scales fp16 [n, Hkv, 1]): fast.core.quant's int8 with one scale per
    (token, KV head) (_cast's values: codes * scales). A (token, head) holding NaN/Inf gets a NaN scale, so
    that its decoded row is NaN and the certified read refuses it."""
    bad = ~torch.isfinite(x).all(-1, keepdim=True)
    qt = quantize(x.float().masked_fill(bad, 0.0).permute(1, 0, 2)[None], "int8", group_size=x.shape[-1])
    codes, scales = qt.codes[0].permute(1, 0, 2), qt.scales[0].permute(1, 0, 2)
    return codes, scales.masked_fill(bad, float("nan"))


def fp8_codes(x):
    """x [n, Hkv, D] -> (codes: fp8 e4m3 bytes uint8 [n, Hkv, D], scales fp32 [n, Hkv, 1]): fast.core.quant's fp8_e4m3
    (round to nearest) with one fp32 scale per (token, KV head), as vLLM's fp8_per_token_head (GPU backends) keeps
    them. A (token, head) holding NaN/Inf gets a NaN scale (its row decodes to NaN: the certified read refuses it)."""
    bad = ~torch.isfinite(x).all(-1, keepdim=True)
    qt = quantize(x.float().masked_fill(bad, 0.0).permute(1, 0, 2)[None], "fp8_e4m3", per_token_scale=True)
    codes, scales = qt.codes[0].permute(1, 0, 2).view(torch.uint8), qt.scales[0].permute(1, 0, 2)
    return codes, scales.masked_fill(bad, float("nan"))


def int4_codes(x):
    """x [n, Hkv, D] -> (codes uint8 [n, Hkv, D / 2], two per byte, low nibble = even channel, code = nibble - 8; scales
    fp16 [n, Hkv, 1]): fast.core.quant's int4 with one scale per (token, KV head), as vLLM's int4_per_token_head keeps
    one scale per token and head. A (token, head) holding NaN/Inf gets a NaN scale (the certified read refuses it)."""
    bad = ~torch.isfinite(x).all(-1, keepdim=True)
    qt = quantize(x.float().masked_fill(bad, 0.0).permute(1, 0, 2)[None], "int4", group_size=x.shape[-1])
    codes, scales = qt.codes[0].permute(1, 0, 2), qt.scales[0].permute(1, 0, 2)
    return codes, scales.masked_fill(bad, float("nan"))


def page_codes(x, codec):
    """(codes, scales) of x [n, Hkv, D] as the packed page of `codec` stores them (int8_codes, int4_codes, fp8_codes)."""
    return {"int8": int8_codes, "int4_per_token_head": int4_codes, "fp8_per_token_head": fp8_codes}[codec](x)


def page_decode(codes, scales, codec):
    """The fp32 values the packed page's codes and scales stand for, as the fused kernel decodes them: code x scale
    (int8, int4: exact in fp32; fp8: fl(c s), fast.core.quant.dequantize's product). scales: the page's views (int16
    bits of fp16 for int8 and int4, fp32 for fp8)."""
    if codec == "int8":
        return codes.float() * scales.view(torch.float16).float()
    if codec == "int4_per_token_head":
        c = torch.stack([codes & 15, codes >> 4], -1).flatten(-2).float() - 8  # channel 2 i: low nibble of byte i
        return c * scales.view(torch.float16).float()
    return codes.view(torch.float8_e4m3fn).float() * scales


def parse_fault(text, name="KVCERT_FAULT"):
    """None for "none", else the factor F of "key_scale:F" (finite, >= 0); ValueError: one line."""
    if text == "none":
        return None
    kind, _, arg = text.partition(":")
    try:
        f = float(arg)
    except ValueError:
        f = math.nan
    if kind != "key_scale" or not (math.isfinite(f) and f >= 0):
        raise ValueError(f"kvcert: {name}={text!r}: expected none or key_scale:F with F a finite number >= 0")
    return f


TAU_ARG = "kvcert_tau"


def request_tau(extra_args, cfg):
    """The gate threshold a request asks for (SamplingParams.extra_args["kvcert_tau"], `vllm serve`'s
    vllm_xargs), or None for the server's; ValueError (one line) when it is not a number in [0, 1] or the
    server runs no gate (without the exact side store nothing can be repaired)."""
    if not extra_args or TAU_ARG not in extra_args:
        return None
    v = extra_args[TAU_ARG]
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            pass
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and 0 <= v <= 1):
        raise ValueError(f"kvcert: {TAU_ARG}={extra_args[TAU_ARG]!r}: expected a number in [0, 1]")
    if not (cfg.enabled and cfg.gate.kind == "certified"):
        raise ValueError(f"kvcert: {TAU_ARG} needs a server started with KVCERT_GATE=certified:TAU (this one runs "
                         f"{'no gate' if cfg.enabled else 'without the plugin'})")
    return float(v)


def check_engine(cfg, *, dtype, kv_cache_dtype, head_size, attn_type="decoder"):
    """Start-up checks shared by make_llm, the engine configuration (check_vllm_config, main process, before
    any engine process starts) and the backend impl (workers)."""
    if str(dtype) not in ("torch.float32", "float32"):
        raise ValueError(f"kvcert: model dtype {str(dtype).replace('torch.', '')} is not supported: use dtype='float32' "
                         "(vllm serve: --dtype float32; vLLM's default 'auto' picks bfloat16 on CPU, whose cache layouts "
                         "the plugin does not read back)")
    if kv_cache_dtype != "auto":
        raise ValueError(f"kvcert: kv_cache_dtype={kv_cache_dtype!r} is not supported: use kv_cache_dtype='auto' and "
                         f"KVCERT_CODEC={'|'.join(c for c in CODECS if c != 'none')} (the plugin applies the codec itself)")
    if head_size % (2 * cfg.bands):
        raise ValueError(f"kvcert: head size {head_size} is not a multiple of 2 * KVCERT_BANDS = {2 * cfg.bands}")
    if str(attn_type).lower() not in ("decoder", "attentiontype.decoder"):
        raise ValueError(f"kvcert: attention type {attn_type} is not supported (decoder self-attention only)")


def check_vllm_config(cfg, vc):
    """check_engine on a vllm.config.VllmConfig (EngineArgs.create_engine_config's result)."""
    mc = vc.model_config
    check_engine(cfg, dtype=mc.dtype, kv_cache_dtype=vc.cache_config.cache_dtype, head_size=mc.get_head_size())
    backend = getattr(getattr(vc, "attention_config", None), "backend", None)
    if backend is not None and getattr(backend, "name", str(backend)) != "CPU_ATTN":
        raise ValueError(f"kvcert: attention backend {getattr(backend, 'name', backend)} is not supported "
                         "(the plugin wraps CPU_ATTN)")
    kt = vc.kv_transfer_config
    if kt is not None and kt.kv_connector == CONNECTOR:  # it reads the worker's summaries in its own process
        pc = vc.parallel_config
        if pc.world_size > 1 or pc.distributed_executor_backend not in (None, "uni"):
            raise ValueError(f"kvcert: {CONNECTOR} needs the uniprocess executor (one worker in the engine-core "
                             f"process; on CPU: VLLM_ENABLE_V1_MULTIPROCESSING=0, one worker); got world size {pc.world_size}, "
                             f"executor {pc.distributed_executor_backend!r}")


class StartupError(SystemExit):
    """A refused configuration outside make_llm (KVCERT_* environment, vllm serve, vllm.LLM): the process
    stops with this one line on stderr and exit status 1, before any engine process starts (a ValueError
    raised inside vLLM's start-up would come back under vLLM's tracebacks, from every process)."""


def write_page(key, value, kv_cache, slot_mapping, codec, bands, fault=None, fused=True, views=None):
    """Quantize keys and values [n, Hkv, D] (page_codes) into the packed page kv_cache (packed_views; views: those
    views, if the caller has them) at slot_mapping (< 0: skipped), and with bands the witness codes of each exact key
    against exactly the key the page now decodes to (fault, if any: KVCERT_FAULT, applied to the stored key scale: a
    wrong scale). Without a fault, with the extension built (fused): one C++ pass,
    cpu_fused.page_write, the same bytes as the torch code below (tests/test_vllm_page.py checks it)."""
    if fused and codec in PAGE_CODEC and fault is None and cpu_fused.available():
        cpu_fused.page_write(key, value, slot_mapping, kv_cache, PAGE_CODEC[codec], bands)
        return
    ok = slot_mapping >= 0
    slots, k, v = slot_mapping[ok], key[ok].float(), value[ok].float()
    kc, vc, ks, vs, rc = views if views is not None else packed_views(kv_cache, k.shape[-1], 0 if bands is None else len(bands), codec)
    bs = kc.shape[2]
    blk, off = slots // bs, slots % bs
    Hkv = k.shape[1]
    code, scale = page_codes(torch.cat([k, v], 1), codec)  # one quantize call for both: per (token, head) all the same
    kcode, vcode, kscale, vscale = code[:, :Hkv], code[:, Hkv:], scale[:, :Hkv], scale[:, Hkv:]
    if fault is not None:  # a faulty quantizer (demos, tests): a wrong key scale
        kscale = (kscale.float() * fault).to(kscale.dtype)
    kc[blk, :, off], vc[blk, :, off] = kcode, vcode
    ks[blk, :, off], vs[blk, :, off] = kscale.view(ks.dtype), vscale.view(vs.dtype)
    if rc is None:
        return
    stored = page_decode(kcode, kscale.view(ks.dtype), codec)  # what the kernel decodes
    # a non-finite row: the top code (a vacuous witness); its NaN scale makes the read refuse it anyway
    rc[blk, :, off] = cpu_fused.witness_codes(k, stored, bands, nonfinite="top", fine=True)  # [n, Hkv, NB]


_ARANGE = torch.arange(0)


def _positions(a, b):
    """int32 positions a .. b - 1: a view of one shared arange (grown when needed; never written)."""
    global _ARANGE
    if _ARANGE.numel() < b:
        _ARANGE = torch.arange(max(b, 2 * _ARANGE.numel(), 4096), dtype=torch.int32)
    return _ARANGE[a:b]


def _refuse(err):
    if _MAKE_LLM:  # make_llm's callers get a ValueError they can catch
        raise ValueError(str(err)) from None
    raise StartupError(str(err)) from None


_MAKE_LLM = False


# --------------------------------------------------------------------------------------------
# per-process state: the model runner (request ids of the batch) and the certificate records


def _new_summary():
    return {"rows": 0, "reads": 0, "max_bound": 0.0, "max_pre_gate": 0.0, "sum_bound": 0.0, "repairs": 0,
            "repaired_heads": [], "violations": 0, "max_true_tv": 0.0, "tau": None}


class _State:
    """A process's state. Bounded for the life of a server: per-read records only up to KVCERT_RECORDS (the
    oldest dropped first); one summary per request (aggregated as it runs), handed back and dropped by
    generate() (kvcert_summaries), else kept after the request finishes up to KVCERT_MAX_SUMMARIES (the oldest
    dropped first); the gate's per-request state dropped when the request finishes (retire). Drops are counted."""

    def __init__(self):
        self.runner = None
        self.impls = []  # the backend impls of this process (one per layer)
        self.rank = (0, 0)
        self.side_bytes = 0  # bytes of the exact side store (K and V) allocated in this process
        self.vllm_cache_bytes = 0  # vLLM's paged cache of the certified layers
        self.kvcert_bytes = 0  # every side tensor of kvcert: witness and exact store
        self.memory = {}  # _kv_budget: vLLM's budget, its share, the RSS before the caches were allocated
        self.repaired = {}  # request -> {layer: bool [Hkv]}: the gate's state while the request runs
        self.pending = []  # kernel reads of this step whose certificates are not computed yet (see flush)
        self.pending_layers = set()
        self._step_md, self._step = None, None
        self.rows_of = None  # (metadata, fused, KVCertImpl._rows' result) of the step
        self.clear()

    def clear(self):
        """Drop the records and the summaries (the gate's state of running requests stays)."""
        self.records = deque()  # one dict per (forward, request, layer): numpy arrays
        self.records_dropped = 0
        self.summary = {}  # running (or not yet retired) request -> summary
        self.finished = OrderedDict()  # finished request -> summary, oldest first
        self.summaries_dropped = 0

    def record(self, rec):
        cap = config().records
        if len(self.records) >= cap:
            self.records_dropped += 1
            if cap == 0:
                return
            self.records.popleft()
        self.records.append(rec)

    def summary_of(self, rid):
        s = self.summary.get(rid)
        if s is None:
            s = self.summary[rid] = self.finished.pop(rid, None) or _new_summary()
        return s

    def retire(self):
        """Requests the model runner no longer holds have finished: their summaries move to `finished`
        (bounded), their gate state is dropped."""
        live = getattr(self.runner, "requests", None)
        if live is None:
            return
        for rid in [r for r in self.summary if r not in live]:
            self.finished[rid] = self.summary.pop(rid)
        for rid in [r for r in self.repaired if r not in live]:
            del self.repaired[rid]
        cap = config().max_summaries
        while len(self.finished) > cap:
            self.finished.popitem(last=False)
            self.summaries_dropped += 1

    def hand_back(self, ids):
        """Pop the summaries of these requests (external ids: RequestOutput.request_id), gate state too."""
        ids, out = set(ids), {}
        for d in (self.summary, self.finished):
            for rid in [r for r in d if external_id(r) in ids]:
                out[rid] = d.pop(rid)
        for rid in [r for r in self.repaired if external_id(r) in ids]:
            del self.repaired[rid]
        return out

    def tau_of(self, rid, cfg, s):
        """The gate threshold of request rid: its kvcert_tau, else the server's. A value that reaches the
        worker unchecked (KVCertRequestArgs not loaded) and is bad is served at tau 0 (every head with a
        nonzero bound repaired: stricter, never looser) and named in the summary (tau_error)."""
        req = (getattr(self.runner, "requests", None) or {}).get(rid)
        extra = getattr(getattr(req, "sampling_params", None), "extra_args", None)
        try:
            tau = request_tau(extra, cfg)
        except ValueError as e:
            s["tau_error"] = str(e)
            tau = 0.0
        return cfg.gate.tau if tau is None else tau

    def step_of(self, md):
        """(query_start_loc, seq_lens as lists, request ids) of a step's attention metadata: computed at the first
        layer that reads it, then reused by the step's other layers (the same metadata object; the object is held
        here, so a later step's metadata is never mistaken for it)."""
        if self._step_md is not md:
            seq = md.seq_lens.tolist()
            self._step_md, self._step = md, (md.query_start_loc.tolist(), seq, self.req_ids(len(seq)))
        return self._step

    def req_ids(self, n):
        runner = self.runner
        if runner is None:
            return [f"batch{i}" for i in range(n)]
        ids = list(runner.input_batch.req_ids[:n])
        return ids if len(ids) == n else [f"batch{i}" for i in range(n)]


STATE = _State()
CONFIG = None


def config():
    global CONFIG
    if CONFIG is None:
        CONFIG = Config()
    return CONFIG


def _ranks():
    try:
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank
        return get_tensor_model_parallel_rank(), get_pp_group().rank_in_group
    except Exception:  # no distributed group (unit use)
        return 0, 0


def _layer_index(layer):
    m = re.search(r"layers\.(\d+)\.", getattr(layer, "layer_name", "") or "")
    return int(m.group(1)) if m else -1


# --------------------------------------------------------------------------------------------
# the backend


def _backend_classes():
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

    class KVCertImpl(CPUAttentionBackendImpl):
        def __init__(self, num_heads, head_size, scale, num_kv_heads, *args, **kwargs):
            super().__init__(num_heads, head_size, scale, num_kv_heads, *args, **kwargs)
            from vllm.config import get_current_vllm_config
            cfg = config()
            vcfg = get_current_vllm_config()
            check_engine(cfg, dtype=vcfg.model_config.dtype, kv_cache_dtype=self.kv_cache_dtype,
                         head_size=head_size, attn_type=self.attn_type)
            if self.sinks is not None or self.alibi_slopes is not None or self.logits_soft_cap:
                raise ValueError("kvcert: attention sinks, ALiBi and logit soft-capping are not supported")
            if self.sliding_window not in (None, -1):
                raise ValueError(f"kvcert: sliding-window attention (window {self.sliding_window}) is not supported")
            self.cfg = cfg
            self.packed = cfg.packed
            self.band_idx = rope_bands(head_size, cfg.bands)
            self.kv_ref = None
            self.ready = False
            self.rho = None  # [num_blocks, Hkv, bs, NB] fp32: the witness of each cache slot
            self.exact_k = self.exact_v = None  # [num_blocks, Hkv, bs, D] fp32 (gate / shadow)
            STATE.impls.append(self)

        # cache layout of the VEC (fp32) kernels, measured: per (block, KV head) the key half holds
        # K transposed [D, bs], the value half V as [bs, D] (the test reads them back bit for bit)
        def _views(self, kv_cache):
            got = getattr(self, "_view_of", None)
            if got is not None and got[0] is kv_cache:  # a layer's cache tensor lives as long as the engine
                return got[1]
            nb, hkv, bs, _ = kv_cache.shape
            D = self.head_size
            halves = kv_cache.view(nb, hkv, 2, bs * D)
            self._view_of = (kv_cache, (halves[:, :, 0].view(nb, hkv, D, bs), halves[:, :, 1].view(nb, hkv, bs, D)))
            return self._view_of[1]

        def _packed(self, kv_cache):
            """(kc, vc, ks, vs, rho) views of the packed page (packed_views); memoized per cache tensor."""
            got = getattr(self, "_packed_of", None)
            if got is not None and got[0] is kv_cache:
                return got[1]
            self._packed_of = (kv_cache, packed_views(kv_cache, self.head_size, self.cfg.bands if self.cfg.certify else 0,
                                                      self.cfg.codec))
            return self._packed_of[1]

        def _stored(self, kv_cache, blocks, N):
            """(k, v) [Hkv, N, D] fp32 as the cache holds them (decoded when packed) for one request's blocks."""
            if self.packed:
                kc, vc, ks, vs, _ = self._packed(kv_cache)
                dec = lambda c, sc: page_decode(self._gather(c, blocks, N), self._gather(sc, blocks, N), self.cfg.codec)
                return dec(kc, ks), dec(vc, vs)
            kt, vv = self._views(kv_cache)
            k = kt[blocks].permute(1, 0, 3, 2).reshape(self.num_kv_heads, -1, self.head_size)[:, :N]
            return k, self._gather(vv, blocks, N)

        def _witness_of(self, kv_cache, blocks, N):
            """The witness [Hkv, N, NB] fp32 of one request's blocks."""
            if self.packed:
                return unpack_witness(self._gather(self._packed(kv_cache)[4], blocks, N), fine=True)
            return self._gather(self.rho, blocks, N)

        def _write_packed(self, key, value, kv_cache, slot_mapping):
            write_page(key, value, kv_cache, slot_mapping, self.cfg.codec, self.band_idx if self.cfg.certify else None,
                       self.cfg.fault, views=self._packed(kv_cache))

        def _lidx(self, layer):
            if getattr(self, "_layer_idx", None) is None:
                self._layer_idx = _layer_index(layer)  # one impl per layer
            return self._layer_idx

        def _alloc(self, kv_cache, layer):
            if getattr(layer, "isa", "vec") != "vec":
                raise ValueError(f"kvcert: CPU attention ISA {layer.isa!r} is not supported (needs 'vec': fp32, "
                                 "block size a multiple of 32)")
            nb, hkv, bs, _ = kv_cache.shape
            self.ready = True
            if not self.packed:  # packed: the witness is in vLLM's page
                self.rho = torch.zeros(nb, hkv, bs, self.cfg.bands, dtype=torch.float32)
                STATE.kvcert_bytes += self.rho.numel() * 4
            STATE.vllm_cache_bytes += kv_cache.numel() * kv_cache.element_size()
            if self.cfg.exact_store:
                self.exact_k = torch.zeros(nb, hkv, bs, self.head_size, dtype=torch.float32)
                self.exact_v = torch.zeros_like(self.exact_k)
                STATE.side_bytes += 2 * self.exact_k.numel() * 4
                STATE.kvcert_bytes += 2 * self.exact_k.numel() * 4
            STATE.rank = _ranks()

        def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
            if self.attn_type != AttentionType.DECODER:
                return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
            if STATE.pending_layers and self._lidx(layer) in STATE.pending_layers:
                flush()  # a new step reached a layer still pending (e.g. other engines' layers in this process): certify
                #          the last step's reads before this write can reuse a slot they read
            n = slot_mapping.shape[0]
            key, value = key[:n], value[:n]  # [n, Hkv, D]
            codec = self.cfg.codec
            if self.packed:  # codes, scales and witness into vLLM's own page
                if not self.ready:
                    self._alloc(kv_cache, layer)
                self.kv_ref = kv_cache
                self._write_packed(key, value, kv_cache, slot_mapping)
                if self.exact_k is not None:
                    ok = slot_mapping >= 0
                    bs = kv_cache.shape[2]
                    blk, off = slot_mapping[ok] // bs, slot_mapping[ok] % bs
                    self.exact_k[blk, :, off] = key[ok].float()
                    self.exact_v[blk, :, off] = value[ok].float()
                return
            if codec != "none":  # vLLM's fp8 cast (the core's rtz codec), stored decoded in the fp32 cache
                kq, vq = _cast(key, codec), _cast(value, codec)
            else:
                kq, vq = key, value
            if self.cfg.fault is not None:  # KVCERT_FAULT: a faulty quantizer (demos, tests)
                kq = kq * self.cfg.fault
            super().do_kv_cache_update(layer, kq, vq, kv_cache, slot_mapping)
            if not self.cfg.certify:
                return
            if not self.ready:
                self._alloc(kv_cache, layer)
            self.kv_ref = kv_cache
            kt, _ = self._views(kv_cache)
            if cpu_fused.available():  # the witness of each written slot, from the key vLLM stored (read back in place)
                cpu_fused.paged_witness(key.float(), kt, slot_mapping, self.rho, self.band_idx)
                if self.exact_k is None:
                    return
            ok = slot_mapping >= 0
            slots, key, value = slot_mapping[ok], key[ok], value[ok]
            bs = kv_cache.shape[2]
            blk, off = slots // bs, slots % bs
            if not cpu_fused.available():  # the same witness in torch
                stored = kt[blk, :, :, off]  # [n, Hkv, D]: what vLLM stored, read back
                rho = witness(key.float().permute(1, 0, 2)[None], stored.permute(1, 0, 2)[None], self.band_idx,
                              backend="torch")  # [1, Hkv, n, NB]
                rho = torch.where((rho > 0) & (rho < cpu_fused.RHO_MIN), cpu_fused.RHO_MIN, rho)  # rounded up: still a witness
                self.rho[blk, :, off] = rho[0].permute(1, 0, 2)
            if self.exact_k is not None:
                self.exact_k[blk, :, off] = key.float()
                self.exact_v[blk, :, off] = value.float()

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
            plain = attn_metadata is None or not self.cfg.certify or self.attn_type != AttentionType.DECODER
            if plain and not (self.packed and attn_metadata is not None):  # vLLM cannot read the packed page
                return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
            if not attn_metadata.causal or getattr(attn_metadata, "dynamic_causal", None) is not None:
                raise ValueError("kvcert: only causal decoder attention is certified (the batch's metadata is not causal)")
            if not self.ready:
                self._alloc(kv_cache, layer)
            if not self.cfg.certify:  # packed, KVCERT_CERTIFY=0: the same codes read without certificates
                self._serve_uncertified(query, kv_cache, attn_metadata, output)
                return output
            vllm_out = None
            if self.cfg.shadow and not self.packed:  # vLLM's own kernel too, to compare with what is served
                super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
                n = attn_metadata.num_actual_tokens
                vllm_out = output[:n].view(n, self.num_heads, self.head_size).float().clone()
            self._certify(layer, query, kv_cache, attn_metadata, output, vllm_out)
            return output

        def _read(self, q, kv_cache, table, N, pos, out=None):
            """One request's rows q [T, H, D] at positions pos over its N cached tokens (blocks table [1, >=
            ceil(N / bs)] int32): the fused C++ read in place from the paged cache (cpu_fused.paged_seg: the
            kernel flags NaN/Inf; every row reads keys 0..pos) -> (out [1, T, H, D], kernel stats, histogram or None,
            None), the certificate epilogue left to the caller; else the torch twin over the gathered keys (same
            contract) -> (out, None, None, cert). The output is what the plugin serves."""
            if self._fused():
                return (*self._kernel(q[None], kv_cache, table, N, pos.view(1, -1), out, True), None)
            out, _, cert = self._twin(q, kv_cache, table, N, pos, box_form=self.cfg.box)
            return out, None, None, cert

        def _fused(self):
            return cpu_fused.available()

        def _kernel(self, q, kv_cache, table, N, qpos, out, certify, lens=None):
            """The fused C++ read in place from the paged cache (fp32 rows, or the packed page) -> (out, stats, hist):
            stats [B, T, H, 5], hist [B, T, H, 3 HIST_M] (the box form's histogram of c, KVCERT_BOX) or None:
            q [B, T, H, D], qpos [B, T] int32, table [B, >= ceil(N / bs)]; lens int32 [B] (each sequence's own
            token count, N their largest) or None (every sequence N tokens)."""
            if getattr(self, "_bands64", None) is None:
                with torch.inference_mode(False):  # a normal tensor (the worker runs in inference mode): _run keeps
                    self._bands64 = self.band_idx.to(torch.int64).contiguous()  # its checks while its version holds
            table = table.to(torch.int32)
            got = getattr(self, "_base_of", None)  # the cache tensors' checks once per cache tensor (paged_base)
            if got is None or got[0] is not kv_cache or got[1] != certify:
                if self.packed:
                    kc, vc, ks, vs, rc = self._packed(kv_cache)
                    f8 = cpu_fused.Fp8Read(torch.float8_e4m3fn) if self.cfg.codec == "fp8_per_token_head" else None
                    base = cpu_fused.paged_base(k=kc, v=vc, k_scales=ks, v_scales=vs, rho=rc if certify else None,
                                                k_transposed=False, fp8=f8, int4=self.cfg.codec == "int4_per_token_head")
                else:
                    kt, vv = self._views(kv_cache)
                    base = cpu_fused.paged_base(k=kt, v=vv, rho=self.rho, k_transposed=True)
                self._base_of = got = (kv_cache, certify, base)
            segs = self.__dict__.setdefault("_segs", {})  # one segment dict per batch size (its checks kept in it)
            s0 = segs[table.shape[0]] = cpu_fused.paged_seg(N, table=table, base=got[2], reuse=segs.get(table.shape[0]),
                                                            lens=lens)
            lut = log_table32(fine=True) if self.packed and certify else None
            hist = None
            if certify and self.cfg.box:  # the box form's histogram of c (_finish: hist_box)
                hist = torch.empty(*q.shape[:3], 3 * HIST_M, dtype=torch.float64)
            args = (q.contiguous(), qpos, [s0, self._empty_seg()], self.scale, self._bands64, 1, 1)
            if hist is not None:  # a long prefill read in blocks of rows (cpu_fused.hist_run: bounded scratch, same bits)
                out, stats = cpu_fused.hist_run(*args, lut=lut, out=out, hist=hist)
            else:
                out, stats = cpu_fused._run(*args, certify, lut=lut, out=out)
            return out, stats, hist

        def _decode_batch(self, dec, q_all, out_all, kv_cache, md, certify):
            """The decode rows (one token each) of several requests (dec: _rows') in one kernel call (paged_seg(lens=...):
            each request reads its own N tokens only, in its own chunks: bit for bit its own read), served into out_all
            -> (q [B, 1, H, D], table [B, w], stats [B, 1, H, 5] or None, hist (_kernel), out [B, 1, H, D])."""
            rows, tok, bi, lens, qpos = dec
            q = q_all.index_select(0, tok)[:, None]
            table = md.block_table.index_select(0, bi).to(torch.int32)
            out, stats, hist = self._kernel(q, kv_cache, table, max(r[2] for r in rows), qpos, None, certify, lens=lens)
            out_all.index_copy_(0, tok, out[:, 0].to(out_all.dtype))
            return q, table, stats, hist, out

        def _rows(self, md):
            """This step's requests with rows: [(b, t0, t1, N)], and the decode ones (T = 1), read in one call when
            there are at least two and the fused read serves: ([(b, token index, N)], their token indices, batch
            indices, lens int32, qpos int32 [B, 1]), else None. Once per step (the layers share it)."""
            got = STATE.rows_of
            if got is not None and got[0] is md and got[1] == self._fused():
                return got[2]
            qsl, seq, _ = STATE.step_of(md)
            rows = [(b, qsl[b], qsl[b + 1], seq[b]) for b in range(len(seq)) if qsl[b + 1] > qsl[b] and seq[b] > 0]
            dec = [(b, t0, N) for b, t0, t1, N in rows if t1 - t0 == 1] if self._fused() else []
            if len(dec) >= 2:
                with torch.inference_mode(False):  # normal tensors: paged_seg keeps the lens check while its version holds
                    lens = torch.tensor([r[2] for r in dec], dtype=torch.int32)
                    dec = (dec, torch.tensor([r[1] for r in dec]), torch.tensor([r[0] for r in dec]), lens, (lens - 1).view(-1, 1))
            else:
                dec = None
            STATE.rows_of = (md, self._fused(), (rows, dec))
            return rows, dec

        def _serve_uncertified(self, query, kv_cache, md, output):
            """The packed page read by the fused kernel without certificates (KVCERT_CERTIFY=0: the speed
            baseline of the same codes); every request's rows written into vLLM's output."""
            H, D = self.num_heads, self.head_size
            n = md.num_actual_tokens
            q_all, out_all = query[:n].view(n, H, D).float(), output[:n].view(n, H, D)
            rows, dec = self._rows(md)
            if dec:
                self._decode_batch(dec, q_all, out_all, kv_cache, md, False)
            for b, t0, t1, N in rows:
                if dec and t1 - t0 == 1:
                    continue
                pos = _positions(N - (t1 - t0), N)
                out, _, _ = self._kernel(q_all[None, t0:t1], kv_cache, md.block_table[b:b + 1], N, pos.view(1, -1), None, False)
                out_all[t0:t1] = out[0].to(out_all.dtype)

        def _empty_seg(self):
            if getattr(self, "_seg_none", None) is None:
                self._seg_none = cpu_fused.seg(self.num_kv_heads, 0)
            return self._seg_none

        def _twin(self, q, kv_cache, table, N, pos, served_by_kernel=False, box_form=False):
            """(out, None, cert) by the torch twin over the gathered blocks. served_by_kernel: the fused
            read's output was served, not this one: the certificate covers its logits too (with_other_logits).
            box_form: the box form (spec T9) in the certificate's min (KVCERT_BOX)."""
            bs = kv_cache.shape[2]
            blocks = table[0, :(N + bs - 1) // bs].long()
            k, v = self._stored(kv_cache, blocks, N)  # [Hkv, N, D] as stored
            rho = self._witness_of(kv_cache, blocks, N)
            out, cert = attention_rows(q[None], k[None], v[None], rho[None], self.scale, bands=self.band_idx, q_pos=pos[None],
                                       backend="torch", box_form=box_form)
            if served_by_kernel:  # q: [T, H, D] -> e [1, H] over the rows
                cert = with_other_logits(cert, logit_rounding(q.abs().amax(0)[None], k[None].abs().amax(2).double(), self.scale))
            return out, None, cert

        def _gather(self, t, blocks, N):
            """[num_blocks, Hkv, bs, X] side tensor -> [Hkv, N, X] for one request's blocks."""
            g = t[blocks]  # [nblk, Hkv, bs, X]
            return g.permute(1, 0, 2, 3).reshape(g.shape[1], -1, g.shape[3])[:, :N]

        def _certify(self, layer, query, kv_cache, md, output, vllm_out):
            """Read and serve every request's rows of this layer; the certificates of the reads (one epilogue
            for all of them) right away when a gate or the shadow needs them now, else once per step for all
            the layers of this rank (STATE.pending, flushed after the last layer and by collect)."""
            H, D = self.num_heads, self.head_size
            if STATE.impls and STATE.impls[0] is self:  # once per step: drop what finished requests left
                STATE.retire()
            n = md.num_actual_tokens
            _, _, ids = STATE.step_of(md)
            lidx = self._lidx(layer)
            q_all = query[:n].view(n, H, D).float()
            out_all = output[:n].view(n, H, D)
            direct = out_all.dtype == torch.float32 and out_all.is_contiguous() and self._fused()
            now = self.exact_k is not None  # gate or shadow: the bound decides what is served / is checked now
            entries = []
            rows, dec = self._rows(md)
            if dec:  # the decode rows of all requests in one call; one entry for them (a read of its own each)
                q, table, stats, hist, out = self._decode_batch(dec, q_all, out_all, kv_cache, md, True)
                batch = {"impl": self, "layer": lidx, "batch": [ids[b] for b, _, _ in dec[0]], "Ns": [N for _, _, N in dec[0]],
                         "stats": stats, "hist": hist, "cert": None, "q": q, "table": table, "kv": kv_cache}
                if now or self.cfg.records or self.cfg.trace_dir:  # gate, shadow or records: one entry per request
                    for i, (e, (_, t0, _)) in enumerate(zip(_unbatch(batch), dec[0])):
                        if vllm_out is not None:
                            e["out_diff"] = float((vllm_out[t0:t0 + 1] - out[i]).abs().max())
                        if now:
                            e["out"] = out_all[t0:t0 + 1]
                        entries.append(e)
                else:  # only the requests' summaries: _finish_batch
                    entries.append(batch)
            for b, t0, t1, N in rows:
                T = t1 - t0
                if dec and T == 1:
                    continue
                pos = _positions(N - T, N)
                q = q_all[t0:t1]  # [T, H, D]
                table = md.block_table[b:b + 1]
                into = out_all[t0:t1].view(1, T, H, D) if direct else None  # served: the certified read
                out, stats, hist, cert = self._read(q, kv_cache, table, N, pos, out=into)
                if into is None:
                    out_all[t0:t1] = out[0].to(out_all.dtype)
                e = {"impl": self, "request": ids[b], "layer": lidx, "N": N, "T": T, "pos": pos, "stats": stats, "hist": hist,
                     "cert": cert,
                     "q": q if now else q.clone(), "table": table if now else table.clone(), "kv": kv_cache}
                if vllm_out is not None:  # vLLM's own kernel vs the certified read served, same cache
                    e["out_diff"] = float((vllm_out[t0:t1] - out[0]).abs().max())
                if now:
                    e["out"] = out_all[t0:t1]
                entries.append(e)
            if now:
                _finish(entries)
                return
            STATE.pending += entries
            STATE.pending_layers.add(lidx)
            if len(STATE.pending_layers) >= len(STATE.impls):  # the step's last layer on this rank
                flush()

        def _finish_one(self, e, bound):
            """Gate, shadow, summary and record of one request's read; bound [T, H] fp32 (the certificate's min)."""
            cfg, H, D, Hkv = self.cfg, self.num_heads, self.head_size, self.num_kv_heads
            G = H // Hkv
            T, N, pos, q, lidx = e["T"], e["N"], e["pos"], e["q"], e["layer"]
            tp_rank, pp_rank = STATE.rank
            reps = STATE.repaired.setdefault(e["request"], {})
            rep = reps.get(lidx)
            if rep is None:
                rep = reps[lidx] = torch.zeros(Hkv, dtype=torch.bool)
            fresh = []
            s = STATE.summary_of(e["request"])
            if cfg.gate.kind == "certified":
                s["tau"] = tau = STATE.tau_of(e["request"], cfg, s)
                over = bound.view(T, Hkv, G).amax(dim=(0, 2)) > tau
                fresh = (over & ~rep).nonzero().flatten().tolist()
                rep |= over
            served = bound.clone() if self.exact_k is not None else bound  # only the gate's repairs change it
            true_tv = None
            if self.exact_k is not None:
                bs = e["kv"].shape[2]
                blocks = e["table"][0, :(N + bs - 1) // bs].long()
                ek, ev = self._gather(self.exact_k, blocks, N), self._gather(self.exact_v, blocks, N)
                if bool(rep.any()):  # the gate: these heads read the exact side store from now on
                    heads = rep.repeat_interleave(G)
                    exact_out = _attend(q, ek, ev, pos, self.scale)  # [T, H, D]
                    e["out"][:, heads] = exact_out[:, heads].to(e["out"].dtype)
                    served[:, heads] = 0.0
                if cfg.shadow:
                    k, _ = self._stored(e["kv"], blocks, N)  # [Hkv, N, D] as stored
                    true_tv = _true_tv(q, ek, k, pos, self.scale, rep)  # [T, H]
            s["rows"] += T
            s["reads"] += T * H
            tops = e.get("top_sum")
            top, total = (max(tops[0]), sum(tops[1])) if tops else (float(bound.max()), float(bound.sum()))
            if served is not bound:  # the gate's repairs: the served bounds
                total = float(served.sum())
            s["max_bound"] = max(s["max_bound"], top if served is bound else float(served.max()))
            s["max_pre_gate"] = max(s["max_pre_gate"], top)
            s["sum_bound"] += total
            s["repairs"] += len(fresh)
            s["repaired_heads"] += [[lidx, tp_rank * Hkv + h] for h in fresh]
            if true_tv is not None:
                s["violations"] += int((true_tv > served).sum())
                s["max_true_tv"] = max(s["max_true_tv"], float(true_tv.max()))
            if cfg.records == 0 and not cfg.trace_dir:  # nobody keeps the record: counted as dropped, not built
                STATE.records_dropped += 1
            else:
                rec = {"request": e["request"], "layer": lidx, "tp_rank": tp_rank, "pp_rank": pp_rank,
                       "head_offset": tp_rank * H, "pos": pos.numpy(), "bound": bound.numpy(),
                       "served": served.numpy(), "repaired": rep.numpy().copy()}
                if "out_diff" in e:
                    rec["out_diff"] = e["out_diff"]
                if true_tv is not None:
                    rec["true_tv"] = true_tv.numpy()
                STATE.record(rec)
                if cfg.trace_dir:
                    _trace(rec)
            m = _metrics()
            if m is not None:
                m["reads"].inc(T * H)
                m["repairs"].inc(len(fresh))
                m["bound"].observe(float(served.max()))

        def _finish_batch(self, e):
            """The summaries of a batch entry's requests, one decode row each (no gate, shadow or record:
            _certify's lean case), as _finish_one would leave them."""
            m, H = _metrics(), self.num_heads
            for rid, top, total in zip(e["batch"], *e["top_sum"]):
                STATE.repaired.setdefault(rid, {})
                s = STATE.summary_of(rid)
                s["rows"] += 1
                s["reads"] += H
                s["max_bound"] = max(s["max_bound"], top)
                s["max_pre_gate"] = max(s["max_pre_gate"], top)
                s["sum_bound"] += total
                if m is not None:
                    m["reads"].inc(H)
                    m["bound"].observe(top)
            STATE.records_dropped += len(e["batch"])

    class KVCertBackend(CPUAttentionBackend):
        @staticmethod
        def get_impl_cls():
            return KVCertImpl

        @classmethod
        def customize_spec(cls, spec):
            """vLLM's documented hook for a backend's own page packing: with a packed codec (PACKED) each (slot, KV head)
            holds packed_row_bytes (codes, scales, witness) instead of K and V at fp32, so vLLM's block
            count, capacity and memory accounting see the compressed bytes."""
            spec = super().customize_spec(spec)
            cfg = config()
            if not (cfg.enabled and cfg.packed) or spec.state_content_bytes is not None:
                return spec
            from dataclasses import replace
            return replace(spec, state_content_bytes=packed_row_bytes(spec.head_size, cfg.bands, cfg.certify, cfg.codec))

    return KVCertBackend, KVCertImpl


def _unbatch(e):
    """A batch entry (_certify: the decode rows of several requests, one each) -> one entry per request."""
    return [{"impl": e["impl"], "request": rid, "layer": e["layer"], "N": N, "T": 1, "pos": _positions(N - 1, N),
             "stats": e["stats"][i:i + 1], "hist": None if e["hist"] is None else e["hist"][i:i + 1], "cert": None,
             "q": e["q"][i], "table": e["table"][i:i + 1], "kv": e["kv"]}
            for i, (rid, N) in enumerate(zip(e["batch"], e["Ns"]))]


def _finish(entries):
    """Certificates of the kernel reads in entries (one epilogue, cpu_fused._certificate, for all their rows
    with N = the largest N among them: every margin grows with N, so each row's certificate stays an upper
    bound), then each entry's gate / shadow / summary / record. Rows the epilogue refuses in fp32 (a large
    witness) are redone by the twin, entry by entry."""
    pend = [e for e in entries if e["cert"] is None]
    if pend:
        impl = pend[0]["impl"]
        H, D, NB = impl.num_heads, impl.head_size, impl._bands64.shape[0]
        stats = torch.cat([e["stats"].reshape(-1, 1, H, 5) for e in pend])
        N = max(max(e["Ns"]) if "batch" in e else e["N"] for e in pend)
        cert = cpu_fused._certificate(stats, NB, N, D)
        if cert is not None and impl.cfg.box:  # the box over each row's histogram of c (spec T9c)
            hist = torch.cat([e["hist"].reshape(-1, 1, H, e["hist"].shape[-1]) for e in pend])
            cert = hist_box(cert, hist, stats, NB, N, D, above=impl.cfg.box_above)
        if cert is not None:
            bound, i = cert["min"][:, 0], 0
            tops, sums = bound.amax(1).tolist(), bound.sum(1).tolist()  # per row, for the summaries
            for e in pend:
                n = e["stats"].shape[0] * e["stats"].shape[1]  # rows: a request's T, or a batch's requests
                e["bound"] = bound[i:i + n]
                e["top_sum"] = (tops[i:i + n], sums[i:i + n])
                i += n
    for e in entries:
        if "batch" in e:
            if "bound" in e:
                e["impl"]._finish_batch(e)
                continue
            _finish(_unbatch(e))  # the epilogue refused some row: each request's read on its own, as below
            continue
        if "bound" not in e:
            cert = e["cert"]
            if cert is None:
                impl, st = e["impl"], e["stats"]
                NB, D = impl._bands64.shape[0], impl.head_size
                cert = cpu_fused._certificate(st, NB, e["N"], D)
                if cert is not None and impl.cfg.box:
                    cert = hist_box(cert, e["hist"], st, NB, e["N"], D, above=impl.cfg.box_above)
            if cert is None:  # the kernel's output was served: the twin's certificate + its logits' distance
                impl = e["impl"]
                cert = impl._twin(e["q"], e["kv"], e["table"], e["N"], e["pos"], served_by_kernel=True, box_form=impl.cfg.box)[2]
            e["bound"] = cert["min"][0]
        e["impl"]._finish_one(e, e["bound"])


METRICS = None


def _metrics():
    """Prometheus counters of this process, only in prometheus_client's multiprocess mode
    (PROMETHEUS_MULTIPROC_DIR set before vLLM starts; vLLM sets it itself with --api-server-count > 1): the
    API server's /metrics (get_prometheus_registry, v1/metrics/prometheus.py) then collects them from the
    engine-core process through the directory. None otherwise (the counters would not reach /metrics)."""
    global METRICS
    if METRICS is False:  # looked once: not in multiprocess mode (vLLM sets the variable before its engine starts)
        return None
    if METRICS is None and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        METRICS = False
        return None
    if METRICS is None:
        from prometheus_client import Counter, Histogram
        METRICS = {"reads": Counter("kvcert_certified_reads", "certified (row, query head) reads of the KV cache"),
                   "repairs": Counter("kvcert_repairs", "(request, layer, KV head) served from the exact store by the gate"),
                   "bound": Histogram("kvcert_bound", "largest certified TV bound (as served) of one (request, layer) read",
                                      buckets=(1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.05, 0.1, 0.2, 0.5, 1.0))}
    return METRICS


def flush():
    """Certify the reads left pending (gate none, no shadow: once per step, after the last layer)."""
    pend, STATE.pending = STATE.pending, []
    STATE.pending_layers = set()
    if pend:
        _finish(pend)


def _cast(x, codec):
    """x [n, Hkv, D] -> the values the cache holds. fp8: vLLM's CPU fp8 cast and read-back (scale 1, vLLM's
    default): fast.core.quant's round-toward-zero codec; fast.integrations.vllm_fp8 is the independent model it
    is tested against. int8: fast.core.quant's int8 with one fp16 scale per (token, KV head) (group = D), as
    vLLM's int8_per_token_head (GPU backends) keeps one scale per token and head; int4_per_token_head: its int4 with
    one fp16 scale per (token, KV head); fp8_per_token_head: its fp8_e4m3 (round to nearest) with one fp32 scale per
    (token, KV head)."""
    if codec in PACKED:  # what the packed page decodes to; a (token, head) with NaN/Inf stays non-finite (NaN scale)
        codes, scales = page_codes(x, codec)
        return page_decode(codes, scales if codec == "fp8_per_token_head" else scales.view(torch.int16), codec)
    return dequantize(quantize(x.float()[None], codec + "_rtz"))[0]


def _attend(q, k, v, pos, scale):
    """Plain causal attention in fp64 (GQA): q [T, H, D] at positions pos over k, v [Hkv, N, D]."""
    T, H, D = q.shape
    Hkv, N = k.shape[0], k.shape[1]
    x = torch.einsum("tkgd,knd->tkgn", q.double().view(T, Hkv, H // Hkv, D), k.double()) * scale
    x = x.masked_fill(torch.arange(N)[None, None, None] > pos[:, None, None, None], float("-inf"))
    return torch.einsum("tkgn,knd->tkgd", torch.softmax(x, -1), v.double()).reshape(T, H, D)


def _true_tv(q, k_exact, k_served, pos, scale, repaired):
    """TV [T, H] between exact-key and served-key attention weights, fp64 (0 for repaired heads)."""
    T, H, D = q.shape
    Hkv, N = k_exact.shape[0], k_exact.shape[1]
    mask = torch.arange(N)[None, None, None] > pos[:, None, None, None]

    def probs(k):
        x = torch.einsum("tkgd,knd->tkgn", q.double().view(T, Hkv, H // Hkv, D), k.double()) * scale
        return torch.softmax(x.masked_fill(mask, float("-inf")), -1)

    tv = (0.5 * (probs(k_exact) - probs(k_served)).abs().sum(-1)).reshape(T, H).float()
    return tv.masked_fill(repaired.repeat_interleave(H // Hkv)[None], 0.0)


def _plain(rec):
    """numpy arrays -> nested lists (vLLM's RPC serializer would ship them as raw buffers)."""
    return {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in rec.items()}


def _trace(rec):
    d = config().trace_dir
    os.makedirs(d, exist_ok=True)
    tp, pp = STATE.rank
    row = _plain(rec)
    with open(os.path.join(d, f"kvcert-tp{tp}-pp{pp}.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


# --------------------------------------------------------------------------------------------
# plugin entry point, worker extension, user helpers


def register():
    """vllm.general_plugins entry point: a no-op unless KVCERT_VLLM=1. vLLM calls it in its main process
    (EngineArgs, `vllm serve`'s argument parser) before any engine process starts: a bad KVCERT_* setting,
    and (when the engine configuration is built) an unsupported model or cache, stop the process there with
    one line (StartupError). In the workers it installs the backend, names the batch's requests, and puts
    kvcert's side tensors inside vLLM's KV-cache budget (_kv_budget)."""
    try:
        cfg = config()
    except ValueError as e:
        _refuse(e)
    if not cfg.enabled:
        return
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker

    register_backend(AttentionBackendEnum.CPU_ATTN, "fast.integrations.vllm.KVCertBackend")
    if not getattr(CPUModelRunner, "_kvcert_wrapped", False):
        init_kv = CPUModelRunner.initialize_kv_cache

        def initialize_kv_cache(self, *args, **kwargs):  # the runner whose input_batch names the requests
            STATE.runner = self
            return init_kv(self, *args, **kwargs)

        CPUModelRunner.initialize_kv_cache = initialize_kv_cache
        CPUModelRunner._kvcert_wrapped = True
    if not getattr(EngineArgs, "_kvcert_wrapped", False):
        create = EngineArgs.create_engine_config

        def create_engine_config(self, *args, **kwargs):  # main process, before the engine core starts
            vc = create(self, *args, **kwargs)
            if config().enabled:
                try:
                    check_vllm_config(config(), vc)
                except ValueError as e:
                    _refuse(e)
                procs = vc.model_config.logits_processors or []
                if ARGS_PROCESSOR not in procs:  # kvcert_tau checked at admission: HTTP 400, LLM: ValueError
                    vc.model_config.logits_processors = [*procs, ARGS_PROCESSOR]
            return vc

        EngineArgs.create_engine_config = create_engine_config
        EngineArgs._kvcert_wrapped = True
    if not getattr(CPUWorker, "_kvcert_wrapped", False):
        available = CPUWorker.determine_available_memory

        def determine_available_memory(self):  # the KV-cache bytes vLLM divides into blocks
            return _kv_budget(self, available(self))

        CPUWorker.determine_available_memory = determine_available_memory
        CPUWorker._kvcert_wrapped = True


def _rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _kv_budget(worker, budget):
    """vLLM's KV budget (kv_cache_memory_bytes / VLLM_CPU_KVCACHE_SPACE, or what it measured free) covers
    vLLM's cache AND kvcert's side tensors (witness, exact store): vLLM gets the share of its own bytes per
    slot, so blocks * (vLLM's + kvcert's bytes per block) <= budget. The worker's RSS is noted here, before
    either is allocated (kvcert_memory)."""
    cfg = config()
    mc = worker.vllm_config.model_config
    D = mc.get_head_size()
    ours = cfg.side_bytes_per_slot(D)
    theirs = cfg.cache_bytes_per_slot(D, mc.dtype.itemsize)  # per (slot, KV head) in vLLM's cache
    share = budget * theirs // (theirs + ours)
    STATE.memory = {"budget": int(budget), "vllm_share": int(share), "rss_before_kv": _rss()}
    print(f"kvcert: of the KV-cache budget of {budget / 2**30:.3f} GiB, {share / 2**30:.3f} GiB go to vLLM's cache, "
          f"the rest to kvcert's witness{' and exact store' if cfg.exact_store else ''}", file=sys.stderr)
    return int(share)


def __getattr__(name):  # KVCertBackend / KVCertImpl / KVCertConnector are built on first use (vLLM imported lazily)
    if name in ("KVCertBackend", "KVCertImpl"):
        backend, impl = _backend_classes()
        globals().update(KVCertBackend=backend, KVCertImpl=impl)
        return globals()[name]
    if name == "KVCertConnector":
        globals()[name] = _connector_class()
        return globals()[name]
    if name == "KVCertRequestArgs":
        globals()[name] = _args_class()
        return globals()[name]
    raise AttributeError(name)


ARGS_PROCESSOR = f"{__name__}:KVCertRequestArgs"


def _args_class():
    """A logits processor that changes no logit: vLLM calls its validate_params on every request at
    admission (v1 InputProcessor), so a bad kvcert_tau is refused there (HTTP 400 in `vllm serve`, a
    VLLMValidationError from LLM.generate) instead of reaching the worker. The plugin adds it to
    model_config.logits_processors when it builds the engine configuration."""
    from vllm.v1.sample.logits_processor import LogitsProcessor

    class KVCertRequestArgs(LogitsProcessor):
        @classmethod
        def validate_params(cls, sampling_params):
            from vllm.exceptions import VLLMValidationError
            try:
                request_tau(sampling_params.extra_args, config())
            except ValueError as e:
                raise VLLMValidationError(str(e), parameter=TAU_ARG) from None

        def __init__(self, vllm_config, device, is_pin_memory):
            pass

        def apply(self, logits):
            return logits

        def is_argmax_invariant(self):
            return True

        def update_state(self, batch_update):
            pass

    return KVCertRequestArgs


CONNECTOR = "KVCertConnector"
CONNECTOR_CONFIG = json.dumps({"kv_connector": CONNECTOR, "kv_connector_module_path": __name__, "kv_role": "kv_both"})


def _connector_class():
    """A KV connector (vLLM's KVConnectorBase_V1) that transfers nothing: every transfer hook is a no-op.
    Its one use is the scheduler-side request_finished, whose dict vLLM hands back as
    RequestOutput.kv_transfer_params and, in `vllm serve`, as the completion response's
    `kv_transfer_params` field: {"kvcert": the request's summary}.

    It reads the worker's summaries in its own process: only with the uniprocess executor, where the
    scheduler and the one worker share the engine-core process (check_vllm_config refuses any other
    executor at start-up). vLLM calls request_finished in update_from_output, after the model output of
    the step that produced the request's last token (v1/core/sched/scheduler.py): the summary covers
    every read the request made, i.e. every token but the last generated one, which is never fed back."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    class KVCertConnector(KVConnectorBase_V1):
        def __init__(self, vllm_config, role, kv_cache_config=None):
            super().__init__(vllm_config, role, kv_cache_config)
            if not config().enabled:
                raise ValueError(f"kvcert: {CONNECTOR} needs the plugin on ({ENV}=1)")

        # worker side: nothing to load or save
        def start_load_kv(self, forward_context, **kwargs):
            pass

        def wait_for_layer_load(self, layer_name):
            pass

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            pass

        def wait_for_save(self):
            pass

        # scheduler side: no external tokens, no metadata
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return 0, False

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            pass

        def build_connector_meta(self, scheduler_output):
            from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
            return KVConnectorMetadata()

        def request_finished(self, request, block_ids):
            """(False: free the blocks now, {"kvcert": this request's summary}); the summary is dropped here."""
            flush()
            rid = request.request_id
            s = STATE.summary.pop(rid, None) or STATE.finished.pop(rid, None)
            STATE.repaired.pop(rid, None)
            if s is None:  # no read was certified (e.g. aborted before its first forward)
                s = _new_summary()
            return False, {"kvcert": summaries([{"summary": {rid: s}}])[external_id(rid)]}

    return KVCertConnector


class KVCertWorker:
    """worker_extension_cls: LLM.collective_rpc("kvcert_collect" / "kvcert_summaries" / "kvcert_memory")."""

    def kvcert_collect(self, clear=True, records=True):
        """This rank's records (the last KVCERT_RECORDS) and the summaries not handed back yet; clear: drop them."""
        if records and config().records == 0:  # collect() says so in one line; nothing is dropped
            return {"rank": list(STATE.rank), "records_cap": 0}
        flush()
        STATE.retire()
        summ = {**STATE.finished, **STATE.summary}
        out = {"rank": list(STATE.rank), "side_bytes": STATE.side_bytes,
               "summary": {k: dict(v) for k, v in summ.items()},
               "records": [_plain(r) for r in STATE.records] if records else [],
               "records_cap": config().records, "records_dropped": STATE.records_dropped,
               "summaries_dropped": STATE.summaries_dropped}
        if clear:
            STATE.clear()
        return out

    def kvcert_summaries(self, ids):
        """Hand back (and drop) the summaries of these requests (RequestOutput.request_id)."""
        flush()
        got = STATE.hand_back(ids)
        STATE.retire()
        return {"rank": list(STATE.rank), "summary": {k: dict(v) for k, v in got.items()}}

    def kvcert_memory(self):
        """vLLM's KV budget and its share (_kv_budget), the bytes of vLLM's cache and of kvcert's side tensors
        allocated, the RSS before the caches and now, and what this process holds for requests."""
        return {**STATE.memory, "rss_now": _rss(), "vllm_cache_bytes": STATE.vllm_cache_bytes,
                "kvcert_bytes": STATE.kvcert_bytes, "records": len(STATE.records),
                "summaries": len(STATE.summary) + len(STATE.finished), "gate_requests": len(STATE.repaired)}

    def kvcert_check_store(self):
        """(slots checked, mismatches): every key and value vLLM holds for a written slot, read back
        from the paged cache, against vllm_fp8.roundtrip of the exact one (needs the exact store)."""
        checked = bad = 0
        for impl in STATE.impls:
            if impl.exact_k is None or impl.kv_ref is None:
                continue
            written = impl.exact_k.abs().amax(-1) > 0  # [nb, Hkv, bs]: slots holding a token
            codec = impl.cfg.codec
            if impl.packed:  # the page decoded against fast.core.quant's codec of the exact key (_cast)
                kc, vc, ks, vs, _ = impl._packed(impl.kv_ref)
                k_st, v_st = page_decode(kc, ks, codec)[written], page_decode(vc, vs, codec)[written]
                model = lambda x: _cast(x.view(-1, 1, x.shape[-1]), codec).view(x.shape)
            else:
                kt, vv = impl._views(impl.kv_ref)
                k_st, v_st = kt.permute(0, 1, 3, 2)[written], vv[written]
                model = (lambda x: x) if codec == "none" else (lambda x: vllm_fp8.roundtrip(x, codec))
            k_mod, v_mod = model(impl.exact_k[written]), model(impl.exact_v[written])
            checked += int(written.sum())
            bad += int(((k_st.view(torch.int32) != k_mod.view(torch.int32)).any(-1)
                        | (v_st.view(torch.int32) != v_mod.view(torch.int32)).any(-1)).sum())
        return checked, bad


def make_llm(model, *, codec="fp8_e4m3", gate="none", shadow=False, certify=True, trace_dir=None, bands=8,
             records=100_000, max_summaries=1024, fault="none", box=False, box_above=0.0, **kwargs):
    """vllm.LLM with the plugin on (sets the KVCERT_* environment the workers inherit) after the
    start-up checks; bad configuration -> ValueError with one line, before any engine starts.
    records: per-read records each worker keeps for collect() (the oldest dropped first; 0: none);
    max_summaries: summaries of finished requests a worker keeps until handed back (generate() does).
    kvcert's side tensors are counted inside vLLM's KV-cache budget (kv_cache_memory_bytes, or what vLLM
    finds free): vLLM's reported KV capacity is what is left for its cache. fault: KVCERT_FAULT.
    box, box_above: KVCERT_BOX, KVCERT_BOX_ABOVE (the box form over the fused read's histogram of c: tighter, slower)."""
    env = {ENV: "1", "KVCERT_CODEC": str(codec), "KVCERT_GATE": str(gate), "KVCERT_SHADOW": "1" if shadow else "0",
           "KVCERT_CERTIFY": "1" if certify else "0", "KVCERT_BANDS": str(bands), "KVCERT_RECORDS": str(records),
           "KVCERT_MAX_SUMMARIES": str(max_summaries), "KVCERT_FAULT": str(fault), "KVCERT_BOX": "1" if box else "0",
           "KVCERT_BOX_ABOVE": str(box_above)}
    if trace_dir:
        env["KVCERT_TRACE_DIR"] = str(trace_dir)
    else:  # a trace_dir of an earlier make_llm in this process must not reach this engine's workers
        os.environ.pop("KVCERT_TRACE_DIR", None)
    names = {"KVCERT_CODEC": "codec", "KVCERT_GATE": "gate", "KVCERT_BANDS": "bands", "KVCERT_RECORDS": "records",
             "KVCERT_MAX_SUMMARIES": "max_summaries", "KVCERT_FAULT": "fault", "KVCERT_BOX": "box",
             "KVCERT_BOX_ABOVE": "box_above"}
    cfg = Config({**{k: v for k, v in os.environ.items() if k.startswith("KVCERT_")}, **env}, names=names)
    backend = kwargs.get("attention_backend")
    if backend not in (None, "CPU_ATTN"):
        raise ValueError(f"kvcert: attention_backend={backend!r} is not supported (the plugin wraps CPU_ATTN)")
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("kv_cache_dtype", "auto")
    if kwargs["dtype"] not in ("float32", torch.float32):
        check_engine(cfg, dtype=kwargs["dtype"], kv_cache_dtype="auto", head_size=2 * bands)
    check_engine(cfg, dtype="float32", kv_cache_dtype=kwargs["kv_cache_dtype"], head_size=_head_size(model))
    os.environ.update(env)
    global CONFIG, _MAKE_LLM
    CONFIG = cfg
    kwargs.setdefault("worker_extension_cls", EXTENSION)
    from vllm import LLM
    from vllm.plugins import load_general_plugins
    _MAKE_LLM = True
    try:
        load_general_plugins()
        register()  # in case the plugins were loaded in this process before the switch was set
        return LLM(str(model), **kwargs)  # a pathlib.Path too (vLLM calls str methods on it)
    finally:
        _MAKE_LLM = False


def _head_size(model):
    path = os.path.join(str(model), "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"kvcert: no config.json in {model}")
    with open(path) as f:
        c = json.load(f)
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


def collect(llm, clear=True, records=True):
    """Every rank's records (the last `records=` of make_llm per rank) and the summaries not handed back
    yet (list, one entry per worker); clear: the ranks drop them. generate() hands each request's summary
    back with its output and leaves the records here. ValueError (one line) if records are asked for and
    the engine keeps none."""
    parts = llm.collective_rpc("kvcert_collect", args=(clear, records))
    if records and parts and all(p["records_cap"] == 0 for p in parts):
        raise ValueError("kvcert: this engine keeps no per-read records (records=0 / KVCERT_RECORDS=0): "
                         "make_llm(records=N) keeps the last N per worker; per-request summaries come with "
                         "generate() as .kvcert, or collect(llm, records=False)")
    return parts


def generate(llm, prompts, params=None, **kwargs):
    """llm.generate(prompts, params, **kwargs), each RequestOutput with its certificate summary attached
    as `.kvcert` (summaries(): merged over the ranks; reads, max/mean bound as served, the bound before
    the gate, repairs, violations in shadow mode). The ranks hand these requests' summaries back and drop
    them; the per-read records stay for collect() (traces: trace_dir)."""
    outs = llm.generate(prompts, params, **kwargs)
    summ = summaries(llm.collective_rpc("kvcert_summaries", args=([o.request_id for o in outs],)))
    for o in outs:
        o.kvcert = summ.get(o.request_id)
    return outs


def summaries(parts):
    """{request_id: summary} merged over ranks (max of maxima, sums of counts); mean_bound added."""
    out = {}
    for part in parts:
        for rid, s in part["summary"].items():
            rid = external_id(rid)
            m = out.setdefault(rid, {"rows": 0, "reads": 0, "max_bound": 0.0, "max_pre_gate": 0.0, "sum_bound": 0.0, "repairs": 0,
                                     "repaired_heads": [], "violations": 0, "max_true_tv": 0.0, "tau": None})
            m["rows"] = max(m["rows"], s["rows"])
            m["reads"] += s["reads"]
            m["max_bound"] = max(m["max_bound"], s["max_bound"])
            m["max_pre_gate"] = max(m["max_pre_gate"], s["max_pre_gate"])
            m["sum_bound"] += s["sum_bound"]
            m["repairs"] += s["repairs"]
            m["repaired_heads"] += s["repaired_heads"]
            m["violations"] += s["violations"]
            m["max_true_tv"] = max(m["max_true_tv"], s["max_true_tv"])
            m["tau"] = s.get("tau") if m["tau"] is None else m["tau"]
            if "tau_error" in s:
                m["tau_error"] = s["tau_error"]
    for m in out.values():
        m["mean_bound"] = m["sum_bound"] / max(1, m["reads"])
    return out


def external_id(rid):
    """The engine's request id "<id>-<8 hex>" -> the id RequestOutput.request_id shows."""
    head, sep, tail = str(rid).rpartition("-")
    return head if sep and re.fullmatch(r"[0-9a-f]{8}", tail) else str(rid)


def smollm2_dir():
    """The converted SmolLM2 folder, with "architectures": ["LlamaForCausalLM"] in its config.json
    (older converted copies lack it; vLLM then loads the model as an embedding model)."""
    from fast.integrations.model import converted_dir, load_smollm2
    out = converted_dir()
    if not (out / "config.json").is_file():
        load_smollm2()
    path = out / "config.json"
    c = json.loads(path.read_text())
    if c.get("architectures") != ["LlamaForCausalLM"]:
        c["architectures"] = ["LlamaForCausalLM"]
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(c, indent=2))
        tmp.replace(path)
    return out


def main(argv=None):
    import argparse
    p = argparse.ArgumentParser(prog="python -m fast.integrations.vllm",
                                description="vLLM on SmolLM2 with an fp8 KV cache and a certificate for every read")
    p.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.")
    p.add_argument("--codec", default="fp8_e4m3", choices=CODECS)
    p.add_argument("--gate", default="certified:0.2")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--trace-dir", default=None)
    p.add_argument("--fault", default="none", help="none | key_scale:F: inject a faulty quantizer (KVCERT_FAULT)")
    p.add_argument("--no-certify", action="store_true", help="the same engine and codec without kvcert's meter")
    p.add_argument("--out", default=None, help="also record this run (answer, summary) in this JSON file, under "
                   "its settings (other runs in the file are kept)")
    args = p.parse_args(argv)
    gate = "none" if args.no_certify else args.gate
    try:
        llm = make_llm(str(smollm2_dir()), codec=args.codec, gate=gate, enforce_eager=True, max_model_len=2048,
                       kv_cache_memory_bytes=256 << 20, trace_dir=args.trace_dir, fault=args.fault,
                       certify=not args.no_certify)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from vllm import SamplingParams
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False, add_generation_prompt=True)
    out = generate(llm, [text], SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
    for o in out:
        s = o.kvcert or {}
        print(f"answer: {o.outputs[0].text!r}" + (f" (stored keys faulty: {args.fault})" if args.fault != "none" else ""))
        if args.no_certify:
            print(f"request {o.request_id}: served without certificates: nothing can flag the fault")
            continue
        print(f"request {o.request_id}: {s.get('reads', 0)} certified (row, layer, head) reads; bound as served: max "
              f"{s.get('max_bound', math.nan):.4f}, mean {s.get('mean_bound', math.nan):.5f}; before the gate: max "
              f"{s.get('max_pre_gate', math.nan):.4f}; gate {gate}: {s.get('repairs', 0)} (layer, KV head) repairs")
    if args.out:
        _record_run(args, gate, out, sys.argv[1:] if argv is None else argv)
    return 0


def _record_run(args, gate, out, argv):
    """Add this run to the JSON file args.out: {"runs": {settings: {command, answer, summary}}}."""
    from pathlib import Path
    path = Path(args.out)
    data = json.loads(path.read_text()) if path.is_file() else {"runs": {}}
    key = f"codec={args.codec} gate={gate} fault={args.fault} certify={not args.no_certify}"
    import shlex
    cmd = "python -m fast.integrations.vllm " + shlex.join(argv)
    data["runs"][key] = {"command": cmd, "prompt": args.prompt, "answer": out[0].outputs[0].text,
                         "summary": None if args.no_certify else out[0].kvcert}
    path.write_text(json.dumps(data, indent=1, default=float))


if __name__ == "__main__":
    sys.exit(main())
