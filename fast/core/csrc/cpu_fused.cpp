// Fused CPU read of a compressed KV cache: logits from the int8 or packed int4 codes, softmax weights, the
// certificate sums and the output, two passes over the cache (K codes, then V codes and the
// witness), no fp32 copy of the history. The floating-point argument is in
// fast/core/cpu_fused.py (module doc); this file must match it line by line:
//   logits  x = fl(fl(q . k~) * s), k~ = code * scale (exact in fp32; int4: code = nibble - 8), fl(code * scale + zero) for
//           asymmetric codes (kivi2, pre-RoPE keys then rotated: asym_row), the fp8 decode (fp8_row), or the fp32 row; the dot product in
//           8 fma lanes (lane l: d = l, l + 8, ...) and the tree ((a0+a1)+(a2+a3))+((a4+a5)+(a6+a7))
//   weights w = kv_exp(fl(x - m))                                           (kv_exp: exhaustively checked)
//   c       = fl(sum_b kappa_b rho_b)                                       (fp32, nonnegative terms)
//   sums    Z = sum w, S1 = sum w c, S2 = sum w c c                         (fp64 products and sums)
// Compiled with -ffp-contract=off (and -fno-trapping-math, which only lets selects vectorize): every fused multiply-add is an explicit std::fma, so the
// scalar kv_exp checked by kv_exp_check is bit for bit the one the kernel runs.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

// The AVX2 paths (blocks of 8 key tokens in pass 1, register accumulators for the output in pass 2)
// compute the same operations in the same order as the scalar code beside them, so both give the
// same bits (tests/test_cpu_fused.py builds both and compares): -DKVCERT_SCALAR forces the scalar code.
#if defined(__AVX2__) && defined(__FMA__) && !defined(KVCERT_SCALAR)
#define KVCERT_AVX2 1
#include <immintrin.h>
#else
#define KVCERT_AVX2 0
#endif

namespace {

constexpr float LOG2E = 1.44269504088896341f;
constexpr float MAGIC = 12582912.0f;          // 1.5 * 2^23: x + MAGIC - MAGIC rounds x to an integer
constexpr float LN2_HI = 0.693145751953125f;  // 16 significant bits: n * LN2_HI exact for |n| < 2^8
constexpr float LN2_LO = 1.42860682030941723212e-6f;
constexpr float X_MIN = -87.33654f;            // below this, e^x < 2^-126: kv_exp returns 0

// std::nextafter(x, +inf) without the library call (which the compiler does not inline; used for every rounded-up
// bound: kappa per band, e per row, the witness of each written slot, about 15 times per row in the epilogue):
// the next representable number up, bit for bit the library's (NaN and +inf stay, +-0 -> the smallest
// subnormal, a positive number's bits + 1, a negative one's - 1); tests/test_cpu_fused.py compares both
// on special values and random bit patterns (kvcert_up_check).
template <typename F, typename U>
inline F next_up(F x, F smallest) {
    if (x != x || x == (F)INFINITY) return x;
    if (x == 0) return smallest;
    U b;
    std::memcpy(&b, &x, sizeof b);
    b = x > 0 ? b + 1 : b - 1;
    std::memcpy(&x, &b, sizeof b);
    return x;
}
inline double up(double x) { return next_up<double, uint64_t>(x, 0x1p-1074); }
inline float upf(float x) { return next_up<float, uint32_t>(x, 0x1p-149f); }
inline double down(double x) { return -up(-x); }  // std::nextafter(x, -inf): next_up's cases, mirrored
#if KVCERT_AVX2
// up() on 4 lanes that are each >= +0, +inf or NaN: +0 -> the smallest subnormal and a finite x -> bits + 1
// (a true compare is -1 as an integer), +inf and NaN unchanged: up()'s results on those inputs
inline __m256d up4(__m256d x) {
    const __m256d fin = _mm256_cmp_pd(x, _mm256_set1_pd(INFINITY), _CMP_LT_OQ);
    return _mm256_castsi256_pd(_mm256_sub_epi64(_mm256_castpd_si256(x), _mm256_castpd_si256(fin)));
}
#endif

inline float kv_exp(float x) {
    // e^x for x <= 0 (x = fl(x_j - m)): Cody-Waite reduction x = n ln2 + r, |r| <~ ln2/2, and the
    // degree-7 Taylor polynomial of e^r (truncation < 1e-8 relative) in Horner form with fma.
    float xc = std::max(x, X_MIN);
    float t = std::fma(xc, LOG2E, MAGIC);
    float fn = t - MAGIC;
    float r = std::fma(-fn, LN2_HI, xc);
    r = std::fma(-fn, LN2_LO, r);
    float p = 1.0f / 5040.0f;
    p = std::fma(p, r, 1.0f / 720.0f);
    p = std::fma(p, r, 1.0f / 120.0f);
    p = std::fma(p, r, 1.0f / 24.0f);
    p = std::fma(p, r, 1.0f / 6.0f);
    p = std::fma(p, r, 0.5f);
    p = std::fma(p, r, 1.0f);
    p = std::fma(p, r, 1.0f);
    // 2^fn by the exponent field: fn in [-126, 0] for x in [X_MIN, 0]. A NaN x (the error path: the logit flag
    // reports it; the result is 0 there) gives a NaN fn: the range is checked before the conversion
    const uint32_t e = (fn >= -126.0f && fn <= 127.0f) ? (uint32_t)((int32_t)fn + 127) : 127u;
    const uint32_t bits = e << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    float y = p * scale;
    return x >= X_MIN ? y : 0.0f;
}

// The witness log tables (fast.core.witness._log_table) are power grids with S codes per octave: lut[0] = 0 and, for
// code i in [1, 254], lut[i] = lut[Z0 + i % S] * 2^(i / S - Z0 / S) exactly (every entry normal), with S = 8, Z0 = 160
// (the coarse table) or S = 16, Z0 = 176 (the fine table of vLLM's pages), so a code decodes in registers: the S-entry
// mantissa table by permute (two 8-entry permutes and a blend on bit 3 for S = 16), the exponent added to the bits;
// the reserved top code 255 is the largest fp32 (TOP_BITS: >= any finite witness), selected by a compare. lut_grid
// checks that every entry is exactly what this decode gives (else the kernel uses the table gather); same bits
// either way.
constexpr uint32_t TOP_BITS = 0x7f7fffffu;
inline uint32_t grid_bits(const float* lut, int i, int S, int z0) {
    uint32_t m;
    std::memcpy(&m, &lut[z0 + i % S], 4);
    return m + ((uint32_t)(i / S) << 23) - ((uint32_t)(z0 / S) << 23);  // unsigned, wrapping: m + (i / S - z0 / S) 2^23
}

inline bool lut_is_grid_of(const float* lut, int S, int z0) {
    if (!lut || lut[0] != 0.0f) return false;
    for (int i = 1; i < 255; ++i) {
        uint32_t t;
        std::memcpy(&t, &lut[i], 4);
        const uint32_t e = (t >> 23) & 0xffu;
        if (e == 0 || e == 0xffu || t != grid_bits(lut, i, S, z0)) return false;
    }
    uint32_t top;
    std::memcpy(&top, &lut[255], 4);
    return top == TOP_BITS;
}

// S, the codes per octave of the grid lut is (8 or 16), or 0 when it is neither grid
inline int lut_grid(const float* lut) { return lut_is_grid_of(lut, 8, 160) ? 8 : lut_is_grid_of(lut, 16, 176) ? 16 : 0; }

inline float half_to_float(uint16_t h) {
    // exact IEEE binary16 -> binary32 (F16C's conversion where the build has it: exact too, the same values; a
    // signalling NaN comes back quiet, still a NaN)
#if KVCERT_AVX2 && defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t bits;
    if (e == 0) {
        if (m == 0) {
            bits = sign;
        } else {  // subnormal: m 2^-24, exact in fp32
            float f = (float)m * 5.9604644775390625e-8f;
            std::memcpy(&bits, &f, 4);
            bits |= sign;
        }
    } else if (e == 31) {
        bits = sign | 0x7f800000u | (m << 13);
    } else {
        bits = sign | ((e + 112) << 23) | (m << 13);
    }
    float out;
    std::memcpy(&out, &bits, 4);
    return out;
#endif
}

struct Seg {
    // One segment of the cache, one (b, kvh) block = base + b * sb + h * sh, tokens contiguous.
    const void* k; int64_t k_sb, k_sh;      // int8 codes [.., N, D], packed int4 codes uint8 [.., N, D / 2] or fp32 rows [.., N, D]
    const uint16_t* ks; int64_t ks_sb, ks_sh;  // fp16 scales [.., N, ngk] (codes only)
    const void* v; int64_t v_sb, v_sh;
    const uint16_t* vs; int64_t vs_sb, vs_sh;
    const void* rho; int64_t r_sb, r_sh;    // witness [.., N, NB]: uint8 log codes (lut) or fp32; null = exact (c = 0)
    const uint8_t* valid; int64_t va_sb, va_sh;  // [.., N] (1 = readable); null = all
    const uint8_t* exact; int64_t ex_sb, ex_sh;  // [.., N] (1 = held exactly: c = 0); null = none
    const int32_t* pos; int64_t p_sb, p_sh;      // [.., N] key positions; null = pos0 + j
    int64_t n;
    int coded;  // integer codes + fp16 scales (int8, or int4: see int4); else fp32 rows
    int rho_u8;
    // paged (bs > 0; fp32 rows or symmetric codes with their scales, and the witness; no valid / exact / pos): token j
    // of sequence b lives in block table[b * tb_sb + j / bs] at slot j % bs; the *_sb strides are then per block.
    // k_t: fp32 keys stored transposed per block, [D, bs] (vLLM's CPU cache); values, codes, scales and witness rows
    // stay [bs, X].
    const int32_t* table; int64_t tb_sb;
    int64_t bs;
    int k_t;
    int bs_log2;  // log2(bs) when bs is a power of two (shifts instead of divisions), else -1
    int int4;     // coded: packed 4-bit codes (fast.core.quant int4): uint8 [.., N, D / 2], channel d in byte d / 2, low
                  // nibble = even channel, code = nibble - 8 in [-7, 7] (nibble 0 is no code quantize writes: read as NaN,
                  // so the logit / output flag refuses it; the logit bound e takes |code| <= 7, as QTensor.max_abs)
    // Asymmetric codes (coded, int4 = 0): x~ = fl(code * scale + zero), code * scale exact (a code of <= 8 bits times an
    // 11-bit fp16 scale), one rounding for the sum: the twin's c * scale + zero, bit for bit.
    // kasym (keys) 2, 4 or 8 bits, per channel over blocks of kblk tokens (fast.core.schemes KiviKeys, fast.core.prerope
    // PreRopeKeys): codes uint8 [.., N, D bits / 8] (channel d at bits (d bits) % 8 of byte d bits / 8), scales (ks) and
    // zeros (kz) fp16 [.., N / kblk, D]; the logit bound e takes the decoded rows' own max |k~| (as for fp32 rows).
    // vasym (values) 2 bits, per token in ngv groups (KiviValues): codes uint8 [.., N, D / 4], vs / vz [.., N, ngv].
    // Otherwise the symmetric codes above (int8, or int4).
    const uint16_t* kz; int64_t kz_sb, kz_sh;
    const uint16_t* vz; int64_t vz_sb, vz_sh;
    int kasym, vasym;
    int64_t kblk;
    // keys rotated at read (kasym only, fast.core.prerope): the key at storage index j is rotate_half RoPE of the decoded
    // pre-RoPE row at position rpos0 + j, fl(fl(x_d c) + fl(-x_{d+D/2} s)) / fl(fl(x_d c) + fl(x_{d-D/2} s)) with the fp32
    // tables rcos / rsin [rmax, D / 2] (prerope._rotate's operations); null = no rotation
    const float* rcos; const float* rsin; int64_t rpos0;
    // fp8 codes (coded, fp8 = 1; keys and values alike): bytes [.., N, D], x~ = fl(fl(fl(f8lut[code] * f8pre) * s) * f8post)
    // with s the token's fp32 scale (ks8 / vs8 [.., N, 1], strides ks_sb / ks_sh and vs_sb / vs_sh) or f8scale when
    // null: fast.core.quant.dequantize's operations in its order (round-to-nearest codes: pre = post = 1, so fl(c s);
    // vLLM's round-toward-zero e4m3 cast: c 2^-120 s 2^120). f8lut [256]: the fp32 value of each byte (exact; NaN codes
    // NaN: the logit / output flag refuses them). The logit bound e takes the decoded rows' own max |k~| (as fp32 rows).
    int fp8;
    const float* f8lut;
    const float* ks8; const float* vs8;
    float f8scale, f8pre, f8post;
    // subtractively dithered symmetric codes (coded, dith = 1: int8_dither, or int4_dither with int4 = 1): x~ =
    // fl((code - u) * scale), code - u exact in fp32 (a <= 8-bit integer minus a multiple of 2^-17 in (-1/2, 1/2)),
    // u the dither of fast.core.quant.dither_noise regenerated at read (dither_u): token dtok0 + j, the Philox key
    // of (layer, row b, head h, stream) in dkey + b * dk_sb + h * dk_sh + 2 * stream (two words; stream 0 keys,
    // 1 values). The logit bound e takes the decoded rows' own max |k~| (as fp32 rows).
    int dith;
    const uint32_t* dkey; int64_t dk_sb, dk_sh;
    int64_t dtok0;
    // fp16 rows (coded, f16 = 1; keys and values alike, no scales): [.., N, D] binary16, x~ = the fp32 value of each
    // (exact): a registered scheme's stored output (fast.core.schemes Fp16Stored), the twin's x.float() bit for bit.
    // The logit bound e takes the decoded rows' own max |k~| (as fp32 rows).
    int f16;
    // the value witness (value_bound, segment 0): verr [.., N] fp32 >= ||v_j - v~_j|| per token (null: 0; tokens flagged
    // exact: 0), for the output bound's sums (Args: vstats)
    const float* verr; int64_t ve_sb, ve_sh;
    // fp8 rows decoded by bit arithmetic (fp8_bits) instead of the table gather: 1 (e4m3), 2 (e5m2), 0 (the gather). Set
    // by the kernel itself (run: fp8_format checks the decode against every entry of f8lut); the caller's value is ignored.
    int f8fmt;
    // paged only: lens [B] int32, sequence b's own token count (<= n; null: n for every sequence), and lchunk [B] its
    // own chunk size (cpu_fused._chunk(lens[b]), a multiple of 8). Sequence b reads (and its NaN flag and logit bound
    // see) only its tokens 0..lens[b]-1, in the chunks a read of it alone would use: the blocks past its end are
    // never read, and its result is bit for bit its own read's, whatever else shares the call (segment 1 empty: the
    // caller checks it)
    const int32_t* lens;
    const int32_t* lchunk;
};

// n / m for n >= 0, m >= 1: a shift when m is a power of two (the usual group widths and block sizes), else the
// division; the same quotient either way. The row decoders run once per token: a 64-bit division there cost
// more than the row's decode.
inline int64_t quot(int64_t n, int64_t m) {
    return (m & (m - 1)) == 0 ? n >> __builtin_ctzll((unsigned long long)m) : n / m;
}

// element offset of token j's row (length len) in an array of the segment with strides (sb, sh)
inline int64_t row_off(const Seg& sg, int64_t sb, int64_t sh, int64_t b, int64_t h, int64_t j, int64_t len) {
    if (!sg.bs) return b * sb + h * sh + j * len;
    if (sg.bs_log2 >= 0)
        return (int64_t)sg.table[b * sg.tb_sb + (j >> sg.bs_log2)] * sb + h * sh + (j & (sg.bs - 1)) * len;
    return (int64_t)sg.table[b * sg.tb_sb + j / sg.bs] * sb + h * sh + (j % sg.bs) * len;
}

struct Args {
    int64_t B, T, H, Hkv, D, NB, ngk, ngv;
    float s;              // the softmax scale rounded to fp32 (the logits: as the twin's s32)
    double s64;           // the scale itself (kappa and e: upper bounds of the exact formula's s)
    const float* q;       // [B, T, H, D]
    const int32_t* qpos;  // [B, T]
    const int64_t* bands;  // [NB, W] coordinate indices of each band
    int64_t W;
    double band_margin;    // 1 + 2 gamma_{W+4} (u64): fast.core.certify.band_norms_up
    double e_coef;         // (D + 4) u32 1.01: fast.core.certify.logit_rounding
    const float* lut;      // [256]
    Seg seg[2];           // 0: quantized, 1: exact fp32
    float* out;           // [B, T, H, D]
    double* stats;        // [B, T, H, 5]: Z, S1, S2, max c, e (logit rounding bound)
    float* kmax;          // [B, Hkv, 2, D]: per channel max fp16 scale (codes), max |k| (fp32 rows)
    float* nanflag;       // [2]: NaN when a logit (q, k) / an output (v) is not finite
    int certify;
    int threads;
    int64_t chunk;
    // the dither tier's estimate (fast.core.dither, segment 0 dithered): dF >= sqrt(2 ln(2 n / d)) and, when
    // dstats is not null, [B, T, H, 5] the same five numbers as stats with the dither radius of each token
    // (dither_radius_row) in place of the witness bound c (exact tokens: 0)
    double dF;
    double* dstats;
    // the output bound's sums (fast.core.attention.output_error_bound, math.md T5), when vstats is not null:
    // vstats [B, T, H, 3] = (sum_j w_j e_j in fp64, max e_j, max r_j) over the tokens each row reads, e_j the
    // segment's verr (0 in segment 1 and at exact tokens), r_j >= ||v~_j - vctr|| (fp64 squares of fp64 differences,
    // times v_margin >= 1 + 2 gamma_{D+4} (u64) (1 + 2^-50), one ulp up); vmax [B, Hkv, D] the per-channel max |v~|
    // over every token of both segments; vctr [B, Hkv, D] fp32 the centre (null: 0)
    double* vstats;
    float* vmax;
    const float* vctr;
    double v_margin;
    // the box form over a histogram of c (fast.core.box.hist_box, spec T9c), when hist is not null: [B, T, H, 3, hist_m],
    // per row its occupied bins in increasing order, then zeros: the largest c^_j of the bin's tokens (+inf for the
    // overflow bin), the fp64 sum of their w_j and their count (hist_chunk: the tokens the row reads). 1 <= hist_m <=
    // HIST_K: a row with more occupied bins has neighbours merged (hist_emit) until they fit
    double* hist;
    int64_t hist_m;
};

inline int64_t tok_pos(const Seg& sg, int64_t b, int64_t h, int64_t j, int64_t pos0) {
    return sg.pos ? (int64_t)sg.pos[b * sg.p_sb + h * sg.p_sh + j] : pos0 + j;
}

// readable flags and positions of the 8 tokens j..j+7 of segment 0
inline void block_flags(const Seg& sg, int64_t b, int64_t h, int64_t j, uint8_t* vj, int64_t* pj) {
    for (int t = 0; t < 8; ++t) {
        vj[t] = !sg.valid || sg.valid[b * sg.va_sb + h * sg.va_sh + j + t];
        pj[t] = tok_pos(sg, b, h, j + t, 0);
    }
}

#if KVCERT_AVX2 && defined(__F16C__)
#define KVCERT_F16C 1
#else
#define KVCERT_F16C 0
#endif

#if KVCERT_AVX2
// the 8 codes of `bits` bits (2, 4 or 8) of channels d .. d + 7 (d a multiple of 8) as int32 lanes: channel d + l at bits
// ((d + l) bits) % 8 of byte (d + l) bits / 8 (fast.core.schemes._pack2, fast.core.prerope._pack4, one byte each), the
// scalar loop's (code[bit / 8] >> bit % 8) & (2^bits - 1): the 8 codes fill 2, 4 or 8 adjacent bytes
inline __m256i codes8(const uint8_t* code, int bits, int64_t d) {
    const uint8_t* p = code + d * bits / 8;
    if (bits == 8) return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
    // 2 or 4 bytes, little-endian: channel d + l at bits l * bits of w
    if (bits == 2) {
        uint16_t w;
        std::memcpy(&w, p, 2);
        return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                _mm256_set1_epi32(3));
    }
    int32_t w;
    std::memcpy(&w, p, 4);
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                            _mm256_set1_epi32(15));
}
#endif

