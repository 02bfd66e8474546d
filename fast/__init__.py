"""kvcert's serving library: import `fast` in serving code.

Layout: fast.core (the certificate math on tensors; imports neither transformers nor vLLM),
fast.integrations (transformers and vLLM adapters over the one core), fast.policies (gates,
evictors, PAGE), fast.tools (CLI, traces). The core names are imported here eagerly; the
integration and policy names on first use, so `import fast` alone never pulls transformers.
"""

import importlib

# --- the certificate core ---
from fast.core.rope import rope_bands
from fast.core.quant import QTensor, quantize, dequantize, dither_noise, SCHEMES
from fast.core.witness import witness, witness_from_step, witness_from_scales, pack_witness, unpack_witness, logit_error_bound
from fast.core.certify import tv_bound_forms
from fast.core.dither import dither_sigma, dither_radius, budget_local
from fast.core.attention import attention_rows, decode_attention
from fast.core.schemes import Scheme, SchemeError, get_scheme, register_scheme, scheme_names, unregister_scheme
from fast.core.evict import GroupWitness, build_group_witness, compose_tv, evict_bound, evict_log_odds, log_z_kept_lower
from fast.core.sparse import SparseIndex, SparseRead, build_sparse_index, extend_sparse_index, sparse_read
from fast.policies.gate import Gate, parse_gate

# --- integrations and policies: imported on first use (they import transformers) ---
_LAZY = {
    "CertifiedCache": ("fast.integrations.hf_cache", "CertifiedCache"),
    "CertifiedLayer": ("fast.integrations.hf_cache", "CertifiedLayer"),
    "enable_meter": ("fast.integrations.hf_meter", "enable"),
    "ModelMissing": ("fast.integrations.model", "ModelMissing"),
    "load_smollm2": ("fast.integrations.model", "load_smollm2"),
    "EVICTORS": ("fast.policies.evictors", "EVICTORS"),
    "EvictionGate": ("fast.policies.evict_gate", "EvictionGate"),
    "Evictor": ("fast.policies.evictors", "Evictor"),
    "generate": ("fast.policies.evictors", "generate"),
    "make_evictor": ("fast.policies.evictors", "make_evictor"),
    "prefill": ("fast.policies.evictors", "prefill"),
    "shrink_cache": ("fast.policies.evictors", "shrink_cache"),
    "Page": ("fast.policies.page", "Page"),
    "calibrate_page": ("fast.policies.page", "calibrate"),
    "calibrate_basis": ("fast.policies.basis", "calibrate_basis"),
    "head_agreement_drop": ("fast.policies.page", "head_agreement_drop"),
}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'fast' has no attribute {name!r}")
    module, attr = _LAZY[name]
    return getattr(importlib.import_module(module), attr)
