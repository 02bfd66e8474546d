"""kvcert's serving library: import `fast` in serving code.

Each section below is owned by one part of the library; add exports to your own section.
"""

# --- kernels and certificates (fast path) ---
from fast.rope import rope_bands
from fast.quant import QTensor, quantize, dequantize, dither_noise, SCHEMES
from fast.witness import witness, witness_from_step, witness_from_scales, pack_witness, unpack_witness, logit_error_bound
from fast.certify import tv_bound_forms
from fast.dither import dither_sigma, dither_radius, budget_local
from fast.attention import decode_attention

# --- serving: schemes, certified cache, gating ---
from fast.schemes import Scheme, SchemeError, get_scheme, register_scheme, scheme_names, unregister_scheme
from fast.cache import CertifiedCache, CertifiedLayer, Gate, parse_gate
from fast.meter import enable as enable_meter
from fast.model import ModelMissing, load_smollm2

# --- eviction: evictors, eviction certificate, PAGE ---
from fast.evict import GroupWitness, build_group_witness, compose_tv, evict_bound, evict_log_odds, log_z_kept_lower
from fast.evictors import EVICTORS, Evictor, generate, make_evictor, prefill, shrink_cache
from fast.page import Page, calibrate as calibrate_page, head_agreement_drop