// per channel max |x| of a decoded row into m[0, D) (the logit bound of rows decoded in the kernel)
inline void abs_max_into(const float* x, int64_t D, float* m) {
    int64_t d = 0;
#if KVCERT_AVX2
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (; d + 8 <= D; d += 8)  // max of nonnegative numbers (a NaN row: the logit flag refuses the read anyway)
        _mm256_storeu_ps(m + d, _mm256_max_ps(_mm256_loadu_ps(m + d), _mm256_and_ps(_mm256_loadu_ps(x + d), absm)));
#endif
    for (; d < D; ++d) m[d] = std::max(m[d], std::fabs(x[d]));
}

inline const float* dither_cached(uint32_t k0, uint32_t k1, uint64_t token, int64_t D);  // below, with the dither

// Row jj of an asymmetric segment (Seg: kasym / vasym): x~ = fl(code * scale + zero) into buf, keys rotated when the segment
// has RoPE tables; smax (keys): per channel max |k~| into smax[D + d], as for fp32 rows. The AVX2 loop computes the same
// products and sums as the scalar one (the fp16 scales and zeros converted exactly either way), so the same bits.
inline const float* asym_row(const Seg& sg, bool values, int64_t b, int64_t h, int64_t jj, int64_t D, int64_t ng,
                             float* buf, float* smax) {
    const int bits = values ? sg.vasym : sg.kasym;
    const uint8_t* code = (const uint8_t*)(values ? sg.v : sg.k) + b * (values ? sg.v_sb : sg.k_sb) + h * (values ? sg.v_sh : sg.k_sh)
                          + jj * (D * bits / 8);
    const uint16_t *sc, *zc;
    int64_t gw;  // channels per scale: D / ngv (values, one row per token), 1 (keys, one row per block of kblk tokens)
    if (values) {
        sc = sg.vs + b * sg.vs_sb + h * sg.vs_sh + jj * ng;
        zc = sg.vz + b * sg.vz_sb + h * sg.vz_sh + jj * ng;
        gw = quot(D, ng);
    } else {
        sc = sg.ks + b * sg.ks_sb + h * sg.ks_sh + quot(jj, sg.kblk) * D;
        zc = sg.kz + b * sg.kz_sb + h * sg.kz_sh + quot(jj, sg.kblk) * D;
        gw = 1;
    }
    const bool rot = !values && sg.rcos;
    float pre[512];
    float* x = rot ? pre : buf;
    // dithered codes (kivi2_dither: sg.dith): x~ = fl(fl((code - u) * scale) + zero), code - u exact in fp32 (a 2-bit code,
    // u on a 2^-17 grid in (-1/2, 1/2)): fast.core.quant.kivi_dither_dequantize's operations; u of 0 otherwise
    alignas(32) static const float no_u[512] = {};
    const float* u = no_u;
    if (sg.dith) {
        const uint32_t* key = sg.dkey + b * sg.dk_sb + h * sg.dk_sh + (values ? 2 : 0);
        u = dither_cached(key[0], key[1], (uint64_t)(sg.dtok0 + jj), D);
    }
    int64_t d = 0;
#if KVCERT_AVX2
    if (gw == 1) {  // a scale and a zero per channel
        for (; d + 8 <= D; d += 8) {
#if KVCERT_F16C
            const __m256 s8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sc + d)));
            const __m256 z8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(zc + d)));
#else
            alignas(32) float sf[8], zf[8];
            for (int l = 0; l < 8; ++l) { sf[l] = half_to_float(sc[d + l]); zf[l] = half_to_float(zc[d + l]); }
            const __m256 s8 = _mm256_load_ps(sf), z8 = _mm256_load_ps(zf);
#endif
            const __m256 m = _mm256_sub_ps(_mm256_cvtepi32_ps(codes8(code, bits, d)), _mm256_loadu_ps(u + d));
            _mm256_storeu_ps(x + d, _mm256_add_ps(_mm256_mul_ps(m, s8), z8));
        }
    } else if (gw % 8 == 0) {  // one per group of gw channels
        for (int64_t g = 0; g < ng; ++g) {
            const __m256 s8 = _mm256_set1_ps(half_to_float(sc[g])), z8 = _mm256_set1_ps(half_to_float(zc[g]));
            for (d = g * gw; d < (g + 1) * gw; d += 8) {
                const __m256 m = _mm256_sub_ps(_mm256_cvtepi32_ps(codes8(code, bits, d)), _mm256_loadu_ps(u + d));
                _mm256_storeu_ps(x + d, _mm256_add_ps(_mm256_mul_ps(m, s8), z8));
            }
        }
    }
#endif
    for (; d < D; ++d) {
        const int64_t bit = d * bits;
        const int c = (code[bit >> 3] >> (bit & 7)) & ((1 << bits) - 1);
        const float p = ((float)c - u[d]) * half_to_float(sc[quot(d, gw)]);
        x[d] = p + half_to_float(zc[quot(d, gw)]);
    }
    if (rot) {
        const int64_t hd = D / 2;
        const float* cs = sg.rcos + (sg.rpos0 + jj) * hd;
        const float* sn = sg.rsin + (sg.rpos0 + jj) * hd;
        for (int64_t i = 0; i < hd; ++i) {
            const float a = pre[i] * cs[i], bq = -pre[i + hd] * sn[i];
            const float c2 = pre[i + hd] * cs[i], d2 = pre[i] * sn[i];
            buf[i] = a + bq;
            buf[i + hd] = c2 + d2;
        }
    }
    if (smax) abs_max_into(buf, D, smax + D);
    return buf;
}

// The subtractive dither of fast.core.quant.dither_noise, bit for bit: u [rows, Hkv, N, D] fp32 of one stream.
// Philox4x32-10 (Random123's rounds, multipliers 0xD2511F53 / 0xCD9E8D57, Weyl increments 0x9E3779B9 /
// 0xBB67AE85) in two stages: key (k0, k1) = words 0-1 of Philox(counter (layer, row, head, stream), key
// (seed lo, seed hi)); then for each block b of 8 channels, Philox(counter (token lo, token hi, b, 0), key
// (k0, k1)) gives words w0..w3, channel 8 b + 2 j + h takes the high (h = 0) or low (h = 1) 16 bits i of w_j,
// u = (2 i + 1 - 2^16) 2^-17 (exact in fp32). The caller checks the counters (quant.check_dither_counters).
inline void philox4x32_10(uint32_t c[4], uint32_t k0, uint32_t k1) {
    for (int r = 0; r < 10; ++r) {
        if (r) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const uint64_t p0 = (uint64_t)0xD2511F53u * c[0], p1 = (uint64_t)0xCD9E8D57u * c[2];
        const uint32_t n0 = (uint32_t)(p1 >> 32) ^ c[1] ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c[3] ^ k1;
        c[1] = (uint32_t)p1;
        c[3] = (uint32_t)p0;
        c[0] = n0;
        c[2] = n2;
    }
}

// u of channel 8 b + 2 j + h from word j of block b's Philox
inline float dither_one(const uint32_t* w, int64_t c) {
    const uint32_t word = w[(c & 7) >> 1];
    const int32_t i = (int32_t)((c & 1) ? (word & 0xFFFFu) : (word >> 16));
    return (float)(2 * i + 1 - 65536) * 0x1p-17f;
}

#if KVCERT_AVX2
// (hi, lo) 32-bit words of c * m for 8 lanes: mul_epu32 takes the even lanes (64-bit products), the odd lanes
// shifted down; the high words of the even products shifted down and blended with the odd products' high words
// (the low words from the same products: blends and shifts, not mullo_epi32's longer latency)
inline void mulhilo8(__m256i c, __m256i m, __m256i& hi, __m256i& lo) {
    const __m256i ev = _mm256_mul_epu32(c, m), od = _mm256_mul_epu32(_mm256_srli_epi64(c, 32), m);
    hi = _mm256_blend_epi32(_mm256_srli_epi64(ev, 32), od, 0xAA);
    lo = _mm256_blend_epi32(ev, _mm256_slli_epi64(od, 32), 0xAA);
}

// u (fp32, 8 numbers each) of channels 8 b + c from one 16-bit half (c % 2: 0 high, 1 low) of word c / 2, lane b
inline __m256 dither_half8(__m256i w, int low) {
    const __m256i i = low ? _mm256_and_si256(w, _mm256_set1_epi32(0xFFFF)) : _mm256_srli_epi32(w, 16);
    const __m256i k = _mm256_add_epi32(_mm256_slli_epi32(i, 1), _mm256_set1_epi32(1 - 65536));  // 2 i + 1 - 2^16, exact
    return _mm256_mul_ps(_mm256_cvtepi32_ps(k), _mm256_set1_ps(0x1p-17f));
}

// 8 x 8 floats: rows x[0..7] -> columns, row l of the result (lane l of every x) written to out + l * stride
inline void transpose8_store(const __m256* x, float* out, int64_t stride) {
    const __m256 t0 = _mm256_unpacklo_ps(x[0], x[1]), t1 = _mm256_unpackhi_ps(x[0], x[1]);
    const __m256 t2 = _mm256_unpacklo_ps(x[2], x[3]), t3 = _mm256_unpackhi_ps(x[2], x[3]);
    const __m256 t4 = _mm256_unpacklo_ps(x[4], x[5]), t5 = _mm256_unpackhi_ps(x[4], x[5]);
    const __m256 t6 = _mm256_unpacklo_ps(x[6], x[7]), t7 = _mm256_unpackhi_ps(x[6], x[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_storeu_ps(out + 0 * stride, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_storeu_ps(out + 1 * stride, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_storeu_ps(out + 2 * stride, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_storeu_ps(out + 3 * stride, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_storeu_ps(out + 4 * stride, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_storeu_ps(out + 5 * stride, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_storeu_ps(out + 6 * stride, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_storeu_ps(out + 7 * stride, _mm256_permute2f128_ps(u3, u7, 0x31));
}
#endif

// The dither u [n][D] of tokens token0 .. token0 + n - 1 under the key (k0, k1): the scalar Philox per block of 8
// channels; with AVX2, 8 blocks at a time (lane = block: the same integer operations per lane, so the same bits) for two
// tokens at once (two independent chains: the rounds' multiply latency overlaps), then an 8 x 8 transpose each
inline void dither_u(uint32_t k0, uint32_t k1, uint64_t token0, int64_t n, int64_t D, float* u) {
    const int64_t nb = (D + 7) / 8;
    int64_t full = 0;  // blocks done by the AVX2 loop (a multiple of 8)
#if KVCERT_AVX2
    full = (D / 64) * 8;
    const __m256i m0 = _mm256_set1_epi32((int)0xD2511F53u), m1 = _mm256_set1_epi32((int)0xCD9E8D57u);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t t = 0; t < n; t += 2) {
        const int nt = t + 1 < n ? 2 : 1;
        for (int64_t b = 0; b < full; b += 8) {
            __m256i c0[2], c1[2], c2[2], c3[2];
            for (int i = 0; i < 2; ++i) {
                const uint64_t token = token0 + (uint64_t)(t + (i < nt ? i : 0));
                c0[i] = _mm256_set1_epi32((int)(uint32_t)token);
                c1[i] = _mm256_set1_epi32((int)(uint32_t)(token >> 32));
                c2[i] = _mm256_add_epi32(_mm256_set1_epi32((int)b), lane);
                c3[i] = _mm256_setzero_si256();
            }
            uint32_t ka = k0, kb = k1;
            for (int r = 0; r < 10; ++r) {
                if (r) {
                    ka += 0x9E3779B9u;
                    kb += 0xBB67AE85u;
                }
                const __m256i kav = _mm256_set1_epi32((int)ka), kbv = _mm256_set1_epi32((int)kb);
                for (int i = 0; i < 2; ++i) {
                    __m256i hi0, lo0, hi1, lo1;
                    mulhilo8(c0[i], m0, hi0, lo0);
                    mulhilo8(c2[i], m1, hi1, lo1);
                    c0[i] = _mm256_xor_si256(_mm256_xor_si256(hi1, c1[i]), kav);
                    c2[i] = _mm256_xor_si256(_mm256_xor_si256(hi0, c3[i]), kbv);
                    c1[i] = lo1;
                    c3[i] = lo0;
                }
            }
            for (int i = 0; i < nt; ++i) {
                const __m256i w[4] = {c0[i], c1[i], c2[i], c3[i]};
                __m256 x[8];
                for (int c = 0; c < 8; ++c) x[c] = dither_half8(w[c >> 1], c & 1);
                transpose8_store(x, u + (t + i) * D + 8 * b, 8);
            }
        }
    }
#endif
    for (int64_t t = 0; t < n; ++t) {
        const uint64_t token = token0 + (uint64_t)t;
        for (int64_t b = full; b < nb; ++b) {
            uint32_t w[4] = {(uint32_t)token, (uint32_t)(token >> 32), (uint32_t)b, 0u};
            philox4x32_10(w, k0, k1);
            for (int64_t c = 8 * b; c < 8 * b + 8 && c < D; ++c) u[t * D + c] = dither_one(w, c);
        }
    }
}

// The dither of token `token` under (k0, k1), from this thread's cache of 8 consecutive tokens (the reads ask for tokens
// in order: one dither_u call per 8 rows). Keyed by the values the dither depends on (k0, k1, token, D), so a hit is
// exactly what dither_u would compute; tokens past the segment's last are computed and never used (no counter check
// needed: nothing of them is read).
inline const float* dither_cached(uint32_t k0, uint32_t k1, uint64_t token, int64_t D) {
    struct Cache { uint32_t k0, k1; uint64_t tok0; int64_t D; bool ok; alignas(32) float u[8 * 512]; };
    static thread_local Cache ch = {0, 0, 0, 0, false, {}};
    if (!(ch.ok && ch.k0 == k0 && ch.k1 == k1 && ch.D == D && token >= ch.tok0 && token - ch.tok0 < 8)) {
        dither_u(k0, k1, token, 8, D, ch.u);
        ch.k0 = k0;
        ch.k1 = k1;
        ch.tok0 = token;
        ch.D = D;
        ch.ok = true;
    }
    return ch.u + (token - ch.tok0) * D;
}

#if KVCERT_AVX2
// The fp32 values of 8 fp8 bytes (int32 lanes) by bit arithmetic, format fmt (1: e4m3fn, 3 mantissa bits, bias 7, 0x7f
// NaN; 2: e5m2, 2 bits, bias 15, exponent 31 inf / NaN): a normal byte's exponent and mantissa moved into fp32's
// fields, rebiased; a subnormal one m 2^(1 - bias - M) (exact: m < 2^M); the sign bit or-ed in. fp8_format accepts it
// only where it gives every table entry's bits (NaN for NaN), so it is the table's value, as the gather.
inline __m256 fp8_bits(__m256i c, int fmt) {
    const int M = fmt == 1 ? 3 : 2, bias = fmt == 1 ? 7 : 15;
    const __m256i mag = _mm256_and_si256(c, _mm256_set1_epi32(0x7f));
    const __m256i nb = _mm256_add_epi32(_mm256_slli_epi32(mag, 23 - M), _mm256_set1_epi32((127 - bias) << 23));
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(fmt == 1 ? 0x1p-9f : 0x1p-16f));
    __m256 r = _mm256_blendv_ps(_mm256_castsi256_ps(nb), sub, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(1 << M), mag)));
    if (fmt == 1) {  // 0x7f: NaN
        r = _mm256_or_ps(r, _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f))));
    } else {  // exponent 31: mantissa 0 inf, else NaN
        const __m256i top = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7b));
        const __m256i inf = _mm256_set1_epi32(0x7f800000);
        const __m256i sp = _mm256_or_si256(inf, _mm256_slli_epi32(_mm256_and_si256(mag, _mm256_set1_epi32(3)), 21));
        r = _mm256_blendv_ps(r, _mm256_castsi256_ps(sp), _mm256_castsi256_ps(top));
    }
    return _mm256_or_ps(r, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24)));
}

// 1 or 2 when fp8_bits of that format gives every entry of the table lut[256] bit for bit (NaN entries: a NaN), else 0
inline int fp8_format(const float* lut) {
    for (int fmt = 1; fmt <= 2; ++fmt) {
        bool ok = true;
        for (int i = 0; i < 256 && ok; i += 8) {
            alignas(32) float x[8];
            _mm256_store_ps(x, fp8_bits(_mm256_add_epi32(_mm256_set1_epi32(i), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)), fmt));
            for (int l = 0; l < 8; ++l)
                ok = ok && (std::isnan(lut[i + l]) ? std::isnan(x[l]) : std::memcmp(&x[l], &lut[i + l], 4) == 0);
        }
        if (ok) return fmt;
    }
    return 0;
}
#endif

#if KVCERT_AVX2
// 8 fp8 bytes at p as fp8_row decodes them: fl(fl(fl(c pre) s) post), c their value (fp8_bits of format fmt)
inline __m256 fp8_8(const uint8_t* p, int fmt, __m256 pre8, __m256 s8, __m256 post8) {
    const __m256 c = fp8_bits(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)), fmt);
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(c, pre8), s8), post8);
}

// channels d .. d + 7 of a row of asymmetric codes as asym_row decodes them (no dither): fl(code * scale + zero)
inline __m256 asym8(const uint8_t* code, int bits, int64_t d, __m256 s8, __m256 z8) {
    return _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(codes8(code, bits, d)), s8), z8);
}
#endif

// Row jj of an fp8 segment (Seg: fp8) decoded into buf; smax (keys): per channel max |k~| into smax[D + d], as for
// fp32 rows. The AVX2 loop runs the scalar loop's products in its order (the same bits: tests/test_cpu_fused.py).
inline const float* fp8_row(const Seg& sg, bool values, int64_t b, int64_t h, int64_t jj, int64_t D, float* buf, float* smax) {
    const uint8_t* code = (const uint8_t*)(values ? sg.v : sg.k) + row_off(sg, values ? sg.v_sb : sg.k_sb, values ? sg.v_sh : sg.k_sh, b, h, jj, D);
    const float* sp = values ? sg.vs8 : sg.ks8;
    const float s = sp ? sp[row_off(sg, values ? sg.vs_sb : sg.ks_sb, values ? sg.vs_sh : sg.ks_sh, b, h, jj, 1)] : sg.f8scale;
    const float pre = sg.f8pre, post = sg.f8post;
    int64_t d = 0;
#if KVCERT_AVX2
    // 8 codes at a time: the table's values (fp8_bits where run found it exact, else gathered), then the scalar loop's
    // three products in its order
    const __m256 pre8 = _mm256_set1_ps(pre), s8 = _mm256_set1_ps(s), post8 = _mm256_set1_ps(post);
    for (; d + 8 <= D; d += 8) {
        const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(code + d)));
        const __m256 c = sg.f8fmt ? fp8_bits(idx, sg.f8fmt) : _mm256_i32gather_ps(sg.f8lut, idx, 4);
        _mm256_storeu_ps(buf + d, _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(c, pre8), s8), post8));
    }
#endif
    for (; d < D; ++d) buf[d] = ((sg.f8lut[code[d]] * pre) * s) * post;
    if (smax) abs_max_into(buf, D, smax + D);
    return buf;
}

// Row jj of an fp16 segment (Seg: f16) decoded into buf (exact conversions: F16C where the build has it, else
// half_to_float, the same values); smax (keys): per channel max |k~| into smax[D + d], as for fp32 rows.
inline const float* f16_row(const Seg& sg, bool values, int64_t b, int64_t h, int64_t jj, int64_t D, float* buf, float* smax) {
    const uint16_t* x = (const uint16_t*)(values ? sg.v : sg.k) + row_off(sg, values ? sg.v_sb : sg.k_sb, values ? sg.v_sh : sg.k_sh, b, h, jj, D);
    int64_t d = 0;
#if KVCERT_AVX2 && defined(__F16C__)
    for (; d + 8 <= D; d += 8) _mm256_storeu_ps(buf + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(x + d))));
#endif
    for (; d < D; ++d) buf[d] = half_to_float(x[d]);
    if (smax) abs_max_into(buf, D, smax + D);
    return buf;
}

// Row jj of a dithered segment (Seg: dith) decoded into buf: x~ = fl((m - u) * scale), m the int8 code or the int4
// nibble - 8 (nibble 0: NaN, as seg_row), u the token's dither (dither_u): fast.core.quant.dequantize's operations,
// bit for bit (m - u is exact in fp32). smax (keys): per channel max |k~| into smax[D + d], as for fp32 rows.
inline const float* dither_row(const Seg& sg, bool values, int64_t b, int64_t h, int64_t jj, int64_t D, int64_t ng,
                               float* buf, float* smax) {
    const void* base = values ? sg.v : sg.k;
    const int64_t sb = values ? sg.v_sb : sg.k_sb, sh = values ? sg.v_sh : sg.k_sh;
    const uint16_t* sc = values ? sg.vs + row_off(sg, sg.vs_sb, sg.vs_sh, b, h, jj, ng) : sg.ks + row_off(sg, sg.ks_sb, sg.ks_sh, b, h, jj, ng);
    const uint32_t* key = sg.dkey + b * sg.dk_sb + h * sg.dk_sh + (values ? 2 : 0);
    const float* u = dither_cached(key[0], key[1], (uint64_t)(sg.dtok0 + jj), D);
    if (sg.int4) {
        const uint8_t* code = (const uint8_t*)base + row_off(sg, sb, sh, b, h, jj, D / 2);
        for (int64_t d = 0; d < D; ++d) {
            const int nib = (code[d >> 1] >> ((d & 1) * 4)) & 15;
            buf[d] = nib ? (float)(nib - 8) : NAN;
        }
    } else {
        const int8_t* code = (const int8_t*)base + row_off(sg, sb, sh, b, h, jj, D);
        for (int64_t d = 0; d < D; ++d) buf[d] = (float)code[d];
    }
    const int64_t gw = quot(D, ng);
    for (int64_t g = 0; g < ng; ++g) {
        const float sv = half_to_float(sc[g]);
#pragma omp simd
        for (int64_t d = g * gw; d < (g + 1) * gw; ++d) buf[d] = (buf[d] - u[d]) * sv;
    }
    if (smax) abs_max_into(buf, D, smax + D);
    return buf;
}

// true when a segment's logit bound takes the largest scale of each group times the largest code (int8, int4), false
// when it takes the decoded rows' own max |k~| (fp32 rows, asymmetric codes, fp8, dithered codes, fp16 rows)
inline bool scale_max(const Seg& sg) { return sg.coded && !sg.kasym && !sg.fp8 && !sg.dith && !sg.f16; }

// Row jj of a segment's keys (values = false) or values, as fp32: code * scale (exact in fp32: 8- or 4-bit code,
// 11-bit fp16 scale) written into buf, or a pointer to the fp32 row. smax (keys only, may be null):
// per group max of the scales (codes: smax[g]) or per channel max of |k| (fp32 rows: smax[D + d]).
// always inlined: called once per token in both passes, a call per row cost ~10% of a 1k-token read
__attribute__((always_inline)) inline const float* seg_row(const Seg& sg, bool values, int64_t b, int64_t h, int64_t jj,
                                                           int64_t D, int64_t ng, float* buf, float* smax) {
    const void* base = values ? sg.v : sg.k;
    const int64_t sb = values ? sg.v_sb : sg.k_sb, sh = values ? sg.v_sh : sg.k_sh;
    if (!sg.coded) {
        const float* r;
        if (!values && sg.k_t) {  // [D, bs] block: gather the row (exact copies)
            const float* kb = (const float*)base + (int64_t)sg.table[b * sg.tb_sb + jj / sg.bs] * sb + h * sh + jj % sg.bs;
            for (int64_t d = 0; d < D; ++d) buf[d] = kb[d * sg.bs];
            r = buf;
        } else {
            r = (const float*)base + row_off(sg, sb, sh, b, h, jj, D);
        }
        if (smax)
            for (int64_t d = 0; d < D; ++d) smax[D + d] = std::max(smax[D + d], std::fabs(r[d]));
        return r;
    }
    if (values ? sg.vasym : sg.kasym) return asym_row(sg, values, b, h, jj, D, ng, buf, smax);
    if (sg.fp8) return fp8_row(sg, values, b, h, jj, D, buf, smax);
    if (sg.f16) return f16_row(sg, values, b, h, jj, D, buf, smax);
    if (sg.dith) return dither_row(sg, values, b, h, jj, D, ng, buf, smax);
    const uint16_t* sc = values ? sg.vs + row_off(sg, sg.vs_sb, sg.vs_sh, b, h, jj, ng) : sg.ks + row_off(sg, sg.ks_sb, sg.ks_sh, b, h, jj, ng);
    const int64_t gw = quot(D, ng);
    if (sg.int4) {
        // packed 4-bit codes, two per byte: channel d is nibble d % 2 (0: low) of byte d / 2; k~ = (nibble - 8) * scale,
        // exact in fp32 (4-bit code, 11-bit fp16 scale): fast.core.quant.dequantize's value, bit for bit
        const uint8_t* code = (const uint8_t*)base + row_off(sg, sb, sh, b, h, jj, D / 2);
        for (int64_t g = 0; g < ng; ++g) {
            const float sv = half_to_float(sc[g]);
            int64_t d = g * gw;
#if KVCERT_AVX2
            if (gw % 2 == 0) {  // d even: 8 channels are the 4 bytes from d / 2, nibble l of their word is channel d + l
                const __m256 s8 = _mm256_set1_ps(sv);
                const __m256i sh4 = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), m15 = _mm256_set1_epi32(15);
                const __m256i eight = _mm256_set1_epi32(8), zero = _mm256_setzero_si256();
                for (; d + 8 <= (g + 1) * gw; d += 8) {
                    int32_t w;
                    std::memcpy(&w, code + d / 2, 4);
                    const __m256i nib = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w), sh4), m15);
                    const __m256 x = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(nib, eight)), s8);
                    // nibble 0: all ones (a NaN), as the scalar line below
                    _mm256_storeu_ps(buf + d, _mm256_or_ps(x, _mm256_castsi256_ps(_mm256_cmpeq_epi32(nib, zero))));
                }
            }
#endif
            for (; d < (g + 1) * gw; ++d) {
                const int nib = (code[d >> 1] >> ((d & 1) * 4)) & 15;
                buf[d] = nib ? (float)(nib - 8) * sv : NAN;
            }
            if (smax) smax[g] = std::max(smax[g], sv);
        }
        return buf;
    }
    const int8_t* code = (const int8_t*)base + row_off(sg, sb, sh, b, h, jj, D);
    for (int64_t g = 0; g < ng; ++g) {
        const float sv = half_to_float(sc[g]);
        int64_t d = g * gw;
#if KVCERT_AVX2
        const __m256 s8 = _mm256_set1_ps(sv);
        for (; d + 8 <= (g + 1) * gw; d += 8) {
            const __m256i c32 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(code + d)));
            _mm256_storeu_ps(buf + d, _mm256_mul_ps(_mm256_cvtepi32_ps(c32), s8));
        }
#endif
        for (; d < (g + 1) * gw; ++d) buf[d] = (float)code[d] * sv;
        if (smax) smax[g] = std::max(smax[g], sv);  // per group; the caller spreads it over the group's channels
    }
    return buf;
}

// Token j's value row of a read (segment 0 for j < its n, else segment 1) as fp32, in buf or in place (seg_row).
__attribute__((always_inline)) inline const float* value_row(const Args& a, int64_t b, int64_t h, int64_t j, float* buf) {
    const int64_t N0 = a.seg[0].n;
    return j < N0 ? seg_row(a.seg[0], true, b, h, j, a.D, a.ngv, buf, nullptr) : seg_row(a.seg[1], true, b, h, j - N0, a.D, 1, buf, nullptr);
}

#if KVCERT_AVX2
// lane l of the result: ((x_l0 + x_l1) + (x_l2 + x_l3)) + ((x_l4 + x_l5) + (x_l6 + x_l7)), x_lk lane k of acc[l] (the
// scalar dot product's tree, for 8 tokens at once: hadd pairs, then the two 128-bit halves)
inline __m256 tree_lanes(const __m256* acc) {
    const __m256 h01 = _mm256_hadd_ps(acc[0], acc[1]), h23 = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 h45 = _mm256_hadd_ps(acc[4], acc[5]), h67 = _mm256_hadd_ps(acc[6], acc[7]);
    const __m256 h03 = _mm256_hadd_ps(h01, h23), h47 = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(h03, h47, 0x20), _mm256_permute2f128_ps(h03, h47, 0x31));
}

// The register paths' row kinds (-1: none, the buffered loops): symmetric int8 or int4 codes with scale groups of a
// multiple of 8 channels, fp8 bytes of a format fp8_bits decodes, or asymmetric codes without dither (keys: blocks of a
// multiple of 8 tokens, so that 8 tokens share one block's scales and zeros, rotated at read only when D is a multiple of
// 16; values: groups of a multiple of 8 channels)
enum Kind { K_INT8 = 0, K_INT4 = 1, K_ASYM = 2, K_FP8 = 3 };

inline int row_kind(const Seg& sg, bool values, int64_t ng, int64_t D) {
    if (sg.n && sg.fp8) return sg.f8fmt ? K_FP8 : -1;  // fp8 bytes: where fp8_bits is the table (run: fp8_format)
    if (!sg.n || !sg.coded || sg.f16 || sg.dith) return -1;
    if (values ? sg.vasym : sg.kasym)
        return (values ? quot(D, ng) % 8 == 0 : (sg.kblk % 8 == 0 && (!sg.rcos || D % 16 == 0))) ? K_ASYM : -1;
    if (quot(D, ng) % 8) return -1;
    return sg.int4 ? K_INT4 : K_INT8;
}

#if KVCERT_F16C
inline __m256 half8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
#else
inline __m256 half8(const uint16_t* p) {
    alignas(32) float f[8];
    for (int l = 0; l < 8; ++l) f[l] = half_to_float(p[l]);
    return _mm256_load_ps(f);
}
#endif

// channels d .. d + 7 (d a multiple of 8) of a row of symmetric codes times the scale s8, as seg_row decodes them: int8
// code * scale; int4 (nibble - 8) * scale, nibble 0 a NaN (all ones, or-ed in after the product, as seg_row)
template <bool INT4>
inline __m256 sym8(const uint8_t* row, int64_t d, __m256 s8) {
    if (!INT4)
        return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(row + d)))), s8);
    int32_t w;
    std::memcpy(&w, row + d / 2, 4);
    const __m256i nib = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                         _mm256_set1_epi32(15));
    const __m256 x = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(nib, _mm256_set1_epi32(8))), s8);
    return _mm256_or_ps(x, _mm256_castsi256_ps(_mm256_cmpeq_epi32(nib, _mm256_setzero_si256())));
}

// Pass 1 on 8 tokens [j, j + 8) of segment 0 (row_kind) and NR query rows q [NR][D]: each token's key decoded in
// registers as seg_row decodes it (symmetric: code * scale, exact; asymmetric: fl(code * scale + zero), asym_row's
// operations, the 8 tokens' per-channel scales and zeros converted once) and dotted with the NR rows, lane l of row r's
// accumulator the fma chain over d = l, l + 8, ... in order (the buffered loop's): written to ab[(r 8 + t) 8 + l] for
// the caller's tree. The logit bound's maxima as seg_row keeps them: symmetric codes gm[g] (the group's largest scale),
// asymmetric and fp8 ones km[D + d] (the largest |k~| per channel).
template <int NR, int KIND>
inline void dots8(const Seg& sg, int64_t b, int64_t h, int64_t j, int64_t D, int64_t ng, const float* q, float* ab, float* gm,
                  float* km) {
    const int64_t gw = quot(D, ng);
    alignas(32) float sz[2 * 512];  // asymmetric keys: the block's scales, then zeros
    if (KIND == K_ASYM) {
        const int64_t blk = quot(j, sg.kblk);
        const uint16_t* sc = sg.ks + b * sg.ks_sb + h * sg.ks_sh + blk * D;
        const uint16_t* zc = sg.kz + b * sg.kz_sb + h * sg.kz_sh + blk * D;
        for (int64_t d = 0; d < D; d += 8) {
            _mm256_store_ps(sz + d, half8(sc + d));
            _mm256_store_ps(sz + D + d, half8(zc + d));
        }
    }
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int t = 0; t < 8; ++t) {
        __m256 acc[NR];
        for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
        if (KIND == K_ASYM && sg.rcos) {
            // pre-RoPE keys: asym_row's rotation of channels i and i + D / 2 (fl(fl(x_i c) + fl(-x_{i+D/2} s)),
            // fl(fl(x_{i+D/2} c) + fl(x_i s))) on both decoded blocks at once; the upper half's rows wait in hi so that
            // the dot product still takes d in order
            const int bits = sg.kasym;
            const uint8_t* code = (const uint8_t*)sg.k + b * sg.k_sb + h * sg.k_sh + (j + t) * (D * bits / 8);
            const int64_t hd = D / 2;
            const float* cs = sg.rcos + (sg.rpos0 + j + t) * hd;
            const float* sn = sg.rsin + (sg.rpos0 + j + t) * hd;
            const __m256 neg = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
            alignas(32) float hi[256];
            for (int64_t i = 0; i < hd; i += 8) {
                const __m256 x0 = asym8(code, bits, i, _mm256_load_ps(sz + i), _mm256_load_ps(sz + D + i));
                const __m256 x1 = asym8(code, bits, i + hd, _mm256_load_ps(sz + i + hd), _mm256_load_ps(sz + D + i + hd));
                const __m256 c8 = _mm256_loadu_ps(cs + i), s8 = _mm256_loadu_ps(sn + i);
                const __m256 lo = _mm256_add_ps(_mm256_mul_ps(x0, c8), _mm256_mul_ps(_mm256_xor_ps(x1, neg), s8));
                const __m256 up = _mm256_add_ps(_mm256_mul_ps(x1, c8), _mm256_mul_ps(x0, s8));
                _mm256_store_ps(hi + i, up);
                _mm256_storeu_ps(km + D + i, _mm256_max_ps(_mm256_loadu_ps(km + D + i), _mm256_and_ps(lo, absm)));
                _mm256_storeu_ps(km + D + i + hd, _mm256_max_ps(_mm256_loadu_ps(km + D + i + hd), _mm256_and_ps(up, absm)));
                for (int r = 0; r < NR; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * D + i), lo, acc[r]);
            }
            for (int64_t i = 0; i < hd; i += 8)
                for (int r = 0; r < NR; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * D + hd + i), _mm256_load_ps(hi + i), acc[r]);
        } else if (KIND == K_ASYM) {
            const int bits = sg.kasym;
            const uint8_t* code = (const uint8_t*)sg.k + b * sg.k_sb + h * sg.k_sh + (j + t) * (D * bits / 8);
            for (int64_t d = 0; d < D; d += 8) {
                const __m256 k = asym8(code, bits, d, _mm256_load_ps(sz + d), _mm256_load_ps(sz + D + d));
                _mm256_storeu_ps(km + D + d, _mm256_max_ps(_mm256_loadu_ps(km + D + d), _mm256_and_ps(k, absm)));
                for (int r = 0; r < NR; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * D + d), k, acc[r]);
            }
        } else if (KIND == K_FP8) {  // fp8_row's operations: fl(fl(fl(c pre) s) post), |k~| max-ed per channel
            const uint8_t* code = (const uint8_t*)sg.k + row_off(sg, sg.k_sb, sg.k_sh, b, h, j + t, D);
            const float s = sg.ks8 ? sg.ks8[row_off(sg, sg.ks_sb, sg.ks_sh, b, h, j + t, 1)] : sg.f8scale;
            const __m256 pre8 = _mm256_set1_ps(sg.f8pre), s8 = _mm256_set1_ps(s), post8 = _mm256_set1_ps(sg.f8post);
            for (int64_t d = 0; d < D; d += 8) {
                const __m256 k = fp8_8(code + d, sg.f8fmt, pre8, s8, post8);
                _mm256_storeu_ps(km + D + d, _mm256_max_ps(_mm256_loadu_ps(km + D + d), _mm256_and_ps(k, absm)));
                for (int r = 0; r < NR; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * D + d), k, acc[r]);
            }
        } else {
            const uint8_t* code = (const uint8_t*)sg.k + row_off(sg, sg.k_sb, sg.k_sh, b, h, j + t, KIND == K_INT4 ? D / 2 : D);
            const uint16_t* sc = sg.ks + row_off(sg, sg.ks_sb, sg.ks_sh, b, h, j + t, ng);
            for (int64_t g = 0; g < ng; ++g) {
                const float sv = half_to_float(sc[g]);
                gm[g] = std::max(gm[g], sv);
                const __m256 s8 = _mm256_set1_ps(sv);
                for (int64_t d = g * gw; d < (g + 1) * gw; d += 8) {
                    const __m256 k = sym8<KIND == K_INT4>(code, d, s8);
                    for (int r = 0; r < NR; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * D + d), k, acc[r]);
                }
            }
        }
        for (int r = 0; r < NR; ++r) _mm256_store_ps(ab + (r * 8 + t) * 8, acc[r]);
    }
}

template <int KIND>
inline void dots8_rows(int64_t nr, const Seg& sg, int64_t b, int64_t h, int64_t j, int64_t D, int64_t ng, const float* q,
                       float* ab, float* gm, float* km) {
    if (nr == 4) dots8<4, KIND>(sg, b, h, j, D, ng, q, ab, gm, km);
    else if (nr == 3) dots8<3, KIND>(sg, b, h, j, D, ng, q, ab, gm, km);
    else if (nr == 2) dots8<2, KIND>(sg, b, h, j, D, ng, q, ab, gm, km);
    else dots8<1, KIND>(sg, b, h, j, D, ng, q, ab, gm, km);
}
#endif

#if KVCERT_AVX2
// The output sums o_r += w_rj v~_j over tokens [j0, j1) of segment 0 when its values are of a register kind (row_kind)
// and D is a multiple of 32: v~ decoded in registers as seg_row decodes it (symmetric: code * scale, exact; asymmetric:
// fl(code * scale + zero), asym_row's operations; fp8: fp8_row's), 32 channels at a time, used by NR <= 3 rows at once (NR x 4
// accumulators, kept in po between calls), each (row, channel) the same fma sequence in token order as the buffered loop
// in run (a row skips w = 0 as it does): the same bits. lg: the (b, h) logits base ([R][N] weights).
template <int NR, bool ONE_SCALE, int KIND>
void out_rows(const Seg& sg, int64_t b, int64_t h, int64_t j0, int64_t j1, int64_t D, int64_t ng, const float* lg,
              int64_t N, float* po) {
    const int64_t gw = quot(D, ng);
    const int bits = KIND == K_ASYM ? sg.vasym : 8;
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
        int64_t gi[4];  // the scale group of each 8 channels (ONE_SCALE: one group holds all 32)
        for (int c = 0; c < 4; ++c) gi[c] = quot(d0 + 8 * c, gw);
        __m256 acc[NR][4];
        for (int r = 0; r < NR; ++r)
            for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_loadu_ps(po + r * D + d0 + 8 * c);
        for (int64_t j = j0; j < j1; ++j) {
            const uint8_t* code = KIND == K_ASYM ? (const uint8_t*)sg.v + b * sg.v_sb + h * sg.v_sh + j * (D * bits / 8)
                                                 : (const uint8_t*)sg.v + row_off(sg, sg.v_sb, sg.v_sh, b, h, j, KIND == K_INT4 ? D / 2 : D);
            float w[NR];
            bool all = true;
            for (int r = 0; r < NR; ++r) {
                w[r] = lg[r * N + j];
                all = all && w[r] != 0.0f;
            }
            if (KIND == K_FP8) {  // fp8_row's operations: fl(fl(fl(c pre) s) post)
                const float s = sg.vs8 ? sg.vs8[row_off(sg, sg.vs_sb, sg.vs_sh, b, h, j, 1)] : sg.f8scale;
                const __m256 pre8 = _mm256_set1_ps(sg.f8pre), s8 = _mm256_set1_ps(s), post8 = _mm256_set1_ps(sg.f8post);
                for (int c = 0; c < 4; ++c) {
                    const __m256 v = fp8_8(code + d0 + 8 * c, sg.f8fmt, pre8, s8, post8);
                    for (int r = 0; r < NR; ++r)
                        if (all || w[r] != 0.0f) acc[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(w[r]), v, acc[r][c]);
                }
                continue;
            }
            const uint16_t* sc = KIND == K_ASYM ? sg.vs + b * sg.vs_sb + h * sg.vs_sh + j * ng : sg.vs + row_off(sg, sg.vs_sb, sg.vs_sh, b, h, j, ng);
            const uint16_t* zc = KIND == K_ASYM ? sg.vz + b * sg.vz_sb + h * sg.vz_sh + j * ng : nullptr;
            const __m256 s1 = _mm256_set1_ps(half_to_float(sc[gi[0]]));
            const __m256 z1 = KIND == K_ASYM ? _mm256_set1_ps(half_to_float(zc[gi[0]])) : s1;
            for (int c = 0; c < 4; ++c) {
                const __m256 sv = ONE_SCALE ? s1 : _mm256_set1_ps(half_to_float(sc[gi[c]]));
                __m256 v;
                if (KIND == K_ASYM)
                    v = asym8(code, bits, d0 + 8 * c, sv, ONE_SCALE ? z1 : _mm256_set1_ps(half_to_float(zc[gi[c]])));
                else
                    v = sym8<KIND == K_INT4>(code, d0 + 8 * c, sv);
                for (int r = 0; r < NR; ++r)
                    if (all || w[r] != 0.0f) acc[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(w[r]), v, acc[r][c]);
            }
        }
        for (int r = 0; r < NR; ++r)
            for (int c = 0; c < 4; ++c) _mm256_storeu_ps(po + r * D + d0 + 8 * c, acc[r][c]);
    }
}

template <int KIND>
void out_rows_n(int64_t nr, bool one, const Seg& sg, int64_t b, int64_t h, int64_t j0, int64_t j1, int64_t D, int64_t ng,
                const float* lg, int64_t N, float* po) {
    if (one) {
        if (nr == 3) out_rows<3, true, KIND>(sg, b, h, j0, j1, D, ng, lg, N, po);
        else if (nr == 2) out_rows<2, true, KIND>(sg, b, h, j0, j1, D, ng, lg, N, po);
        else out_rows<1, true, KIND>(sg, b, h, j0, j1, D, ng, lg, N, po);
    } else {
        if (nr == 3) out_rows<3, false, KIND>(sg, b, h, j0, j1, D, ng, lg, N, po);
        else if (nr == 2) out_rows<2, false, KIND>(sg, b, h, j0, j1, D, ng, lg, N, po);
        else out_rows<1, false, KIND>(sg, b, h, j0, j1, D, ng, lg, N, po);
    }
}

// out_rows over every row of a chunk's segment-0 tokens [j0, j1); returns the first token it did not read (j0 when the
// values are of no register kind, D is not a multiple of 32, or R > 8: many rows, the buffered loop decodes once)
int64_t reg_out(const Args& a, int64_t b, int64_t h, int64_t j0, int64_t j1, const float* lg, int64_t N, int64_t R, float* po) {
    const Seg& sg = a.seg[0];
    const int kind = j1 > j0 ? row_kind(sg, true, a.ngv, a.D) : -1;
    if (kind < 0 || a.D % 32 || R > 8) return j0;
    const bool one = quot(a.D, a.ngv) % 32 == 0;
    for (int64_t r0 = 0; r0 < R; r0 += 3) {
        const int64_t nr = std::min<int64_t>(3, R - r0);
        const float* l = lg + r0 * N;
        float* p = po + r0 * a.D;
        if (kind == K_INT8) out_rows_n<K_INT8>(nr, one, sg, b, h, j0, j1, a.D, a.ngv, l, N, p);
        else if (kind == K_INT4) out_rows_n<K_INT4>(nr, one, sg, b, h, j0, j1, a.D, a.ngv, l, N, p);
        else if (kind == K_ASYM) out_rows_n<K_ASYM>(nr, one, sg, b, h, j0, j1, a.D, a.ngv, l, N, p);
        else out_rows_n<K_FP8>(nr, one, sg, b, h, j0, j1, a.D, a.ngv, l, N, p);
    }
    return j1;
}
#endif

#if KVCERT_AVX2
// Pass 1's end for row r and 8 tokens [j, j + 8): the logits x stored, their NaN check added in (x * 0), and the row's
// readable flags (readable, and at a position the row sees)
inline void store_logits8(__m256 x, float* lg, uint8_t* okr, int64_t N, int64_t r, int64_t j, const uint8_t* vj,
                          const int64_t* pj, int64_t qp, __m256& nanv) {
    _mm256_storeu_ps(lg + r * N + j, x);
    nanv = _mm256_add_ps(nanv, _mm256_mul_ps(x, _mm256_setzero_ps()));
    for (int t = 0; t < 8; ++t) okr[r * N + j + t] = vj[t] && pj[t] <= qp;
}
#endif

// kappa_b >= s ||q_b|| for n query rows q [n, D] and the NB bands [NB, W] (coordinate indices), as
// fast.core.certify.band_norms_up: squares exact in fp64, the W-term sum and sqrt within gamma_{W+4}, times
// margin = 1 + 2 gamma_{W+4}, one ulp up; times s, one ulp up; at least 2^-60 (k64 [n, NB]); cast to fp32
// rounded up (k32 [n, NB]). Four bands at a time in AVX2 when s > 0 (the same operations per lane, so the
// same bits; every value up() meets is then >= +0, +inf or NaN, where up4 is up). Returns the sum of
// k32 * 0: NaN when a kappa is not finite. tests/test_cpu_fused.py checks both builds bit for bit and
// k64 >= s ||q_b|| exactly (kvcert_kappa).
float kappa_rows(const float* q, int64_t n, int64_t D, const int64_t* bd, int64_t NB, int64_t W, double s64, double margin,
                 double* k64, float* k32) {
    for (int64_t i = 0; i < n; ++i) {
        const float* qq = q + i * D;
        int64_t k = 0;
#if KVCERT_AVX2
        if (s64 > 0 && s64 < INFINITY) {
            const __m256d m4 = _mm256_set1_pd(margin), s4 = _mm256_set1_pd(s64), lo = _mm256_set1_pd(0x1p-60);
            for (; k + 4 <= NB; k += 4) {
                __m256d ss = _mm256_setzero_pd();
                for (int64_t w = 0; w < W; ++w) {
                    const __m256d x = _mm256_setr_pd(qq[bd[k * W + w]], qq[bd[(k + 1) * W + w]], qq[bd[(k + 2) * W + w]], qq[bd[(k + 3) * W + w]]);
                    ss = _mm256_add_pd(ss, _mm256_mul_pd(x, x));
                }
                const __m256d nrm = up4(_mm256_mul_pd(_mm256_sqrt_pd(ss), m4));
                _mm256_storeu_pd(k64 + i * NB + k, _mm256_max_pd(lo, up4(_mm256_mul_pd(nrm, s4))));  // NaN stays (second operand)
            }
        }
#endif
        for (; k < NB; ++k) {
            double ss = 0.0;
            for (int64_t w = 0; w < W; ++w) {
                const double x = (double)qq[bd[k * W + w]];
                ss += x * x;
            }
            const double nrm = up(std::sqrt(ss) * margin);
            k64[i * NB + k] = std::max(up(nrm * s64), 0x1p-60);
        }
    }
    float nan = 0.0f;
    for (int64_t i = 0; i < n * NB; ++i) {
        float f = (float)k64[i];
        if ((double)f < k64[i]) f = upf(f);
        k32[i] = f;
        nan += f * 0.0f;
    }
    return nan;
}

// The histogram of c^ for the box form (fast.core.box.hist_box): bin of c^ >= 0 by the float grid (1 + i/16) 2^e it
// rounds up to, from its bits (the exponent and the top 4 mantissa bits, the rest rounded up: key = ceil(bits / 2^19));
// keys at or below HIST_KEY0 (c^ <= 2^-14) go to bin 0, keys above HIST_KEY1 (c^ > 2^8, NaN, a sign bit) to the
// overflow bin HIST_K - 1 (its row's box is 1).
constexpr int64_t HIST_KEY0 = 113 << 4, HIST_KEY1 = 135 << 4, HIST_K = HIST_KEY1 - HIST_KEY0 + 2;
inline int64_t hist_bin(float c) {
    uint32_t bits;
    std::memcpy(&bits, &c, 4);
    const int64_t key = ((int64_t)bits + 0x7FFFF) >> 19;
    return key <= HIST_KEY0 ? 0 : key > HIST_KEY1 ? HIST_K - 1 : key - HIST_KEY0;
}

// One chunk's histogram for one row: hs [3 HIST_K] gets, per bin, the sum of w (fp64, in token order), the count and
// the largest c^ of the chunk's tokens the row reads (o[j] != 0, or every token when o is null; a token it does not
// read has q = 0 and is left out), c [L] their c^. Only bins hr[0] .. hr[1] (the range of the bins present, zeroed
// first; {HIST_K, -1} when none) are written: the rest of hs is stale and never read.
inline void hist_chunk(double* hs, int64_t* hr, const float* c, const float* w, const uint8_t* o, int64_t L) {
    static thread_local std::vector<int16_t> kbuf;
    if (kbuf.size() < (size_t)L) kbuf.resize((size_t)L);
    int16_t* kb = kbuf.data();
    int64_t lo = HIST_K, hi = -1;
    for (int64_t j = 0; j < L; ++j) {
        const int64_t k = (!o || o[j]) ? hist_bin(c[j]) : -1;
        kb[j] = (int16_t)k;
        if (k >= 0) lo = std::min(lo, k), hi = std::max(hi, k);
    }
    for (int64_t k = lo; k <= hi; ++k) hs[k] = hs[HIST_K + k] = hs[2 * HIST_K + k] = 0.0;
    for (int64_t j = 0; j < L; ++j) {
        const int64_t k = kb[j];
        if (k < 0) continue;
        hs[k] += (double)w[j];
        hs[HIST_K + k] += 1.0;
        hs[2 * HIST_K + k] = std::max(hs[2 * HIST_K + k], (double)c[j]);
    }
    hr[0] = lo;
    hr[1] = hi;
}

// One row's histogram out: its occupied bins (acc [3 HIST_K]: sums of w, counts, largest c^) in increasing order into
// ho [3 M] (largest c^, +inf for the overflow bin; sum of w; count), zeros after. While more than M are occupied, the
// neighbours i, i + 1 whose merge widens least, W_i (c_i+1 - c_i) (the lowest i on a tie; NaN counts as +inf), merge:
// the larger c^, the sums of w and counts added. Any grouping is sound for the box (each token's interval widened to
// its group's, then T9c); this one keeps the widening small where the weight is.
inline void hist_emit(const double* acc, double* ho, int64_t M) {
    double c[HIST_K], w[HIST_K], n[HIST_K];
    int64_t m = 0;
    for (int64_t k = 0; k < HIST_K; ++k)
        if (acc[HIST_K + k] > 0) {
            c[m] = k == HIST_K - 1 ? INFINITY : acc[2 * HIST_K + k];
            w[m] = acc[k];
            n[m] = acc[HIST_K + k];
            ++m;
        }
    for (; m > M; --m) {
        int64_t best = 0;
        double least = INFINITY;
        for (int64_t i = 0; i + 1 < m; ++i) {
            const double cost = w[i] * (c[i + 1] - c[i]);
            if (cost < least) least = cost, best = i;
        }
        w[best + 1] = w[best] + w[best + 1];
        n[best + 1] = n[best] + n[best + 1];
        for (int64_t i = best; i + 1 < m; ++i) c[i] = c[i + 1], w[i] = w[i + 1], n[i] = n[i + 1];
    }
    for (int64_t i = 0; i < M; ++i) {
        const bool on = i < m;
        ho[i] = on ? c[i] : 0.0;
        ho[M + i] = on ? w[i] : 0.0;
        ho[2 * M + i] = on ? n[i] : 0.0;
    }
}

inline double tree8(const double* x) { return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7])); }

// One row's sums over a chunk of L tokens: w the weights, o the readable mask, rt the witness band-major
// [NB][L] (null: not certified), kap the row's kappa. c_j = fl(sum_b kappa_b rho_jb) by fma in band order;
// Z = sum w, S1 = sum w c, S2 = sum (w c) c in fp64 (w c exact: 24 x 24 bits), max c over readable tokens.
// 8 lanes (token jj goes to lane jj % 8), then the tree of tree8: the AVX2 loop adds the same numbers in
// the same order as the scalar tail, so both builds give the same bits. out: Z, S1, S2, max c. o null: every
// token of the chunk is readable (the max over all of them, the same value). hs, hr (not null, rt not null): the
// chunk's histogram of c and its range of bins (hist_chunk).
inline void row_sums(const float* w, const uint8_t* o, const float* rt, const float* kap, int64_t NB, int64_t L, double* out,
                     double* hs = nullptr, int64_t* hr = nullptr) {
    static thread_local std::vector<float> cbuf;  // the chunk's c^ for the histogram
    if (hs && cbuf.size() < (size_t)L) cbuf.resize((size_t)L);
    float* cs = hs ? cbuf.data() : nullptr;
    alignas(32) double lz[8] = {0, 0, 0, 0, 0, 0, 0, 0}, l1[8] = {0, 0, 0, 0, 0, 0, 0, 0}, l2[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    float cm = 0.0f;
    int64_t jj = 0;
#if KVCERT_AVX2
    {
        __m256d za = _mm256_setzero_pd(), zb = za, s1a = za, s1b = za, s2a = za, s2b = za;
        __m256 cmv = _mm256_setzero_ps();
        const __m256i zi = _mm256_setzero_si256();
        for (; jj + 8 <= L; jj += 8) {
            const __m256 wv = _mm256_loadu_ps(w + jj);
            const __m256d wa = _mm256_cvtps_pd(_mm256_castps256_ps128(wv)), wb = _mm256_cvtps_pd(_mm256_extractf128_ps(wv, 1));
            za = _mm256_add_pd(za, wa);
            zb = _mm256_add_pd(zb, wb);
            if (!rt) continue;
            __m256 c = _mm256_setzero_ps();
            for (int64_t k = 0; k < NB; ++k) c = _mm256_fmadd_ps(_mm256_set1_ps(kap[k]), _mm256_loadu_ps(rt + k * L + jj), c);
            __m256 cr = c;  // c at the tokens the row reads, else 0
            if (o) {
                const __m256i om = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(o + jj)));
                cr = _mm256_and_ps(c, _mm256_castsi256_ps(_mm256_cmpgt_epi32(om, zi)));
            }
            cmv = _mm256_max_ps(cmv, cr);
            if (cs) _mm256_storeu_ps(cs + jj, c);
            const __m256d ca = _mm256_cvtps_pd(_mm256_castps256_ps128(c)), cb = _mm256_cvtps_pd(_mm256_extractf128_ps(c, 1));
            const __m256d wca = _mm256_mul_pd(wa, ca), wcb = _mm256_mul_pd(wb, cb);
            s1a = _mm256_add_pd(s1a, wca);
            s1b = _mm256_add_pd(s1b, wcb);
            s2a = _mm256_add_pd(s2a, _mm256_mul_pd(wca, ca));
            s2b = _mm256_add_pd(s2b, _mm256_mul_pd(wcb, cb));
        }
        _mm256_store_pd(lz, za); _mm256_store_pd(lz + 4, zb);
        _mm256_store_pd(l1, s1a); _mm256_store_pd(l1 + 4, s1b);
        _mm256_store_pd(l2, s2a); _mm256_store_pd(l2 + 4, s2b);
        alignas(32) float cmx[8];
        _mm256_store_ps(cmx, cmv);
        for (int l = 0; l < 8; ++l) cm = std::max(cm, cmx[l]);
    }
#endif
    for (; jj < L; ++jj) {
        const int l = (int)(jj % 8);
        const double wd = (double)w[jj];
        lz[l] += wd;
        if (!rt) continue;
        float c = 0.0f;
        for (int64_t k = 0; k < NB; ++k) c = std::fma(kap[k], rt[k * L + jj], c);
        const double cd = (double)c, wc = wd * cd;
        l1[l] += wc;
        l2[l] += wc * cd;
        const float cr = (!o || o[jj]) ? c : 0.0f;
        cm = std::max(cm, cr);
        if (cs) cs[jj] = c;
    }
    out[0] = tree8(lz);
    out[1] = tree8(l1);
    out[2] = tree8(l2);
    out[3] = (double)cm;
    if (hs) hist_chunk(hs, hr, cs, w, o, L);
}

constexpr double STEP_MARGIN = 1.0 + 0x1p-10;      // fast.core.quant.STEP_MARGIN: delta = scale (1 + 2^-10)
constexpr double BIAS_RHO = 3.0 * 0x1p-17;         // fast.core.dither.BIAS_RHO

// The dither radius in place of the witness bound (fast.core.dither.dither_radius, T6i), per token of a chunk's quantized
// part and query row:
//   c_j >= s (F sqrt(sum_g sq_g d_g^2 / 12) + BIAS_RHO sum_g ab_g d_g),
// d_g = |fp16 key scale of group g| STEP_MARGIN (exact in fp64, d_g^2 too: 22 bits; dither_steps, once per chunk for its
// rows), sq_g / ab_g the fp64 sums of q_i^2 / |q_i| over the group (coef [2 ng]; squares exact), F >= sqrt(2 ln(2 n / d)).
// All terms nonnegative: at most 5 D + 10 <= 2570 roundings of u64 (relative error < 2.9e-13 < 2^-40), none below the
// normal range but the last product's (absolute 2^-1074 each: + 2^-1000 covers it); times 1 + 2^-40, one ulp up, cast
// to fp32 rounded up. dither_radii writes c [L] (AVX2: 4 tokens per register, the scalar loop's operations in its order,
// so the same bits); dither_sums then adds S1 = sum w c, S2 = sum (w c) c (w c exact, one rounding more: the epilogue's
// margins) and max c over the readable tokens that are not exact (the fp32 segment and exact tokens: radius 0).
// Asymmetric keys (kivi2_dither: sg.kasym, ng = D): d_g per channel, max(|scale|, |zero| 2^-7) STEP_MARGIN of the token's
// block (fast.core.quant.kivi_dither_step, ZERO_REL = 2^-7; exact in fp64 as in fp32).
inline void dither_steps(const Seg& sg, int64_t b, int64_t h, int64_t j0, int64_t jq, int64_t ng, int64_t L, double* dd) {
    if (sg.kasym) {
        for (int64_t j = j0; j < jq; ++j) {
            const uint16_t* sc = sg.ks + b * sg.ks_sb + h * sg.ks_sh + (j / sg.kblk) * ng;
            const uint16_t* zc = sg.kz + b * sg.kz_sb + h * sg.kz_sh + (j / sg.kblk) * ng;
            for (int64_t g = 0; g < ng; ++g)
                dd[g * L + (j - j0)] = std::max(std::fabs((double)half_to_float(sc[g])),
                                                std::fabs((double)half_to_float(zc[g])) * 0x1p-7) * STEP_MARGIN;
        }
        return;
    }
    for (int64_t j = j0; j < jq; ++j) {
        const uint16_t* sc = sg.ks + row_off(sg, sg.ks_sb, sg.ks_sh, b, h, j, ng);
        for (int64_t g = 0; g < ng; ++g) dd[g * L + (j - j0)] = std::fabs((double)half_to_float(sc[g])) * STEP_MARGIN;
    }
}

inline void dither_radii(const double* dd, int64_t n, int64_t L, int64_t ng, const double* coef, double F, double s, float* c) {
    int64_t j = 0;
#if KVCERT_AVX2
    const __m256d f4 = _mm256_set1_pd(F), s4 = _mm256_set1_pd(s), twelve = _mm256_set1_pd(12.0), br = _mm256_set1_pd(BIAS_RHO);
    const __m256d mg = _mm256_set1_pd(1.0 + 0x1p-40), tiny = _mm256_set1_pd(0x1p-1000);
    for (; j + 4 <= n; j += 4) {
        __m256d var = _mm256_setzero_pd(), bias = _mm256_setzero_pd();
        for (int64_t g = 0; g < ng; ++g) {
            const __m256d d = _mm256_loadu_pd(dd + g * L + j);
            var = _mm256_add_pd(var, _mm256_mul_pd(_mm256_set1_pd(coef[2 * g]), _mm256_mul_pd(d, d)));
            bias = _mm256_add_pd(bias, _mm256_mul_pd(_mm256_set1_pd(coef[2 * g + 1]), d));
        }
        const __m256d t = _mm256_add_pd(_mm256_mul_pd(f4, _mm256_sqrt_pd(_mm256_div_pd(var, twelve))), _mm256_mul_pd(br, bias));
        const __m256d cd = up4(_mm256_add_pd(_mm256_mul_pd(_mm256_mul_pd(t, s4), mg), tiny));
        // to fp32 rounded up: the nearest float, its bits + 1 where it lies below (a positive float; +inf and NaN stay)
        const __m128 cf = _mm256_cvtpd_ps(cd);
        const __m256i below = _mm256_castpd_si256(_mm256_cmp_pd(_mm256_cvtps_pd(cf), cd, _CMP_LT_OQ));
        const __m128i low = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(below, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6)));
        _mm_storeu_ps(c + j, _mm_castsi128_ps(_mm_sub_epi32(_mm_castps_si128(cf), low)));
    }
#endif
    for (; j < n; ++j) {
        double var = 0.0, bias = 0.0;
        for (int64_t g = 0; g < ng; ++g) {
            const double d = dd[g * L + j];
            var = var + coef[2 * g] * (d * d);
            bias = bias + coef[2 * g + 1] * d;
        }
        const double cd = up((F * std::sqrt(var / 12.0) + BIAS_RHO * bias) * s * (1.0 + 0x1p-40) + 0x1p-1000);
        float cf = (float)cd;
        if ((double)cf < cd) cf = upf(cf);
        c[j] = cf;
    }
}

inline void dither_sums(const Seg& sg, const float* w, const uint8_t* o, const float* c, int64_t b, int64_t h, int64_t j0,
                        int64_t jq, double* out) {
    double s1 = 0.0, s2 = 0.0;
    float cm = 0.0f;
    for (int64_t j = j0; j < jq; ++j) {
        if (!o[j - j0] || (sg.exact && sg.exact[b * sg.ex_sb + h * sg.ex_sh + j])) continue;
        const double cd = (double)c[j - j0], wc = (double)w[j - j0] * cd;
        s1 += wc;
        s2 += wc * cd;
        cm = std::max(cm, c[j - j0]);
    }
    out[0] = s1;
    out[1] = s2;
    out[2] = (double)cm;
}

void run_args(const Args& a);

// the tokens [j0, j1) of chunk c of sequence b: its own length and chunk size (Seg.lens, lchunk: paged segment 0), or
// chunks of CH over all N; empty (j0 = j1) past the sequence's last chunk
inline void chunk_of(const Args& a, int64_t b, int64_t c, int64_t N, int64_t CH, int64_t& j0, int64_t& j1) {
    const Seg& sg = a.seg[0];
    const int64_t n = sg.lens ? (int64_t)sg.lens[b] : N, ch = sg.lens ? (int64_t)sg.lchunk[b] : CH;
    j0 = std::min(c * ch, n);
    j1 = std::min(n, j0 + ch);
}

// The kernel on a copy of the arguments with the fields it sets itself (Seg.f8fmt)
void run(const Args& in) {
    Args a = in;
    for (Seg& sg : a.seg) {
        sg.f8fmt = 0;
#if KVCERT_AVX2
        if (sg.n && sg.fp8) sg.f8fmt = fp8_format(sg.f8lut);
#endif
    }
    run_args(a);
}

void run_args(const Args& a) {
    const int64_t B = a.B, T = a.T, H = a.H, Hkv = a.Hkv, D = a.D, NB = a.NB;
    const int64_t G = H / Hkv, R = T * G;
    const int64_t N0 = a.seg[0].n, N1 = a.seg[1].n, N = N0 + N1;
    const int64_t CH = a.chunk;
    int64_t nch = (N + CH - 1) / CH;
    if (a.seg[0].lens) {  // per-sequence chunks: as many work items per (b, h) as the sequence with the most chunks
        nch = 1;
        for (int64_t b = 0; b < B; ++b) nch = std::max<int64_t>(nch, (a.seg[0].lens[b] + a.seg[0].lchunk[b] - 1) / a.seg[0].lchunk[b]);
    }
    const int64_t items = B * Hkv * nch;
    static thread_local std::vector<float> logits, pmax, pout, pkmax, pnan;
    static thread_local std::vector<uint8_t> okmask;
    static thread_local std::vector<double> psum;
    logits.resize((size_t)(B * Hkv * R * N));
    okmask.resize((size_t)(B * Hkv * R * N));
    pmax.resize((size_t)(items * R));
    pout.resize((size_t)(items * R * D));
    psum.resize((size_t)(items * R * 4));
    pkmax.resize((size_t)(items * 2 * D));
    pnan.resize((size_t)items);
    // raw pointers: inside the parallel regions a thread_local name would be the worker's own
    float* LG = logits.data();
    uint8_t* OK = okmask.data();
    float* PMAX = pmax.data();
    float* POUT = pout.data();
    double* PSUM = psum.data();
    float* PKMAX = pkmax.data();
    float* PNAN = pnan.data();
    static thread_local std::vector<float> kappa_buf;
    kappa_buf.resize((size_t)(B * T * H * NB));
    float* KAPPA = kappa_buf.data();
    static thread_local std::vector<double> k64_buf;
    k64_buf.resize((size_t)(B * T * H * NB));
    double* K64 = k64_buf.data();
    // the dither radius' per-row sums over each key scale group: sq_g = sum q_i^2, ab_g = sum |q_i| (dither_sums)
    // (asymmetric keys: a step per channel, so D groups of one channel)
    static thread_local std::vector<double> pvst;
    static thread_local std::vector<float> pvmax;
    if (a.vstats) {
        pvst.resize((size_t)(items * R * 3));
        pvmax.resize((size_t)(items * D));
    }
    double* PV = pvst.data();
    static thread_local std::vector<double> phist;  // [items, R, 3 HIST_K]: each chunk's histogram (row_sums)
    static thread_local std::vector<int64_t> phr;   // [items, R, 2]: its range of bins
    if (a.hist) {
        phist.resize((size_t)(items * R * 3 * HIST_K));
        phr.resize((size_t)(items * R * 2));
    }
    double* PHIST = phist.data();
    int64_t* PHR = phr.data();
    float* PVM = pvmax.data();
    static thread_local std::vector<double> dcoef, psum2;
    const int64_t dng = a.seg[0].kasym ? D : a.ngk;
    if (a.dstats) {
        const int64_t gw = D / dng;
        dcoef.resize((size_t)(B * T * H * 2 * dng));
        psum2.resize((size_t)(items * R * 3));
        for (int64_t r = 0; r < B * T * H; ++r)
            for (int64_t g = 0; g < dng; ++g) {
                double sq = 0.0, ab = 0.0;
                for (int64_t d = g * gw; d < (g + 1) * gw; ++d) {
                    const double x = (double)a.q[r * D + d];
                    sq += x * x;
                    ab += std::fabs(x);
                }
                dcoef[(size_t)((r * dng + g) * 2)] = sq;
                dcoef[(size_t)((r * dng + g) * 2 + 1)] = ab;
            }
    }
    const double* DCOEF = dcoef.data();
    double* PSUM2 = psum2.data();
    float nan_q = 0.0f;
    if (a.certify) nan_q = kappa_rows(a.q, B * T * H, D, a.bands, NB, a.W, a.s64, a.band_margin, K64, KAPPA);

    // the witness table's shape, checked once per call (256 entries; not per work item)
    [[maybe_unused]] const int grid = a.certify && KVCERT_AVX2 ? lut_grid(a.lut) : 0;  // codes per octave, 0: gather

    // ---- pass 1: logits (reads the key codes once) ----
#pragma omp parallel for schedule(static) num_threads(a.threads)
    for (int64_t it = 0; it < items; ++it) {
        const int64_t b = it / (Hkv * nch), h = (it / nch) % Hkv, c = it % nch;
        int64_t j0, j1;
        chunk_of(a, b, c, N, CH, j0, j1);
        float* lg = LG + (b * Hkv + h) * R * N;
        float* km = PKMAX + it * 2 * D;  // [0, D): max scale, [D, 2D): max |k| of fp32 rows
        for (int64_t d = 0; d < 2 * D; ++d) km[d] = 0.0f;
        float nan_acc = 0.0f;
        std::vector<float> qr((size_t)(R * D));
        for (int64_t t = 0; t < T; ++t)
            for (int64_t g = 0; g < G; ++g)
                std::memcpy(&qr[(t * G + g) * D], a.q + ((b * T + t) * H + h * G + g) * D, D * 4);
        std::vector<int64_t> qpr((size_t)R);  // the position of each row (no division in the token loop)
        for (int64_t r = 0; r < R; ++r) qpr[r] = a.qpos[b * T + r / G];
        float kf[512], gm[512];
        for (int64_t g = 0; g < a.ngk; ++g) gm[g] = 0.0f;
        uint8_t* okr = OK + (b * Hkv + h) * R * N;  // readable mask, reused by pass 2
        int64_t j = j0;
#if KVCERT_AVX2
        // blocks of 8 quantized tokens: dequantize them into kb (exact, as seg_row), then per row 8
        // accumulators of 8 lanes (lane l sums d = l, l + 8, ... by fma in order, as the scalar loop) and
        // the lanes of the 8 tokens added in one transpose (hadd): ((a0+a1)+(a2+a3))+((a4+a5)+(a6+a7)),
        // the scalar tree.
        alignas(32) float kb[8 * 512];
        __m256 nanv = _mm256_setzero_ps();
        const __m256 sv8 = _mm256_set1_ps(a.s);
        if (a.seg[0].k_t && a.seg[0].bs % 8 == 0 && !a.seg[0].coded) {
            // keys transposed per block ([D, bs], vLLM's CPU cache): 8 tokens of one block side by side in a
            // register (j0 and bs are multiples of 8), acc[l] is lane l of the scalar dot product (d = l, l + 8,
            // ... by fma in order) for the 8 tokens at once, and the scalar tree is vertical: the same bits
            const Seg& sg = a.seg[0];
            alignas(32) float kmx[8 * 512];  // per channel, 8 lanes: max |k| over the chunk's tokens
            std::fill(kmx, kmx + 8 * D, 0.0f);
            const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
            for (; j + 8 <= std::min(j1, N0); j += 8) {
                const float* kt = (const float*)sg.k + (int64_t)sg.table[b * sg.tb_sb + j / sg.bs] * sg.k_sb + h * sg.k_sh + j % sg.bs;
                for (int64_t d = 0; d < D; ++d)
                    _mm256_store_ps(kmx + 8 * d, _mm256_max_ps(_mm256_load_ps(kmx + 8 * d), _mm256_and_ps(_mm256_loadu_ps(kt + d * sg.bs), absm)));
                uint8_t vj[8];
                int64_t pj[8];
                block_flags(sg, b, h, j, vj, pj);
                for (int64_t r = 0; r < R; ++r) {
                    const float* qq = &qr[r * D];
                    __m256 acc[8];
                    for (int l = 0; l < 8; ++l) acc[l] = _mm256_setzero_ps();
                    for (int64_t d = 0; d < D; d += 8)
                        for (int l = 0; l < 8; ++l)
                            acc[l] = _mm256_fmadd_ps(_mm256_set1_ps(qq[d + l]), _mm256_loadu_ps(kt + (d + l) * sg.bs), acc[l]);
                    const __m256 dot = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])),
                                                     _mm256_add_ps(_mm256_add_ps(acc[4], acc[5]), _mm256_add_ps(acc[6], acc[7])));
                    const __m256 x = _mm256_mul_ps(dot, sv8);
                    store_logits8(x, lg, okr, N, r, j, vj, pj, qpr[r], nanv);
                }
            }
            for (int64_t d = 0; d < D; ++d)
                for (int l = 0; l < 8; ++l) km[D + d] = std::max(km[D + d], kmx[8 * d + l]);
        }
        const int kkind = row_kind(a.seg[0], false, a.ngk, D);
        if (kkind >= 0 && R <= 8) {
            // keys of a register kind: each token's row decoded in registers and dotted with up to 4 rows at once
            // (dots8), then the tree of the loop below: the same bits, no decoded copy written
            const Seg& sg = a.seg[0];
            alignas(32) float ab[4 * 8 * 8];
            for (; j + 8 <= std::min(j1, N0); j += 8) {
                uint8_t vj[8];
                int64_t pj[8];
                block_flags(sg, b, h, j, vj, pj);
                for (int64_t r0 = 0; r0 < R; r0 += 4) {
                    const int64_t nr = std::min<int64_t>(4, R - r0);
                    const float* q0 = &qr[r0 * D];
                    if (kkind == K_INT8) dots8_rows<K_INT8>(nr, sg, b, h, j, D, a.ngk, q0, ab, gm, km);
                    else if (kkind == K_INT4) dots8_rows<K_INT4>(nr, sg, b, h, j, D, a.ngk, q0, ab, gm, km);
                    else if (kkind == K_ASYM) dots8_rows<K_ASYM>(nr, sg, b, h, j, D, a.ngk, q0, ab, gm, km);
                    else dots8_rows<K_FP8>(nr, sg, b, h, j, D, a.ngk, q0, ab, gm, km);
                    for (int64_t r = r0; r < r0 + nr; ++r) {
                        __m256 acc[8];
                        for (int t = 0; t < 8; ++t) acc[t] = _mm256_load_ps(ab + ((r - r0) * 8 + t) * 8);
                        const __m256 x = _mm256_mul_ps(tree_lanes(acc), sv8);
                        store_logits8(x, lg, okr, N, r, j, vj, pj, qpr[r], nanv);
                    }
                }
            }
        }
        for (; j + 8 <= std::min(j1, N0); j += 8) {
            const Seg& sg = a.seg[0];
            uint8_t vj[8];
            int64_t pj[8];
            const float* kp[8];  // kb + t D (codes) or the fp32 row itself
            for (int t = 0; t < 8; ++t)
                kp[t] = seg_row(sg, false, b, h, j + t, D, sg.coded ? a.ngk : 1, kb + t * D, scale_max(sg) ? gm : km);
            block_flags(sg, b, h, j, vj, pj);
            for (int64_t r = 0; r < R; ++r) {
                const float* qq = &qr[r * D];
                __m256 acc[8];
                for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
                for (int64_t d = 0; d < D; d += 8) {
                    const __m256 qv = _mm256_loadu_ps(qq + d);
                    for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp[t] + d), acc[t]);
                }
                const __m256 x = _mm256_mul_ps(tree_lanes(acc), sv8);
                store_logits8(x, lg, okr, N, r, j, vj, pj, qpr[r], nanv);
            }
        }
        {
            alignas(32) float nn[8];
            _mm256_store_ps(nn, nanv);
            for (int t = 0; t < 8; ++t) nan_acc += nn[t];
        }
#endif
        for (; j < j1; ++j) {
            const bool quant = j < N0;
            const Seg& sg = a.seg[quant ? 0 : 1];
            const int64_t jj = quant ? j : j - N0;
            const float* kr = seg_row(sg, false, b, h, jj, D, quant ? a.ngk : 1, kf, scale_max(sg) ? gm : km);
            const bool vj = !sg.valid || sg.valid[b * sg.va_sb + h * sg.va_sh + jj];
            const int64_t pj = tok_pos(sg, b, h, jj, quant ? 0 : N0);
            for (int64_t r = 0; r < R; ++r) {
                // fl(q . k~): 8 lane accumulators, then a fixed tree (any order is inside gamma_D)
                const float* qq = &qr[r * D];
                float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                for (int64_t d = 0; d < D; d += 8) {
#pragma omp simd
                    for (int l = 0; l < 8; ++l) acc[l] = std::fma(qq[d + l], kr[d + l], acc[l]);
                }
                const float x = (((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))) * a.s;
                lg[r * N + j] = x;
                nan_acc += x * 0.0f;
                okr[r * N + j] = vj && pj <= qpr[r];
            }
        }
        for (int64_t g = 0; g < a.ngk; ++g)
            for (int64_t d = g * (D / a.ngk); d < (g + 1) * (D / a.ngk); ++d) km[d] = std::max(km[d], gm[g]);
        // row maxima over the readable tokens of this chunk
        float* pm = PMAX + it * R;
        // (a maximum of the same numbers in any order: the same value, a zero's sign aside, which no weight sees:
        // kv_exp(+-0) = 1; NaN logits refuse the read)
        for (int64_t r = 0; r < R; ++r) {
            float m = -INFINITY;
            const float* x = lg + r * N;
            const uint8_t* o = okr + r * N;
            int64_t j = j0;
#if KVCERT_AVX2
            __m256 mv = _mm256_set1_ps(-INFINITY);
            const __m256 ninf = mv;
            for (; j + 8 <= j1; j += 8) {
                const __m256i om = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(o + j)));
                const __m256 ok = _mm256_castsi256_ps(_mm256_cmpgt_epi32(om, _mm256_setzero_si256()));
                mv = _mm256_max_ps(mv, _mm256_blendv_ps(ninf, _mm256_loadu_ps(x + j), ok));
            }
            alignas(32) float mx[8];
            _mm256_store_ps(mx, mv);
            for (int l = 0; l < 8; ++l) m = std::max(m, mx[l]);
#endif
#pragma omp simd reduction(max : m)
            for (int64_t jj = j; jj < j1; ++jj) m = std::max(m, o[jj] ? x[jj] : -INFINITY);
            pm[r] = m;
        }
        PNAN[it] = nan_acc;
    }

    // ---- pass 2: weights, certificate sums, output (reads the value codes and the witness once) ----
#pragma omp parallel for schedule(static) num_threads(a.threads)
    for (int64_t it = 0; it < items; ++it) {
        const int64_t b = it / (Hkv * nch), h = (it / nch) % Hkv, c = it % nch;
        int64_t j0, j1;
        chunk_of(a, b, c, N, CH, j0, j1);
        const int64_t L = j1 - j0;
        float* lg = LG + (b * Hkv + h) * R * N;
        static thread_local std::vector<float> rtbuf;  // the chunk's witness, band-major (this worker's own)
        if (a.certify && rtbuf.size() < (size_t)(NB * L)) rtbuf.resize((size_t)(NB * L));
        float* rt = rtbuf.data();
        const uint8_t* okr = OK + (b * Hkv + h) * R * N + j0;
        // the global row max (all chunks of this (b, h)): a fixed order, the same in every item
        std::vector<float> mrow((size_t)R);
        for (int64_t r = 0; r < R; ++r) {
            float m = -INFINITY;
            for (int64_t cc = 0; cc < nch; ++cc) m = std::max(m, PMAX[((b * Hkv + h) * nch + cc) * R + r]);
            mrow[r] = m;
        }
        // weights in place of the logits: w = kv_exp(fl(x - m)), 0 where the row does not read the token
        for (int64_t r = 0; r < R; ++r) {
            float* x = lg + r * N + j0;
            const uint8_t* o = okr + r * N;
            const float m = mrow[r];
#pragma omp simd
            for (int64_t j = 0; j < L; ++j) {
                x[j] = o[j] ? kv_exp(x[j] - m) : 0.0f;
            }
        }
        double* ps = PSUM + it * R * 4;
        if (a.certify) {
            // the witness of the chunk once, band-major: rt[k][j] = rho_jk (0 at exact and fp32-segment tokens)
            // every column is written once below: decoded, or 0 (exact tokens, no witness, the fp32 segment)
            const Seg& sg = a.seg[0];
            int64_t j = j0;
#if KVCERT_AVX2
            // 8 bands (the default) of log codes, 8 tokens at a time, into band-major order: the byte transpose
            // below on the grid table with the 8 tokens' codes adjacent, else per token (grid decode or table
            // gather) and an 8 x 8 float transpose; the same values as the scalar loop after them
            if (sg.rho && sg.rho_u8 && NB == 8) {
                // the grid's mantissa table: S = 8, mant[m] = lut[160 + m] (both halves alike); S = 16, mant[m] =
                // lut[176 + m], m < 8 in mlo, m >= 8 in mhi; a code's mantissa: the half bit 3 of ci picks (mhalf)
                const int z0 = grid == 16 ? 176 : 160, lg = grid == 16 ? 4 : 3;
                const __m256 mlo = _mm256_loadu_ps(a.lut + z0), mhi = _mm256_loadu_ps(a.lut + z0 + (grid == 16 ? 8 : 0));
                const __m256i bias = _mm256_set1_epi32(z0 >> lg), zero = _mm256_setzero_si256();
                const __m256i top = _mm256_set1_epi32((int)TOP_BITS), c255 = _mm256_set1_epi32(255);
                const __m128i sh_e = _mm_cvtsi32_si128(lg), sh_m = _mm_cvtsi32_si128(23 - lg);
                auto mhalf = [](__m256 lo, __m256 hi, __m256i ci) {  // lo[ci % 8] or hi[ci % 8] by bit 3 of ci
                    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, ci), _mm256_permutevar8x32_ps(hi, ci),
                                            _mm256_castsi256_ps(_mm256_slli_epi32(ci, 28)));
                };
                if (grid && (!sg.bs || sg.bs % 8 == 0)) {
                    // the 8 tokens' 64 code bytes are adjacent (j % 8 == 0, one block): transpose the bytes to
                    // band-major (pshufb pairs two tokens per 128-bit lane, 16-bit unpacks pair four, a dword
                    // permute eight), then decode each band's 8 codes: lut[ci] = mant[ci % S] 2^(ci / S - z0 / S)
                    // (the bits of mant[ci % S] - (z0 / S) 2^23 plus (ci / S) 2^23), 0 at code 0 and exact tokens
                    const __m256i pair = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
                                                          0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
                    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
                    // code ci = S e + m: (ci << (23 - lg)) = (e << 23) + (m << (23 - lg)), so v = madj[m] + (ci << (23 - lg))
                    // with madj[m] = bits(mant[m]) - ((z0 / S) << 23) - (m << (23 - lg)) (wrapping int32 arithmetic, exact)
                    const __m256i m07 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                    const __m256i m8 = _mm256_set1_epi32(grid == 16 ? 8 : 0);
                    const __m256i madj_lo = _mm256_sub_epi32(_mm256_sub_epi32(_mm256_castps_si256(mlo), _mm256_slli_epi32(bias, 23)),
                                                             _mm256_sll_epi32(m07, sh_m));
                    const __m256i madj_hi = _mm256_sub_epi32(_mm256_sub_epi32(_mm256_castps_si256(mhi), _mm256_slli_epi32(bias, 23)),
                                                             _mm256_sll_epi32(_mm256_add_epi32(m07, m8), sh_m));
                    const __m256 alo = _mm256_castsi256_ps(madj_lo), ahi = _mm256_castsi256_ps(madj_hi);
                    for (; j + 8 <= std::min(j1, N0); j += 8) {
                        const uint8_t* rc = (const uint8_t*)sg.rho + row_off(sg, sg.r_sb, sg.r_sh, b, h, j, 8);
                        const __m256i p0 = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i*)rc), pair);         // t0 t1 | t2 t3
                        const __m256i p1 = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i*)(rc + 32)), pair);  // t4 t5 | t6 t7
                        const __m256i x = _mm256_permute2x128_si256(p0, p1, 0x20), y = _mm256_permute2x128_si256(p0, p1, 0x31);
                        // qword k of q03 / q47: the codes of band k / 4 + k of tokens 0..7
                        const __m256i q03 = _mm256_permutevar8x32_epi32(_mm256_unpacklo_epi16(x, y), perm);
                        const __m256i q47 = _mm256_permutevar8x32_epi32(_mm256_unpackhi_epi16(x, y), perm);
                        __m256i exm = zero;
                        if (sg.exact)
                            exm = _mm256_cmpgt_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(sg.exact + b * sg.ex_sb + h * sg.ex_sh + j))), zero);
                        const __m128i qw[4] = {_mm256_castsi256_si128(q03), _mm256_extracti128_si256(q03, 1),
                                               _mm256_castsi256_si128(q47), _mm256_extracti128_si256(q47, 1)};
                        float* dst = rt + (j - j0);
                        for (int k = 0; k < 8; ++k) {
                            const __m128i w = qw[k / 2];
                            const __m256i ci = _mm256_cvtepu8_epi32(k % 2 ? _mm_unpackhi_epi64(w, w) : w);
                            const __m256i v = _mm256_blendv_epi8(_mm256_add_epi32(_mm256_castps_si256(mhalf(alo, ahi, ci)), _mm256_sll_epi32(ci, sh_m)),
                                                                 top, _mm256_cmpeq_epi32(ci, c255));
                            const __m256i z = sg.exact ? _mm256_or_si256(_mm256_cmpeq_epi32(ci, zero), exm) : _mm256_cmpeq_epi32(ci, zero);
                            _mm256_storeu_ps(dst + k * L, _mm256_castsi256_ps(_mm256_andnot_si256(z, v)));
                        }
                    }
                }
                for (; j + 8 <= std::min(j1, N0); j += 8) {
                    __m256 x[8];
                    for (int t = 0; t < 8; ++t) {
                        const bool ex = sg.exact && sg.exact[b * sg.ex_sb + h * sg.ex_sh + j + t];
                        const uint8_t* rc = (const uint8_t*)sg.rho + row_off(sg, sg.r_sb, sg.r_sh, b, h, j + t, 8);
                        const __m256i ci = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)rc));
                        if (ex) {
                            x[t] = _mm256_setzero_ps();
                        } else if (grid) {  // lut[ci] = mant[ci % S] 2^(ci / S - z0 / S); 0 at code 0, TOP_BITS at 255
                            const __m256 m = mhalf(mlo, mhi, ci);
                            const __m256i e = _mm256_slli_epi32(_mm256_sub_epi32(_mm256_srl_epi32(ci, sh_e), bias), 23);
                            const __m256i v = _mm256_blendv_epi8(_mm256_add_epi32(_mm256_castps_si256(m), e), top, _mm256_cmpeq_epi32(ci, c255));
                            x[t] = _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_cmpeq_epi32(ci, zero), v));
                        } else {
                            x[t] = _mm256_i32gather_ps(a.lut, ci, 4);
                        }
                    }
                    transpose8_store(x, rt + (j - j0), L);
                }
            }
#endif
            for (; j < std::min(j1, N0); ++j) {
                if (!sg.rho || (sg.exact && sg.exact[b * sg.ex_sb + h * sg.ex_sh + j])) {
                    for (int64_t k = 0; k < NB; ++k) rt[k * L + (j - j0)] = 0.0f;
                } else if (sg.rho_u8) {
                    const uint8_t* rc = (const uint8_t*)sg.rho + row_off(sg, sg.r_sb, sg.r_sh, b, h, j, NB);
                    for (int64_t k = 0; k < NB; ++k) rt[k * L + (j - j0)] = a.lut[rc[k]];
                } else {
                    const float* rf = (const float*)sg.rho + row_off(sg, sg.r_sb, sg.r_sh, b, h, j, NB);
                    for (int64_t k = 0; k < NB; ++k) rt[k * L + (j - j0)] = rf[k];
                }
            }
            for (int64_t k = 0; k < NB; ++k)
                for (int64_t jj = std::max(j, N0); jj < j1; ++jj) rt[k * L + (jj - j0)] = 0.0f;  // the fp32 segment
            // no valid masks or positions: token j sits at position j, so a row at qpos >= j1 - 1 reads the whole chunk
            const bool plain = !a.seg[0].valid && !a.seg[0].pos && !a.seg[1].valid && !a.seg[1].pos;
            for (int64_t r = 0; r < R; ++r) {
                const int64_t t = r / G, hq = h * G + r % G;
                const bool all = plain && j1 - 1 <= (int64_t)a.qpos[b * T + t];
                row_sums(lg + r * N + j0, all ? nullptr : okr + r * N, rt, KAPPA + ((b * T + t) * H + hq) * NB, NB, L, ps + r * 4,
                         a.hist ? PHIST + (it * R + r) * 3 * HIST_K : nullptr, PHR + (it * R + r) * 2);
            }
        } else {
            for (int64_t r = 0; r < R; ++r) row_sums(lg + r * N + j0, okr + r * N, nullptr, nullptr, 0, L, ps + r * 4);
        }
        if (a.dstats) {  // the dither tier's sums (segment 0 dithered; the caller checks)
            const int64_t jq = std::max(j0, std::min(j1, N0));
            static thread_local std::vector<double> ddbuf;
            static thread_local std::vector<float> cbuf;
            if (ddbuf.size() < (size_t)(dng * L)) ddbuf.resize((size_t)(dng * L));
            if (cbuf.size() < (size_t)L) cbuf.resize((size_t)L);
            dither_steps(a.seg[0], b, h, j0, jq, dng, L, ddbuf.data());
            for (int64_t r = 0; r < R; ++r) {
                const int64_t t = r / G, hq = h * G + r % G;
                dither_radii(ddbuf.data(), jq - j0, L, dng, DCOEF + ((b * T + t) * H + hq) * 2 * dng, a.dF, a.s64, cbuf.data());
                dither_sums(a.seg[0], lg + r * N + j0, okr + r * N, cbuf.data(), b, h, j0, jq, PSUM2 + (it * R + r) * 3);
            }
        }
        if (a.vstats) {  // the output bound's sums: each token's value row decoded again (only with value_bound)
            double* pv = PV + it * R * 3;
            float* vm = PVM + it * D;
            std::fill(pv, pv + R * 3, 0.0);
            std::fill(vm, vm + D, 0.0f);
            const float* ctr = a.vctr ? a.vctr + (b * Hkv + h) * D : nullptr;
            float vf2[512];
            const Seg& s0 = a.seg[0];
            for (int64_t j = j0; j < j1; ++j) {
                const float* vr = value_row(a, b, h, j, vf2);
                double ss = 0.0;
                for (int64_t d = 0; d < D; ++d) {
                    vm[d] = std::max(vm[d], std::fabs(vr[d]));
                    const double x = (double)vr[d] - (ctr ? (double)ctr[d] : 0.0);
                    ss += x * x;
                }
                const double rad = up(std::sqrt(ss) * a.v_margin);
                const bool ex = j >= N0 || !s0.verr || (s0.exact && s0.exact[b * s0.ex_sb + h * s0.ex_sh + j]);
                const double e = ex ? 0.0 : (double)s0.verr[b * s0.ve_sb + h * s0.ve_sh + j];
                for (int64_t r = 0; r < R; ++r) {
                    if (!okr[r * N + (j - j0)]) continue;
                    pv[r * 3] += (double)lg[r * N + j] * e;  // an fp32 product, exact in fp64
                    pv[r * 3 + 1] = std::max(pv[r * 3 + 1], e);
                    pv[r * 3 + 2] = std::max(pv[r * 3 + 2], rad);
                }
            }
        }
        // output: o_r += w_rj v~_j (v~ = code * scale, exact in fp32)
        float* po = POUT + it * R * D;
        std::fill(po, po + R * D, 0.0f);
#if KVCERT_AVX2
        // the chunk's values dequantized VBLK tokens at a time (exact; the block stays in L1), then per row and 64
        // channels 8 register accumulators over the block's tokens in order, kept in po between blocks: the same
        // fma sequence per (row, channel) as below
        constexpr int64_t VBLK = 16;
        alignas(32) float VB[VBLK * 512];
        const float* VR[VBLK];  // each token's fp32 row: in VB (codes) or in place
        const int64_t jv = reg_out(a, b, h, j0, std::min(j1, N0), lg, N, R, po);  // codes decoded in registers
        for (int64_t jb = jv; jb < j1; jb += VBLK) {
            const int64_t nb = std::min(VBLK, j1 - jb);
            for (int64_t j = 0; j < nb; ++j) VR[j] = value_row(a, b, h, jb + j, VB + j * D);
            for (int64_t r = 0; r < R; ++r) {
                const float* wr = lg + r * N + jb;
                for (int64_t d0 = 0; d0 < D; d0 += 64) {
                    const int nc = (int)(std::min<int64_t>(64, D - d0) / 8);
                    float* pr = po + r * D + d0;
                    __m256 acc[8];
                    for (int c = 0; c < nc; ++c) acc[c] = _mm256_loadu_ps(pr + 8 * c);
                    for (int64_t j = 0; j < nb; ++j) {
                        const float w = wr[j];
                        if (w == 0.0f) continue;
                        const __m256 wv = _mm256_set1_ps(w);
                        const float* vr = VR[j] + d0;
                        if (nc == 8) {
                            for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(vr + 8 * c), acc[c]);
                        } else {
                            for (int c = 0; c < nc; ++c) acc[c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(vr + 8 * c), acc[c]);
                        }
                    }
                    for (int c = 0; c < nc; ++c) _mm256_storeu_ps(pr + 8 * c, acc[c]);
                }
            }
        }
#else
        float vf[512];
        for (int64_t j = j0; j < j1; ++j) {
            const float* vr = value_row(a, b, h, j, vf);
            for (int64_t r = 0; r < R; ++r) {
                const float w = lg[r * N + j];
                if (w == 0.0f) continue;
                float* orow = po + r * D;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) orow[d] = std::fma(w, vr[d], orow[d]);
            }
        }
#endif
    }

    // ---- reduce the chunks (fixed order) ----
    float nan_all = nan_q;
    for (int64_t it = 0; it < items; ++it) nan_all += PNAN[it];
    float nan_out = 0.0f;
    for (int64_t b = 0; b < B; ++b) {
        for (int64_t h = 0; h < Hkv; ++h) {
            float* km = a.kmax + (b * Hkv + h) * 2 * D;
            for (int64_t d = 0; d < 2 * D; ++d) km[d] = 0.0f;
            for (int64_t c = 0; c < nch; ++c) {
                const float* p = PKMAX + ((b * Hkv + h) * nch + c) * 2 * D;
                for (int64_t d = 0; d < 2 * D; ++d) km[d] = std::max(km[d], p[d]);
            }
            for (int64_t r = 0; r < R; ++r) {
                const int64_t t = r / G, hq = h * G + r % G;
                double z = 0.0, s1 = 0.0, s2 = 0.0, cm = 0.0;
                float* o = a.out + ((b * T + t) * H + hq) * D;
                for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
                for (int64_t c = 0; c < nch; ++c) {
                    const int64_t it = (b * Hkv + h) * nch + c;
                    const double* ps = PSUM + (it * R + r) * 4;
                    z += ps[0]; s1 += ps[1]; s2 += ps[2]; cm = std::max(cm, ps[3]);
                    const float* po = POUT + (it * R + r) * D;
                    for (int64_t d = 0; d < D; ++d) o[d] += po[d];
                }
                const float zf = (float)z;
                float bad = 0.0f;
                for (int64_t d = 0; d < D; ++d) {
                    o[d] = o[d] / zf;
                    bad += o[d] * 0.0f;
                }
                nan_out += bad;
                // e >= |x^_j - s <q, k~_j>| (fast.core.certify.logit_rounding): s (D + 4) u32 1.01 sum_i |q_i| kmax_i,
                // kmax_i = max(cmax (1 + 2^-23) max scale, max |k| of fp32 rows), cmax = 127 (int8) or 7 (int4) the largest
                // |code| (fast.core.quant.CODE_MAX, as QTensor.max_abs), fp64, last product one ulp up
                const float* qq = a.q + ((b * T + t) * H + hq) * D;
                const double cmax = a.seg[0].int4 ? 7.0 : 127.0;
                double qk = 0.0;
                for (int64_t d = 0; d < D; ++d) {
                    const double kmx = std::max((double)km[d] * cmax * (1.0 + 0x1p-23), (double)km[D + d]);
                    qk += std::fabs((double)qq[d]) * kmx;
                }
                double* st = a.stats + ((b * T + t) * H + hq) * 5;
                st[0] = z; st[1] = s1; st[2] = s2; st[3] = cm;
                // + (2.03 D s + 1) 2^-150: products below the normal range round with an absolute error
                // (proofs/FloatDot.v logit_rounding_le_code_f32, spec T8e; 2.03 > 2.02 pays for this line's fp64 roundings)
                st[4] = up(a.s64 * qk * a.e_coef + (2.03 * (double)D * a.s64 + 1.0) * 0x1p-150);
                if (a.vstats) {
                    double vs = 0.0, em = 0.0, rm = 0.0;
                    for (int64_t c = 0; c < nch; ++c) {
                        const double* pv = PV + (((b * Hkv + h) * nch + c) * R + r) * 3;
                        vs += pv[0]; em = std::max(em, pv[1]); rm = std::max(rm, pv[2]);
                    }
                    double* vo = a.vstats + ((b * T + t) * H + hq) * 3;
                    vo[0] = vs; vo[1] = em; vo[2] = rm;
                }
                if (a.dstats) {
                    double d1 = 0.0, d2 = 0.0, dm = 0.0;
                    for (int64_t c = 0; c < nch; ++c) {
                        const double* pd = PSUM2 + (((b * Hkv + h) * nch + c) * R + r) * 3;
                        d1 += pd[0]; d2 += pd[1]; dm = std::max(dm, pd[2]);
                    }
                    double* ds = a.dstats + ((b * T + t) * H + hq) * 5;
                    ds[0] = z; ds[1] = d1; ds[2] = d2; ds[3] = dm; ds[4] = st[4];
                }
            }
        }
    }
    if (a.hist) {  // per row: the chunks' histograms merged in chunk order, then its occupied bins in order
#pragma omp parallel for schedule(static) num_threads(a.threads)
        for (int64_t row = 0; row < B * T * H; ++row) {
            const int64_t b = row / (T * H), t = (row / H) % T, hq = row % H, h = hq / G, r = t * G + hq % G;
            double acc[3 * HIST_K];
            std::fill(acc, acc + 3 * HIST_K, 0.0);
            for (int64_t c = 0; c < nch; ++c) {  // over each chunk's range of bins (hist_chunk)
                const int64_t i = ((b * Hkv + h) * nch + c) * R + r;
                const double* hc = PHIST + i * 3 * HIST_K;
                for (int64_t k = PHR[2 * i]; k <= PHR[2 * i + 1]; ++k) {
                    acc[k] += hc[k];
                    acc[HIST_K + k] += hc[HIST_K + k];
                    acc[2 * HIST_K + k] = std::max(acc[2 * HIST_K + k], hc[2 * HIST_K + k]);
                }
            }
            hist_emit(acc, a.hist + row * 3 * a.hist_m, a.hist_m);
        }
    }
    if (a.vstats && a.vmax)
        for (int64_t bh = 0; bh < B * Hkv; ++bh)
            for (int64_t d = 0; d < D; ++d) {
                float m = 0.0f;
                for (int64_t c = 0; c < nch; ++c) m = std::max(m, PVM[(bh * nch + c) * D + d]);
                a.vmax[bh * D + d] = m;
            }
    a.nanflag[0] = nan_all;
    a.nanflag[1] = nan_out;
}

// ---- the certificate epilogue (fast.core.cpu_fused._sums_to_pmz + fast.core.certify.forms_from_pmz at fp32 terms) ----
// The same fp64 operations in the same order as the numpy code, elementwise over the rows; the only library
// function is expm1 (glibc here, torch's in the numpy path: both within the 2 ulp that EXP_EPS pays for).
// np.minimum / np.maximum propagate NaN: nmin / nmax do the same.
inline double nmin(double a, double b) { return (std::isnan(a) || std::isnan(b)) ? NAN : (a < b ? a : b); }
inline double nmax(double a, double b) { return (std::isnan(a) || std::isnan(b)) ? NAN : (a > b ? a : b); }

struct EpiConst {
    double f, g1, g2, up_, g_n, u, eps2, u3, t_cut, den, alpha, exp_eps, cap, margin_max, w_abs;
};

// stats [rows, 5] (Z, S1, S2, max c^, e); out [7, rows] fp32 (CERT_KEYS order). Returns 0 when a row needs
// the fp64 terms (the numpy path returns None there: max cm + 2 max e >= cap, or a wild row), else 1.
int epilogue(const double* st, int64_t rows, const EpiConst& k, float* out) {
    std::vector<double> cmv((size_t)rows);
    double cmx = -INFINITY, ex = -INFINITY;
    for (int64_t i = 0; i < rows; ++i) {
        // a NaN sum (0 * inf: a token a row does not read, whose c overflowed fp32, e.g. the top log code): the twin
        for (int c = 0; c < 5; ++c)
            if (std::isnan(st[i * 5 + c])) return 0;
        cmv[i] = up(up(st[i * 5 + 3] * k.f) * k.up_);
        cmx = nmax(cmx, cmv[i]);
        ex = nmax(ex, st[i * 5 + 4]);
    }
    if (!(cmx + 2 * ex < k.cap)) return 0;
    for (int64_t i = 0; i < rows; ++i) {
        const double z = st[i * 5 + 0], s1 = st[i * 5 + 1], s2 = st[i * 5 + 2], e = st[i * 5 + 4], cm = cmv[i];
        // _sums_to_pmz
        const double a1 = up(((s1 * k.f) * (1 + k.g1)) * k.up_);
        const double a2 = up((((s2 * k.f) * k.f) * (1 + k.g2)) * k.up_);
        const double a2lo = std::nextafter((((s2 * k.f) * k.f) * (1 - k.g2)) / k.up_, -INFINITY);
        const double em = std::expm1(nmin(cm, 700.0)) * (1 + 8 * 0x1p-53);
        const double p1 = up((a1 + a2 * (0.5 + (cm * (em + 1)) / 6)) * k.up_);
        const double p2 = cm > 0 ? up((a1 * up(em / cm)) * k.up_) : 0.0;
        double p = nmin(p1, p2);
        const double coef = ((0.5 - cm / 6) / k.up_) - 0x1p-50;
        const double m1 = coef > 0 ? up((a1 - a2lo * nmax(coef, 0.0)) * k.up_) : a1;
        const double m = nmin(nmin(m1, a1), up((z * (1 + k.g1)) * k.up_));
        if (!std::isfinite(p)) p = INFINITY;
        // forms_from_pmz (fp32 terms)
        const double d = up(2 * e + 0x1p-149);
        const double cm2 = up(cm + d);
        const double margin = 2 * (((k.u * nmin((2 * e) / k.den, k.t_cut) + k.eps2) + k.u3) + k.g_n);
        if (cm2 > k.cap || margin > k.margin_max) return 0;
        const double em_d = std::fabs(std::expm1(d)), om_d = std::fabs(std::expm1(-d));
        double em_c = std::fabs(std::expm1(nmin(cm2, 600.0)));
        const double z_up = z * ((1 + margin) + 2 * k.alpha);
        const double z_dn = z * ((1 - margin) - 2 * k.alpha);
        const double p_eff = (1 + em_d * (1 + k.exp_eps)) * (p * (1 + margin) + k.alpha) + (em_d * (1 + k.exp_eps)) * z_up;
        const double m_eff = (1 - om_d * (1 - k.exp_eps)) * (m * (1 + margin) + k.alpha) + (om_d * (1 + k.exp_eps)) * z_up;
        const double pz = p_eff / z_dn;
        em_c = em_c * (1 + k.exp_eps);
        const double th = em_c / (em_c + 2);
        const double sc = 1 + 0x1p-46;
        const double a = up((1 + pz) * sc), mz = up((m_eff / z_dn) * sc), tanh_ = up(th * sc);
        const double om = up(((p_eff + m_eff) / (z_dn + p_eff)) * sc), ef0 = up((pz * (1 + 0.5 * pz)) * sc);
        const double neg_b = nmin(up(mz - 1), 0.0);
        // certify.weight_rounding: the served fp32 weights' TV to softmax(x^), added to every TV form
        const double tw = nmin(up((2 * e) / k.den), k.t_cut);
        const double theta = up(k.u * tw + k.eps2);
        const double rw = up(up(std::expm1(theta) * (1 + k.exp_eps)) + k.w_abs);
        const double t1 = nmin(up(tanh_ + rw), 1.0), o1 = nmin(up(om + rw), 1.0), ef = up(ef0 + rw);
        const double low = nmin(nmax(nmin(nmin(t1, o1), ef), 0.0), 1.0);
        const double vals[7] = {a, neg_b, cm2, t1, o1, ef, low};
        for (int c = 0; c < 7; ++c) {
            float y = (float)vals[c];
            if ((double)y < vals[c]) y = upf(y);
            out[c * rows + i] = c == 1 ? -y : y;
        }
    }
    return 1;
}

}  // namespace

extern "C" {

int kvcert_fused_abi() { return 13; }

int64_t kvcert_hist_k() { return HIST_K; }

int kvcert_fused_avx2() { return KVCERT_AVX2; }

int kvcert_lut_is_grid(const float* lut) { return lut_grid(lut); }

// the fp8 format whose bit-arithmetic decode the kernel uses for this table (fp8_format; 0: the table gather, or the
// scalar build, which always gathers)
int kvcert_fp8_format(const float* lut) {
#if KVCERT_AVX2
    return fp8_format(lut);
#else
    (void)lut;
    return 0;
#endif
}

float kvcert_kappa(const float* q, int64_t n, int64_t D, const int64_t* bands, int64_t NB, int64_t W, double s64, double margin,
                   double* k64, float* k32) {
    return kappa_rows(q, n, D, bands, NB, W, s64, margin, k64, k32);
}

// up / upf (and down) against std::nextafter toward +inf (-inf): the special values and n pseudo-random bit patterns of each
// width (seeded); returns the number of mismatches (bits compared; NaN matches NaN)
int64_t kvcert_up_check(int64_t n, uint64_t seed) {
    int64_t bad = 0;
    auto same64 = [](double a, double b) { uint64_t x, y; std::memcpy(&x, &a, 8); std::memcpy(&y, &b, 8); return x == y || (a != a && b != b); };
    auto same32 = [](float a, float b) { uint32_t x, y; std::memcpy(&x, &a, 4); std::memcpy(&y, &b, 4); return x == y || (a != a && b != b); };
    const double sp[] = {0.0, -0.0, INFINITY, -INFINITY, NAN, 0x1p-1074, -0x1p-1074, 0x1p-1022, -0x1p-1022, 1.0, -1.0, DBL_MAX, -DBL_MAX};
    for (double x : sp) {
        bad += !same64(up(x), std::nextafter(x, INFINITY));
        bad += !same64(down(x), std::nextafter(x, -INFINITY));
        bad += !same32(upf((float)x), std::nextafter((float)x, INFINITY));
    }
    uint64_t z = seed;
    for (int64_t i = 0; i < n; ++i) {
        z += 0x9e3779b97f4a7c15ull;  // splitmix64
        uint64_t r = z;
        r = (r ^ (r >> 30)) * 0xbf58476d1ce4e5b9ull;
        r = (r ^ (r >> 27)) * 0x94d049bb133111ebull;
        r ^= r >> 31;
        double d;
        float f;
        uint32_t r32 = (uint32_t)r;
        std::memcpy(&d, &r, 8);
        std::memcpy(&f, &r32, 4);
        bad += !same64(up(d), std::nextafter(d, INFINITY));
        bad += !same64(down(d), std::nextafter(d, -INFINITY));
        bad += !same32(upf(f), std::nextafter(f, INFINITY));
    }
    return bad;
}

int kvcert_epilogue(const double* stats, int64_t rows, const EpiConst* k, float* out) { return epilogue(stats, rows, *k, out); }

void kvcert_fused_run(const Args* a) { run(*a); }

// Exhaustive check of kv_exp against fp64 exp on every fp32 x in [lo, 0]: returns the largest
// |kv_exp(x) - e^x| / e^x over x with e^x >= 2^-126 (in units of 2^-24), and in *abs_max the
// largest |kv_exp(x) - e^x| over x with e^x < 2^-126 (must stay <= 2^-126).
double kvcert_exp_check(float lo, double* abs_max, int threads) {
    uint32_t lo_bits;
    std::memcpy(&lo_bits, &lo, 4);
    const uint32_t first = 0x80000000u;  // -0.0
    const int64_t count = (int64_t)lo_bits - (int64_t)first + 1;
    double rel = 0.0, ab = 0.0;
    const double tiny = std::ldexp(1.0, -126);
#pragma omp parallel for reduction(max : rel, ab) schedule(static) num_threads(threads)
    for (int64_t i = 0; i < count; ++i) {
        uint32_t bits = first + (uint32_t)i;
        float x;
        std::memcpy(&x, &bits, 4);
        const double e = std::exp((double)x);
        const double y = (double)kv_exp(x);
        const double err = std::fabs(y - e);
        if (e >= tiny) rel = std::max(rel, err / e);
        else ab = std::max(ab, err);
    }
    *abs_max = ab;
    return rel * 16777216.0;
}

float kvcert_exp_one(float x) { return kv_exp(x); }

// One band of the witness from r = fl64(k - k~): the W squares of the band's coordinates (idx) summed in fp64 in
// this order, sqrt, times margin = 1 + 2 gamma_{W+4}, one ulp up, cast to fp32 rounded up (band_norms_up, up32).
inline float band_witness(const double* r, const int64_t* idx, int64_t W, double margin) {
    double ss = 0.0;
    for (int64_t w = 0; w < W; ++w) ss += r[idx[w]] * r[idx[w]];
    const double nrm = up(std::sqrt(ss) * margin);
    float f = (float)nrm;
    if ((double)f < nrm) f = upf(f);
    return f;
}

// pack_witness(witness(k, k~, bands)) of one row (kvcert_witness_codes below) into c[NB]: 0 (c written), 1 (NaN/Inf in
// k or khat: nothing written), 2 (a witness above the largest fp32: c not all written)
inline int witness_row_codes(const float* k, const float* kh, int64_t D, const int64_t* bands, int64_t NB, int64_t W,
                             double margin, const float* lut, uint8_t* c) {
    double r[512];
    bool finite = true;
    for (int64_t d = 0; d < D; ++d) {
        r[d] = (double)k[d] - (double)kh[d];
        finite = finite && std::isfinite(r[d]);
    }
    if (!finite) return 1;
    for (int64_t b = 0; b < NB; ++b) {
        const float f = band_witness(r, bands + b * W, W, margin);
        if (!std::isfinite(f)) return 2;  // a witness above the largest fp32 (no code holds it): the row is refused
        c[b] = (uint8_t)(std::lower_bound(lut, lut + 255, f) - lut);  // lut[255] >= every finite f
    }
    return 0;
}

// pack_witness(witness(k, k~, bands)) (fast.core.witness) of n rows of D fp32, key and khat contiguous rows: the band
// witness (math.md T4) with kvcert_paged_witness's operations below (r = fl64(k - k~), the W squares summed in fp64 in
// band order, sqrt, times margin = 1 + 2 gamma_{W+4}, one ulp up, cast to fp32 rounded up; any summation order is
// within the margin), then pack_witness's uint8 log code: the index of the first entry >= rho of the increasing log
// table lut (fp32 [256], lut[255] the largest fp32). out: n rows of NB codes. Returns the number of rows holding
// NaN/Inf in key or khat or a witness above the largest fp32 (their codes are not written: the caller raises), or -1
// (nothing written) when D > 512, NB > 64 or a band index lies outside [0, D) (cpu_fused.witness_codes checks first).
// top = 1: a row holding NaN/Inf gets the top code 255 in every band instead (not counted: the caller stores a row
// whose decoded key is not finite, which every read refuses); a finite row's witness above the largest fp32 still counts.
int64_t kvcert_witness_codes(const float* key, const float* khat, int64_t n, int64_t D, const int64_t* bands, int64_t NB,
                             int64_t W, double margin, const float* lut, uint8_t* out, int top) {
    if (D > 512 || NB > 64) return -1;
    for (int64_t i = 0; i < NB * W; ++i)
        if (bands[i] < 0 || bands[i] >= D) return -1;
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
        uint8_t c[64];
        const int got = witness_row_codes(key + i * D, khat + i * D, D, bands, NB, W, margin, lut, c);
        if (got == 1 && top) {
            std::fill(out + i * NB, out + (i + 1) * NB, (uint8_t)255);
        } else if (got) {
            ++bad;
        } else {
            std::copy(c, c + NB, out + i * NB);
        }
    }
    return bad;
}

// The smallest fp16 (bits) >= s for finite s >= 0, 2^-24 (bits 1) for s = 0, +inf (0x7C00) above the largest fp16:
// fast.core.quant._fp16_scale_up's result (its cast lands on one of the two fp16 neighbours of s, then moves up when
// below; either way the smallest one >= s). A search over the positive finite bit patterns (increasing in value).
inline uint16_t fp16_scale_up(double s) {
    if (s > 65504.0) return 0x7C00;
    uint16_t lo = 1, hi = 0x7BFF;  // half_to_float(hi) = 65504 >= s
    while (lo < hi) {
        const uint16_t mid = (uint16_t)((lo + hi) / 2);
        if ((double)half_to_float(mid) >= s) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

// One row x[D] fp32 (finite) as fast.core.quant.quantize(x, "int8" / "int4", group_size = D) stores it: scale =
// fp16_scale_up(fl64(max |x|) / qmax), codes m = round half to even of fl32(x / scale) clamped to [-qmax, qmax] (the
// clamp never binds); int8: m as int8 bytes, int4: nibbles m + 8, channel 2 i in byte i's low nibble, 2 i + 1 in its
// high one. khat[D] (may be null): the decoded row m * scale (exact in fp32). Returns the scale's bits (0x7C00: the
// row's max |x| does not fit an fp16 scale, nothing else written).
inline uint16_t quantize_row(const float* x, int64_t D, int bits, uint8_t* codes, float* khat) {
    const double qmax = bits == 8 ? 127.0 : 7.0;
    float amax = 0.0f;
    for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
    const uint16_t sb = fp16_scale_up((double)amax / qmax);
    if (sb == 0x7C00) return sb;
    const float sc = half_to_float(sb);
    for (int64_t d = 0; d < D; ++d) {
        const float m = std::min((float)qmax, std::max(-(float)qmax, std::nearbyint(x[d] / sc)));
        if (bits == 8) {
            codes[d] = (uint8_t)(int8_t)m;
        } else {
            const uint8_t nib = (uint8_t)((int)m + 8);
            codes[d >> 1] = (d & 1) ? (uint8_t)((codes[d >> 1] & 0x0F) | (nib << 4)) : (uint8_t)((codes[d >> 1] & 0xF0) | nib);
        }
        if (khat) khat[d] = m * sc;
    }
    return sb;
}

// The e4m3fn byte nearest to y (|y| <= 448, not NaN), ties to the even byte (round to nearest even: the cast of
// fast.core.quant's fp8_e4m3, y.to(torch.float8_e4m3fn)); the sign bit from y's (so -0 and small negatives keep it)
inline uint8_t e4m3_nearest(float y) {
    static const std::vector<double> val = [] {
        std::vector<double> t(127);
        for (int c = 0; c < 127; ++c) t[c] = (c >> 3) ? std::ldexp(1.0 + (c & 7) / 8.0, (c >> 3) - 7) : (c & 7) * 0x1p-9;
        return t;
    }();
    const double a = std::fabs((double)y);
    const int64_t hi = std::lower_bound(val.begin(), val.end(), a) - val.begin();  // first >= a (a <= 448 = val[126])
    int c = (int)hi;
    if (hi > 0 && val[hi] != a) {
        const double dlo = a - val[hi - 1], dhi = val[hi] - a;  // exact: both on fine binary grids
        c = (dlo < dhi || (dlo == dhi && (hi - 1) % 2 == 0)) ? (int)(hi - 1) : (int)hi;
    }
    return (uint8_t)(c | (std::signbit(y) ? 0x80 : 0));
}

// One row x[D] fp32 (finite) as fast.core.quant._quantize_fp8(x, "fp8_e4m3", per_token_scale=True) stores it: scale
// = up32(fl64(max |x|) / 448) (1 for a zero row), codes = e4m3_nearest(fl32(x / scale)); khat (may be null): the decoded
// row fl32(value(code) * scale) (page_decode's product). Returns the scale.
inline float quantize_row_fp8(const float* x, int64_t D, uint8_t* codes, float* khat) {
    float amax = 0.0f;
    for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
    const double s64 = amax > 0.0f ? (double)amax / 448.0 : 1.0;
    float sc = (float)s64;
    if ((double)sc < s64) sc = std::nextafter(sc, INFINITY);
    for (int64_t d = 0; d < D; ++d) {
        codes[d] = e4m3_nearest(x[d] / sc);
        if (khat) {
            const int c = codes[d] & 0x7F;
            const float v = (c >> 3) ? std::ldexp(1.0f + (c & 7) / 8.0f, (c >> 3) - 7) : (c & 7) * 0x1p-9f;
            khat[d] = ((codes[d] & 0x80) ? -v : v) * sc;
        }
    }
    return sc;
}

// The packed int8 / int4 / fp8 page write of fast.integrations.vllm (write_page without a fault): n tokens' keys and
// values k, v [n, Hkv, D] fp32 contiguous, each (token, KV head) row quantized (quantize_row: bits 8 or 4;
// quantize_row_fp8: bits 0, e4m3 codes with an fp32 scale) into the slab of block slots[i] / bs, head h, at offset o =
// slots[i] % bs: key codes at byte o * Wc, value codes at (bs + o) * Wc (Wc = D, or D / 2 for int4), key scale (fp16
// bits, fp32 for fp8: S bytes) at 2 bs Wc + S o, value scale at 2 bs Wc + S bs + S o, witness codes (NB bytes, none
// when NB = 0) at 2 bs Wc + 2 S bs + o NB: witness_row_codes of the key against the decoded key. page: byte 0 of block
// 0, head 0; slab (b, h) at page + b * sb + h * sh. A row holding NaN/Inf is stored as quantize stores zeros, its
// scale NaN (fp16 0x7E00, fp32 0x7FC00000: it decodes to NaN, which every read refuses) and a key's witness the top
// code 255. slots < 0 are skipped. Returns 0; -1 (nothing written) for a slot >= nblocks * bs, D > 512 or odd for
// int4, NB > 64, or a band index outside [0, D); -2 - i for the first row i (token * Hkv + head; rows before it
// written) whose max |x| does not fit an fp16 scale or whose witness exceeds the largest fp32 (cpu_fused.page_write
// raises).
int64_t kvcert_page_write(const float* k, const float* v, int64_t n, int64_t Hkv, int64_t D, const int64_t* slots,
                          int64_t nblocks, int64_t bs, uint8_t* page, int64_t sb, int64_t sh, int bits,
                          const int64_t* bands, int64_t NB, int64_t W, double margin, const float* lut) {
    if (D > 512 || (bits == 4 && D % 2) || (bits != 8 && bits != 4 && bits != 0) || NB > 64 || bs < 1) return -1;
    for (int64_t i = 0; i < NB * W; ++i)
        if (bands[i] < 0 || bands[i] >= D) return -1;
    for (int64_t i = 0; i < n; ++i)
        if (slots[i] >= nblocks * bs) return -1;
    const int64_t Wc = bits == 4 ? D / 2 : D, S = bits == 0 ? 4 : 2;
    static const float zero[512] = {};
    for (int64_t i = 0; i < n; ++i) {
        if (slots[i] < 0) continue;
        const int64_t blk = slots[i] / bs, o = slots[i] % bs;
        for (int64_t h = 0; h < Hkv; ++h) {
            uint8_t* slab = page + blk * sb + h * sh;
            for (int s = 0; s < 2; ++s) {  // 0: the key, 1: the value
                const float* x = (s ? v : k) + (i * Hkv + h) * D;
                bool finite = true;
                for (int64_t d = 0; d < D; ++d) finite = finite && std::isfinite(x[d]);
                float khat[512];
                uint8_t* codes = slab + (s * bs + o) * Wc;
                uint8_t* scale = slab + 2 * bs * Wc + s * S * bs + S * o;
                if (bits == 0) {
                    float sc = quantize_row_fp8(finite ? x : zero, D, codes, khat);
                    if (!finite) sc = NAN;
                    std::memcpy(scale, &sc, 4);
                } else {
                    uint16_t scb = quantize_row(finite ? x : zero, D, bits, codes, khat);
                    if (scb == 0x7C00) return -2 - (i * Hkv + h);
                    if (!finite) scb = 0x7E00;
                    std::memcpy(scale, &scb, 2);
                }
                if (s || !NB) continue;
                uint8_t* c = slab + 2 * bs * Wc + 2 * S * bs + o * NB;
                if (!finite) {
                    std::fill(c, c + NB, (uint8_t)255);
                } else if (witness_row_codes(x, khat, D, bands, NB, W, margin, lut, c)) {
                    return -2 - (i * Hkv + h);
                }
            }
        }
    }
    return 0;
}

// The band witness (math.md T4) of n exact keys against what a paged cache stores for them, written into the
// paged witness tensor: fast.core.witness.witness (band_norms_up) op for op: r = fl64(k - k~) (one rounding at
// most), the W squares and their sum in fp64 (any order), sqrt, times margin = 1 + 2 gamma_{W+4}, one ulp up;
// cast to fp32 rounded up; a nonzero result below rho_min raised to rho_min (still a witness). key [n, Hkv, D]
// fp32; the stored key of slot s in block s / bs, offset s % bs: kt + blk * k_sb + h * k_sh + d * bs + off
// (keys [D, bs] per block, vLLM's CPU cache); slots < 0 are skipped; rho [blocks, Hkv, bs, NB] contiguous.
// Returns the number of non-finite keys or stored keys met (the caller raises; nothing is written for them), or
// -1 (nothing written) when D > 512 or a band index lies outside [0, D) (cpu_fused.paged_witness checks both first).
int64_t kvcert_paged_witness(const float* key, int64_t n, int64_t Hkv, int64_t D, const float* kt, int64_t k_sb,
                             int64_t k_sh, int64_t bs, const int64_t* slots, const int64_t* bands, int64_t NB, int64_t W,
                             double margin, float rho_min, float* rho) {
    if (D > 512 || bs < 1) return -1;
    for (int64_t i = 0; i < NB * W; ++i)
        if (bands[i] < 0 || bands[i] >= D) return -1;
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t sl = slots[i];
        if (sl < 0) continue;
        const int64_t blk = sl / bs, off = sl % bs;
        for (int64_t h = 0; h < Hkv; ++h) {
            const float* k = key + (i * Hkv + h) * D;
            const float* st = kt + blk * k_sb + h * k_sh + off;
            double r[512];
            bool finite = true;
            for (int64_t d = 0; d < D; ++d) {
                r[d] = (double)k[d] - (double)st[d * bs];
                finite = finite && std::isfinite(r[d]);
            }
            if (!finite) {
                ++bad;
                continue;
            }
            float* out = rho + ((blk * Hkv + h) * bs + off) * NB;
            for (int64_t b = 0; b < NB; ++b) {
                const float f = band_witness(r, bands + b * W, W, margin);
                out[b] = (f > 0.0f && f < rho_min) ? rho_min : f;
            }
        }
    }
    return bad;
}

void kvcert_dither_noise(uint64_t seed, uint32_t stream, uint32_t layer, int64_t rows, int64_t Hkv, int64_t token_start,
                         int64_t N, int64_t D, int threads, float* out) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t rh = 0; rh < rows * Hkv; ++rh) {
        uint32_t key[4] = {layer, (uint32_t)(rh / Hkv), (uint32_t)(rh % Hkv), stream};
        philox4x32_10(key, (uint32_t)seed, (uint32_t)(seed >> 32));
        dither_u(key[0], key[1], (uint64_t)token_start, N, D, out + rh * N * D);
    }
}
}

// ---- the box form (spec T9, proofs/Box.v): fast.core.box.box_bound_enclosed's C++ twin (kvcert_box_bound) ----
// The same algorithm as the torch code, step for step: the grid search on the midpoint distribution (its sums in
// another order: any grid and any multipliers are sound, the heuristic part may differ in the last bits), the
// chained grid, and the certified terms with the margins of box.py _e_up (assumption A12), passed in from Python.
// Rows that report 1 (saturated, or q = 0 everywhere) get the uniform grid with multipliers 0.
namespace {

// the threshold ratio of the greedy fractional knapsack at level u (box.py _greedy, lower=False): with
// w_j = (1 - u) a_j + u b_j and r_j = w_j / p_j (0 where p_j <= 0), the ratio r_t of the first token t, in
// descending order of r, whose cumulative w reaches u B (none, by rounding: the last token with r > 0). Tokens with
// r = 0 (p = 0, so w = 0) are left out first: they add nothing to any sum. A weighted quickselect in place of the
// sort: each pass sums w over r > pivot (median of three), r < pivot and r = pivot, and goes on with the part
// holding the threshold. rw, sc: n pairs each (scratch). Returns 1 / r_t, or 0
// when no token has r > 0.
struct RW {
    double r, w;
};

template <typename Keep>
int64_t box_keep(const RW* c, RW* o, int64_t m, Keep keep) {
    int64_t k = 0;  // the pairs with keep(r), in order, without branches on the data
    for (int64_t i = 0; i < m; ++i) {
        o[k] = c[i];
        k += keep(c[i].r);
    }
    return k;
}

double box_lambda(const double* p, const double* a, const double* b, int64_t n, double Btot, double u, RW* rw, RW* sc) {
    const double v = 1 - u;
    int64_t m = 0;
    for (int64_t j = 0; j < n; ++j) {
        const double w = v * a[j] + u * b[j];
        const double r = p[j] > 0 ? w / std::max(p[j], 1e-300) : 0.0;
        rw[m] = {r, w};
        m += r > 0;
    }
    RW *c = rw, *o = sc;
    double need = u * Btot, rt = 0.0;
    while (m > 0) {
        const double x0 = c[0].r, x1 = c[m / 2].r, x2 = c[m - 1].r;
        double pv = x1;  // median of three
        if ((x1 <= x0 && x0 <= x2) || (x2 <= x0 && x0 <= x1)) pv = x0;
        else if ((x0 <= x2 && x2 <= x1) || (x1 <= x2 && x2 <= x0)) pv = x2;
        int64_t ng = 0, nl = 0;
        double sg = 0.0, se = 0.0;
#pragma omp simd reduction(+ : ng, nl, sg, se)
        for (int64_t k = 0; k < m; ++k) {
            const double x = c[k].r, y = c[k].w;
            const bool gt = x > pv, lt = x < pv;
            ng += gt;
            nl += lt;
            sg += gt ? y : 0.0;
            se += (gt || lt) ? 0.0 : y;
        }
        if (ng > 0 && sg >= need) {  // the threshold is above the pivot: go on with r > pivot
            m = box_keep(c, o, m, [pv](double x) { return x > pv; });
        } else if (sg + se >= need || nl == 0) {  // it has the pivot's ratio (or no token reaches u B: the last one)
            rt = pv;
            break;
        } else {
            need -= sg + se;  // below the pivot: go on with r < pivot
            m = box_keep(c, o, m, [pv](double x) { return x < pv; });
        }
        std::swap(c, o);
    }
    return rt > 0 ? 1.0 / std::max(rt, 1e-300) : 0.0;
}

// box_lambda on a row whose intervals are [-h_j, h_j] with h_j nondecreasing in j (a histogram's bins, hist_box): then
// r_j = w_j / p_j = (1 - u) e^{h_j} + u e^{-h_j} (in exact arithmetic) is convex in h_j, so the largest ratio among
// tokens i..j is r_i or r_j, and taking the larger end each time walks the tokens in descending order of r in one pass
// (no selection). The same threshold as box_lambda up to the order of near-equal ratios and of the sums (any lambda
// is sound; only the grid's choice could move, in the last bits).
double box_lambda_vee(const double* p, const double* a, const double* b, int64_t n, double Btot, double u) {
    const double v = 1 - u, need = u * Btot;
    double cw = 0.0, rt = 0.0, last = 0.0;
    // tokens with p = 0 (so w = 0) add nothing and are never the threshold (box_lambda leaves them out): skipped, so
    // that the ends compared are always two tokens on the convex curve
    for (int64_t i = 0, j = n - 1;;) {
        while (i <= j && !(p[i] > 0)) ++i;
        while (i <= j && !(p[j] > 0)) --j;
        if (i > j) break;
        const double wi = v * a[i] + u * b[i], wj = v * a[j] + u * b[j];
        const double ri = wi / std::max(p[i], 1e-300), rj = wj / std::max(p[j], 1e-300);
        const bool top = rj >= ri;
        const double r = top ? rj : ri;
        top ? --j : ++i;
        if (!(r > 0)) continue;  // w = 0 (a ratio of 0: box_lambda leaves it out)
        cw += top ? wj : wi;
        last = r;
        if (cw >= need) {
            rt = r;
            break;
        }
    }
    if (rt == 0.0) rt = last;  // no token reaches u B (rounding): the last one with r > 0
    return rt > 0 ? 1.0 / std::max(rt, 1e-300) : 0.0;
}

// box.py _terms: min over lambda in {0, l0, l1} of max(e(u0, lambda), e(u1, lambda)) (NaN-propagating, as torch), with
// e(u, lambda) = u - lambda u B + sum_j (lambda w_j(u) - p_j)^+ (box.py _e): the four sums in one pass
double box_term(const double* p, const double* a, const double* b, int64_t n, double Btot, double u0, double u1, double l0,
                double l1) {
    const double v0 = 1 - u0, v1 = 1 - u1;
    double s00 = 0.0, s10 = 0.0, s01 = 0.0, s11 = 0.0;  // s_il: level u_i, multiplier l_l
#pragma omp simd reduction(+ : s00, s10, s01, s11)
    for (int64_t j = 0; j < n; ++j) {
        const double w0 = v0 * a[j] + u0 * b[j], w1 = v1 * a[j] + u1 * b[j];
        const double t00 = l0 * w0 - p[j], t10 = l0 * w1 - p[j], t01 = l1 * w0 - p[j], t11 = l1 * w1 - p[j];
        s00 += t00 < 0 ? 0.0 : t00;  // clamp(min=0): NaN stays
        s10 += t10 < 0 ? 0.0 : t10;
        s01 += t01 < 0 ? 0.0 : t01;
        s11 += t11 < 0 ? 0.0 : t11;
    }
    const double e00 = (u0 - (l0 * u0) * Btot) + s00, e10 = (u1 - (l0 * u1) * Btot) + s10;
    const double e01 = (u0 - (l1 * u0) * Btot) + s01, e11 = (u1 - (l1 * u1) * Btot) + s11;
    return nmin(nmin(u1, nmax(e00, e10)), nmax(e01, e11));
}


struct BoxConst {
    double satc, rho_fac, t1_fac, s2_fac;  // SATURATE_C, 1 + 8 RHO, 1 + 2 gamma_{n+2}, 1 - 2 (EXP_EPS + gamma_{n+1})
};

// box.py _e_up: >= box_e of proofs/Box.v at (u, lam), every rounding outward, from s = fl(sum_j q_hi_j kp_j) (any
// order: nonnegative terms) and s2d = down(fl(S2) (1 - 2 (EXP_EPS + gamma_{n+1})))
inline double box_e_up(double s, double s2d, double u, double lam, const BoxConst& k) {
    const double t1 = up(s * k.t1_fac);
    double t2 = down(down(s2d * lam) * u);
    t2 = t2 < 0 ? 0.0 : t2;
    return up(up(u + t1) - t2);
}

// box.py _certified_terms on one interval: min over lambda in {0, l0, l1} of max(e_up(u0, lambda), e_up(u1, lambda));
// a lambda whose value is NaN (inf - inf, 0 * inf after an overflow) is skipped (as +inf: sound). The four sums
// sum_j q_hi_j kp_j, kp_j = max(0, fl(fl(g_j (1 + 8 RHO)) - 1)), g_j = fl(lam fl(fl((1 - u) E_hi_j) + fl(u E_lo_j))), in one pass
double box_term_up(const double* qh, const double* Elo, const double* Ehi, int64_t n, double s2d, double u0, double u1, double l0,
                   double l1, const BoxConst& k) {
    const double v0 = 1 - u0, v1 = 1 - u1;
    double s00 = 0.0, s10 = 0.0, s01 = 0.0, s11 = 0.0;  // s_il: level u_i, multiplier l_l
#pragma omp simd reduction(+ : s00, s10, s01, s11)
    for (int64_t j = 0; j < n; ++j) {
        const double w0 = v0 * Ehi[j] + u0 * Elo[j], w1 = v1 * Ehi[j] + u1 * Elo[j];
        const double k00 = (l0 * w0) * k.rho_fac - 1, k10 = (l0 * w1) * k.rho_fac - 1;
        const double k01 = (l1 * w0) * k.rho_fac - 1, k11 = (l1 * w1) * k.rho_fac - 1;
        s00 += qh[j] * (k00 < 0 ? 0.0 : k00);
        s10 += qh[j] * (k10 < 0 ? 0.0 : k10);
        s01 += qh[j] * (k01 < 0 ? 0.0 : k01);
        s11 += qh[j] * (k11 < 0 ? 0.0 : k11);
    }
    double t = u1;  // lambda = 0: box_e(u, 0) = u (Box.v box_e_lam0)
    const double e0 = nmax(box_e_up(s00, s2d, u0, l0, k), box_e_up(s10, s2d, u1, l0, k));
    const double e1 = nmax(box_e_up(s01, s2d, u0, l1, k), box_e_up(s11, s2d, u1, l1, k));
    if (e0 < t) t = e0;
    if (e1 < t) t = e1;
    return t;
}

// one row of kvcert_box_bound; returns 0, or 1 when the intervals do not chain from 0 to 1
int box_row(const double* ql, const double* qh, const double* lo, const double* hi, int64_t n, const double* levels, int64_t grid0,
            int64_t rounds, int64_t split, const BoxConst& k, double* bound, double* o0, double* o1, double* ol0, double* ol1) {
    const int64_t M = (grid0 - 1) + rounds * (split - 1);
    double hmax = -INFINITY, lmin = INFINITY, msum = 0.0;
    for (int64_t j = 0; j < n; ++j) {
        hmax = std::max(hmax, hi[j]);
        lmin = std::min(lmin, lo[j]);
        msum += 0.5 * (ql[j] + qh[j]);
    }
    if (hmax > k.satc || lmin < -k.satc || !(msum > 0 && msum < INFINITY)) {
        // saturated (the clamps would narrow a box) or no midpoint distribution: bound 1 (TV <= 1), the uniform grid, lambdas 0
        *bound = 1.0;
        for (int64_t i = 0; i < M; ++i) {
            o0[i] = (double)i / (double)M;
            o1[i] = (double)(i + 1) / (double)M;
            ol0[i] = ol1[i] = 0.0;
        }
        return 0;
    }
    std::vector<double> buf((size_t)(5 * n));
    double *p = buf.data(), *a = p + n, *b = a + n, *Elo = b + n, *Ehi = Elo + n;
    std::vector<RW> rwb((size_t)(2 * n));
    RW *rw = rwb.data(), *sc = rw + n;
    double Btot = 0.0, S2 = 0.0;
    for (int64_t j = 0; j < n; ++j) {
        Elo[j] = std::exp(std::max(lo[j], -k.satc));
        Ehi[j] = std::exp(std::min(hi[j], k.satc));
        p[j] = 0.5 * (ql[j] + qh[j]) / msum;
        a[j] = p[j] * Ehi[j];
        b[j] = p[j] * Elo[j];
        Btot += b[j];
        S2 += ql[j] * Elo[j];
    }
    // grid_search(lower=False): uniform levels, then `rounds` cuts of the interval holding the largest term
    std::vector<double> U0, U1, L0, L1, T;
    for (auto* x : {&U0, &U1, &L0, &L1, &T}) x->reserve((size_t)M);
    std::vector<double> lam((size_t)grid0);
    bool vee = true;  // [-h_j, h_j], h_j nondecreasing: box_lambda_vee
    for (int64_t j = 0; j < n; ++j) vee &= lo[j] == -hi[j] && (j == 0 || hi[j] >= hi[j - 1]);
    auto lambda = [&](double u) { return vee ? box_lambda_vee(p, a, b, n, Btot, u) : box_lambda(p, a, b, n, Btot, u, rw, sc); };
    for (int64_t i = 0; i < grid0; ++i) lam[i] = lambda(levels[i]);
    for (int64_t i = 0; i + 1 < grid0; ++i) {
        U0.push_back(levels[i]);
        U1.push_back(levels[i + 1]);
        L0.push_back(lam[i]);
        L1.push_back(lam[i + 1]);
        T.push_back(box_term(p, a, b, n, Btot, levels[i], levels[i + 1], lam[i], lam[i + 1]));
    }
    std::vector<double> su((size_t)split + 1), sl((size_t)split + 1);
    for (int64_t it = 0; it < rounds; ++it) {
        size_t km = 0;  // torch.argmax: the first maximum, a NaN counting as the largest
        for (size_t i = 1; i < T.size() && !std::isnan(T[km]); ++i)
            if (std::isnan(T[i]) || T[i] > T[km]) km = i;
        const double a0 = U0[km], a1 = U1[km];
        su[0] = a0;
        sl[0] = L0[km];
        su[split] = a1;
        sl[split] = L1[km];
        for (int64_t s = 1; s < split; ++s) {
            const double f = (double)s / (double)split;
            const double x = nmin(nmax(a0 + (a1 - a0) * f, a0), a1);
            su[s] = std::max(x, su[s - 1]);  // cummax
            sl[s] = lambda(su[s]);
        }
        for (auto* x : {&U0, &U1, &L0, &L1, &T}) x->erase(x->begin() + (std::ptrdiff_t)km);
        for (int64_t s = 0; s < split; ++s) {
            U0.push_back(su[s]);
            U1.push_back(su[s + 1]);
            L0.push_back(sl[s]);
            L1.push_back(sl[s + 1]);
            T.push_back(box_term(p, a, b, n, Btot, su[s], su[s + 1], sl[s], sl[s + 1]));
        }
    }
    // _chain: by u0, ties by u1 (then by position: two stable sorts), and the checks
    std::vector<int64_t> ord((size_t)M);
    for (int64_t i = 0; i < M; ++i) ord[i] = i;
    std::stable_sort(ord.begin(), ord.end(), [&](int64_t x, int64_t y) { return U0[x] < U0[y] || (U0[x] == U0[y] && U1[x] < U1[y]); });
    int bad = 0;
    for (int64_t i = 0; i < M; ++i) {
        const int64_t o = ord[i];
        o0[i] = U0[o];
        o1[i] = U1[o];
        ol0[i] = L0[o];
        ol1[i] = L1[o];
        bad |= !(o0[i] <= o1[i]) || (i > 0 && !(o1[i - 1] == o0[i]));
    }
    bad |= !(o0[0] == 0.0) || !(o1[M - 1] == 1.0);
    if (bad) {
        *bound = 1.0;
        return 1;
    }
    // _certified_terms, then the max over the intervals, <= 1
    const double s2d = down(S2 * k.s2_fac);
    double best = -INFINITY;
    for (int64_t i = 0; i < M; ++i) best = std::max(best, box_term_up(qh, Elo, Ehi, n, s2d, o0[i], o1[i], ol0[i], ol1[i], k));
    *bound = std::min(best, 1.0);
    return 0;
}

}  // namespace

extern "C" {
// box.py hist_bins' [R, M] part, the same fp64 operations in the same order (-ffp-contract=off; up, down: nextafter,
// as torch.nextafter), so the same bits as its torch twin: hist [R, 3 K] a histogram row per certificate row (its
// occupied bins in its first slots: largest c^, W, n), per row e_up, e_dn, z_dn, z_up, d; gp = 1 + g, gm = 1 - g,
// f1 = 1 + 2 NB u32, f2 = 1 + 2^-40. Out [R, M]: q_lo, q_hi, lo = -h, hi = h, 0 (lo -0) where a slot is empty.
void kvcert_hist_bins(const double* hist, int64_t R, int64_t K, int64_t M, const double* e_up, const double* e_dn,
                      const double* z_dn, const double* z_up, const double* d, double gp, double gm, double f1, double f2,
                      double tiny, int threads, double* q_lo, double* q_hi, double* lo, double* hi) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < R; ++r) {
        const double* h = hist + r * 3 * K;
        for (int64_t k = 0; k < M; ++k) {
            const double cb = h[k], W = h[K + k], n = h[2 * K + k];
            const int64_t o = r * M + k;
            if (!(n > 0)) {
                q_lo[o] = q_hi[o] = hi[o] = 0.0;
                lo[o] = -0.0;
                continue;
            }
            q_hi[o] = up(up(up(up(W * gp) * e_up[r]) + n * tiny) / z_dn[r]);
            double x = down(down(down(W * gm) * e_dn[r]) - n * tiny);
            x = down((x < 0 ? 0.0 : x) / z_up[r]);
            q_lo[o] = x < 0 ? 0.0 : x;
            const double hk = up(up(up(cb * f1) * f2) + d[r]);
            hi[o] = hk;
            lo[o] = -hk;
        }
    }
}

// box.py box_bound_enclosed on R rows of n tokens (row-major fp64; the caller checks them: finite q with
// 0 <= q_lo <= q_hi, lo <= hi, no NaN, n >= 1, grid0 >= 2 levels from 0 to 1, split >= 2): bound [R] and the chained
// grid u0, u1, l0, l1 [R, M], M = (grid0 - 1) + rounds (split - 1). Returns the number of rows whose grid did not chain
// (their bound is 1; box.py raises).
int kvcert_box_bound(const double* q_lo, const double* q_hi, const double* lo, const double* hi, int64_t R, int64_t n,
                     const double* levels, int64_t grid0, int64_t rounds, int64_t split, double satc, double rho_fac,
                     double t1_fac, double s2_fac, int threads, double* bound, double* u0, double* u1, double* l0, double* l1) {
    const int64_t M = (grid0 - 1) + rounds * (split - 1);
    const BoxConst k{satc, rho_fac, t1_fac, s2_fac};
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : bad) num_threads(threads)
    for (int64_t i = 0; i < R; ++i) {
        const int64_t o = i * n, g = i * M;
        int64_t m = n;  // trailing tokens with q = 0 and interval [0, 0] (a histogram's empty bins) add 0 to every sum
        while (m > 1 && q_lo[o + m - 1] == 0 && q_hi[o + m - 1] == 0 && lo[o + m - 1] == 0 && hi[o + m - 1] == 0) --m;
        bad += box_row(q_lo + o, q_hi + o, lo + o, hi + o, m, levels, grid0, rounds, split, k, bound + i, u0 + g, u1 + g, l0 + g,
                       l1 + g);
    }
    return bad;
}
}
