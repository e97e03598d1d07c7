/* Native CPU kernels: paged decode attention and few-row linear layers.
 *
 * Compiled on the machine that runs them (-march=native, see cpu_native.py) and called through ctypes
 * with raw pointers. OpenMP here is the libgomp torch already loaded (linked by its path), so these
 * loops and torch's share one thread team instead of fighting for the cores. The linear layers' loops
 * over outputs are schedule(guided): a thread takes half of what is left, then half again, so one that
 * starts late or loses its core for a moment (a vCPU's steal, the server's event loop) leaves the tail
 * to the other instead of holding it at the barrier. Against equal halves, alternated step by step
 * (`benchmarks/kernel_ab.py`, a 2-vCPU Zen 5 VM): bf16 steps of 12-16 rows 0.87-0.93x the time, 17-256
 * rows 0.89-0.96x, one row and fp32 unchanged.
 *
 * Why they exist: at decode batch sizes a CPU step pays for fixed costs, not arithmetic. torch's
 * fused attention spends ~0.3 ms a layer on 16 short sequences (plus a gather of their blocks),
 * oneDNN's bf16 GEMM reads weights at half the DRAM bandwidth when a step has a few rows, and every
 * small elementwise op pays a dispatch. Here: attention reads K/V straight from the blocks (no gather,
 * no mask), the linear kernels stream each weight row once for every row of the step (AMX tiles or
 * AVX-512 registers), and the residual add + RMSNorm and SiLU x up are one call each.
 * CPUs without AVX-512 (AVX2 + FMA) get 8-lane versions of the attention, the linears, SiLU x up and
 * the greedy pass (PAGODA_AVX2), bf16 tensors widened to fp32 in registers (bf16 products in hardware
 * are AVX512-BF16's and AMX's).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define PAGODA_AVX2 1 /* the 8-lane kernels: x86 CPUs without AVX-512 (Haswell to Alder Lake, Zen 1-3) */
#endif
#if defined(__AVX512F__) || defined(PAGODA_AVX2)
#include <immintrin.h>
#include <omp.h>
#endif

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16 /* query heads per KV head */
#define INLINE static inline __attribute__((always_inline))

static inline float bf16_to_f32(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does; branch-free */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (bits >> 16) | 0x40u;
    return (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

static inline void load_f32(const void *base, int64_t offset, int dtype, float *out, int n) {
    if (dtype == DTYPE_BF16) {
        const uint16_t *p = (const uint16_t *)base + offset;
#pragma omp simd
        for (int i = 0; i < n; i++) out[i] = bf16_to_f32(p[i]);
    } else {
        memcpy(out, (const float *)base + offset, (size_t)n * sizeof(float));
    }
}

static inline void store_f32(void *base, int64_t offset, int dtype, const float *in, int n) {
    if (dtype == DTYPE_BF16) {
        uint16_t *p = (uint16_t *)base + offset;
        for (int i = 0; i < n; i++) p[i] = f32_to_bf16(in[i]);
    } else {
        memcpy((float *)base + offset, in, (size_t)n * sizeof(float));
    }
}

/* Output `at` of a linear: bias[n] added, then rounded to the activations' dtype. */
static inline void store_output(void *y, int64_t at, float v, const void *bias, int64_t n, const int dtype) {
    if (dtype == DTYPE_BF16)
        ((uint16_t *)y)[at] = f32_to_bf16(bias ? v + bf16_to_f32(((const uint16_t *)bias)[n]) : v);
    else
        ((float *)y)[at] = bias ? v + ((const float *)bias)[n] : v;
}

#if defined(__AVX512F__)
/* AVX-512 helpers: 16 fp32 lanes, loaded from / stored to either dtype (masked for tails); exp by
 * Cephes' range reduction and polynomial (~1 ulp). */
static inline __m512 exp_avx512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-87.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i scale = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(scale));
}

/* A load the compiler must keep in a register. A tile's vectors each feed several FMAs; GCC folds
 * such loads into every FMA as a memory operand, and then the loads (one 512-bit a cycle on Zen 4),
 * not the FMAs, set the pace: the fp32 tile ran at ~70 % of the FMA peak that way. */
static inline __m512 load_kept(const float *p) {
    __m512 v = _mm512_loadu_ps(p);
    __asm__("" : "+v"(v));
    return v;
}

/* r[0..16) rows of 16 32-bit values -> their transpose, in registers (unpack, shuffle within and
 * across 128-bit lanes): AMX's C tiles to rows and rows to VNNI pairs, weight rows to the fp32 panels. */
static inline __attribute__((always_inline)) void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44), r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44), r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88), t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88), t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++)
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88), r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
}

/* 16 bf16 values as fp32, exactly: a bf16 is the top half of an fp32. */
static inline __m512 widen_bf16(__m256i raw) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)); }

static inline __m512 load16(const void *base, int64_t offset, __mmask16 mask, const int dtype) {
    if (dtype == DTYPE_BF16) return widen_bf16(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)base + offset));
    return _mm512_maskz_loadu_ps(mask, (const float *)base + offset);
}

static inline __m512i bf16_bits(__m512 v) { /* round to nearest even, quiet NaN: as torch */
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), quiet);
}

static inline __m512 round16(__m512 v, const int dtype) {
    return dtype == DTYPE_BF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16)) : v;
}

/* The four sums of a, b, c, d (one output each) as one vector: a tree of adds, not four reductions. */
static inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    const __m256 b8 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
    const __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
    const __m256 d8 = _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
    const __m256 all = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
    return _mm_add_ps(_mm256_castps256_ps128(all), _mm256_extractf128_ps(all, 1));
}

static inline void store16(void *base, int64_t offset, __m512 v, __mmask16 mask, const int dtype) {
    if (dtype == DTYPE_BF16)
        _mm256_mask_storeu_epi16((uint16_t *)base + offset, mask, _mm512_cvtepi32_epi16(bf16_bits(v)));
    else
        _mm512_mask_storeu_ps((float *)base + offset, mask, v);
}

#elif defined(PAGODA_AVX2)
/* AVX2 helpers: 8 fp32 lanes, tails by a lane mask (`n` valid lanes, 8 or more: all), exp as
 * exp_avx512 (the same range reduction and polynomial). */
static inline __m256i lanes_below(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline __m256 exp_avx2(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.7f)), _mm256_set1_ps(-87.3f));
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

/* 8 bf16 values as fp32, exactly: a bf16 is the top half of an fp32. Built for Zen 1, whose 256-bit
 * ops run as two halves, they are interleaved with zeros 4 at a time in 128-bit halves: a 256-bit
 * zero-extension and shift took a third more ops there and bounded a one-row step on bf16 weights
 * (0.9x the time); elsewhere those are two ops of full width. */
#if defined(__tune_znver1__)
static inline __m256 widen8_bf16(__m128i raw) {
    const __m128i zero = _mm_setzero_si128();
    return _mm256_castsi256_ps(_mm256_set_m128i(_mm_unpackhi_epi16(zero, raw), _mm_unpacklo_epi16(zero, raw)));
}
#else
static inline __m256 widen8_bf16(__m128i raw) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)); }
#endif

static inline __m256 load8(const void *base, int64_t offset, int n, const int dtype) {
    if (dtype == DTYPE_BF16) {
        const uint16_t *p = (const uint16_t *)base + offset;
        if (n >= 8) return widen8_bf16(_mm_loadu_si128((const __m128i *)p));
        uint16_t part[8] = {0};
        memcpy(part, p, (size_t)n * sizeof *p);
        return widen8_bf16(_mm_loadu_si128((const __m128i *)part));
    }
    const float *p = (const float *)base + offset;
    return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes_below(n));
}

/* Half h of the 16 bf16 values at offset, as fp32 (exactly): h = 0 takes values 0-3 and 8-11, h = 1
 * values 4-7 and 12-15, the order in which 256-bit interleaves with zeros widen them: half the ops of
 * widening 8 in order. */
static inline __m256 widen8_of16_bf16(const uint16_t *p, const int h) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)p), zero = _mm256_setzero_si256();
    return _mm256_castsi256_ps(h ? _mm256_unpackhi_epi16(zero, raw) : _mm256_unpacklo_epi16(zero, raw));
}

static inline __m256i bf16_bits8(__m256 v) { /* round to nearest even, quiet NaN: as torch */
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded =
        _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

static inline __m256 round8(__m256 v, const int dtype) {
    return dtype == DTYPE_BF16 ? _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16)) : v;
}

static inline void store8(void *base, int64_t offset, __m256 v, int n, const int dtype) {
    if (dtype == DTYPE_BF16) {
        const __m256i bits = bf16_bits8(v);
        const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
        uint16_t *p = (uint16_t *)base + offset;
        if (n >= 8) {
            _mm_storeu_si128((__m128i *)p, packed);
        } else {
            uint16_t part[8];
            _mm_storeu_si128((__m128i *)part, packed);
            memcpy(p, part, (size_t)n * sizeof *p);
        }
        return;
    }
    float *p = (float *)base + offset;
    if (n >= 8) _mm256_storeu_ps(p, v);
    else _mm256_maskstore_ps(p, lanes_below(n), v);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* The four sums of a, b, c, d (one output each) as one vector. */
static inline __m128 sum4_avx2(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 all = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(all), _mm256_extractf128_ps(all, 1));
}

/* The sums of d[0..8), one per lane: a transposing add tree. */
static inline __m256 sum8_avx2(const __m256 d[8]) {
    const __m256 ab = _mm256_hadd_ps(d[0], d[1]), cd = _mm256_hadd_ps(d[2], d[3]);
    const __m256 ef = _mm256_hadd_ps(d[4], d[5]), gh = _mm256_hadd_ps(d[6], d[7]);
    const __m256 abcd = _mm256_hadd_ps(ab, cd), efgh = _mm256_hadd_ps(ef, gh); /* low | high halves */
    return _mm256_add_ps(_mm256_permute2f128_ps(abcd, efgh, 0x20), _mm256_permute2f128_ps(abcd, efgh, 0x31));
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
#endif

int pagoda_max_head_dim(void) { return MAX_HEAD_DIM; }
int pagoda_max_group(void) { return MAX_GROUP; }

/* One query token per sequence against its cached context, online softmax in fp32.
 * q: [num_seqs, num_heads, head_dim] with the given strides (elements); caches:
 * [num_blocks, block_size, num_kv_heads, head_dim] contiguous; out: [num_seqs, num_heads, head_dim]
 * contiguous. A sequence sees its last `sliding_window` tokens (0: all of them).
 * One task per (sequence, KV head) attends for the query heads of its group, so each K/V row is
 * read once for all of them; a long context of few sequences is split into pieces (below). */
struct attention_task {
    const void *q, *k_cache, *v_cache;
    const int32_t *table;
    void *out;
    float *piece; /* NULL: the group's outputs, normalized, into out; else its records (`keep_piece`) */
    int64_t q_offset, q_head_stride, out_offset, kv_offset, token_stride;
    int group, head_dim, block_size, start, length, dtype;
    float scale;
};

/* A piece of a split context keeps, for each head g of its group, a record of head_dim + 2 floats:
 * the sums of its tokens' V rows weighed by exp(score - max), then that max and the weights' total. */
static inline void keep_piece(const struct attention_task *a, int g, const float *sums, float max, float total) {
    float *record = a->piece + (int64_t)g * (a->head_dim + 2);
    memcpy(record, sums, (size_t)a->head_dim * sizeof(float));
    record[a->head_dim] = max;
    record[a->head_dim + 1] = total;
}

#if defined(__AVX512F__) || defined(PAGODA_AVX2)
/* One token's K and V rows of the task's head, from `row_base` (elements), into L2 (into L1 they held
 * its few miss buffers: 16 sequences' cold caches 151 -> 109 us a layer). In a decode step the caches
 * come from DRAM (the layer's weights went through the caches since): without this each block's first
 * reads wait for memory. Always inlined: the V loops call it, where a call would spill their sums. */
INLINE void prefetch_row(const struct attention_task *a, int64_t row_base, const int dtype, const int head_dim) {
    const int64_t elem = dtype == DTYPE_BF16 ? 2 : 4, bytes = (int64_t)head_dim * elem, row = row_base * elem;
    for (int64_t line = 0; line < bytes; line += 64) {
        _mm_prefetch((const char *)a->k_cache + row + line, _MM_HINT_T2);
        _mm_prefetch((const char *)a->v_cache + row + line, _MM_HINT_T2);
    }
}

/* `tokens` rows of a block from `base`, all asked for at once. */
static inline void prefetch_block(const struct attention_task *a, int64_t base, int tokens, const int dtype) {
    for (int j = 0; j < tokens; j++) prefetch_row(a, base + (int64_t)j * a->token_stride, dtype, a->head_dim);
}

/* Where block b's first K/V row of the task's head starts (elements). */
static inline int64_t block_base(const struct attention_task *a, int b) {
    return (int64_t)a->table[b] * a->block_size * a->token_stride + a->kv_offset;
}

/* The chunk of up to `chunk` tokens from token t within its cache block: how many, and where its first
 * K/V row starts (*base, elements). As the task begins, its first BLOCKS_AHEAD + 1 blocks are asked for
 * whole, each block's rows in flight at once (an AVX2 step's cold caches at 16 x 100-240 tokens, with
 * the 16-token chunks, 7.5-20 -> 5.1-12.2 ms); the kernels ask for each later block a row at a time
 * (`rows_ahead_of`). */
#define BLOCKS_AHEAD 2
static inline int next_chunk(const struct attention_task *a, int t, int chunk, int64_t *base, const int dtype) {
    const int in_block = t % a->block_size, block = t / a->block_size;
    int n = a->block_size - in_block;
    if (n > chunk) n = chunk;
    if (n > a->length - t) n = a->length - t;
    *base = ((int64_t)a->table[block] * a->block_size + in_block) * a->token_stride + a->kv_offset;
    if (t == a->start)
        for (int b = block; b <= block + BLOCKS_AHEAD; b++) {
            const int first = b * a->block_size;
            if (first >= a->length) break;
            prefetch_block(a, block_base(a, b), a->length - first < a->block_size ? a->length - first : a->block_size,
                           dtype);
        }
    return n;
}

/* Where the rows BLOCKS_AHEAD blocks on from the chunk at t start (elements), to be asked for a row at
 * a time while the chunk weighs V; -1 when t does not begin a block, there is no such block, or the
 * task's start asked for it already (`next_chunk`). Asked for all at once as a block began, the
 * prefetches held up the loads behind them (SmolLM2's shape, Zen 5, 16 x 1,000 tokens from DRAM:
 * 13.5-14.6 -> 10.0-11.3 ns a token and KV head with the next block a row at a time; two blocks on,
 * bf16 0.80-0.98x that; the AVX2 kernel, built for x86-64-v3 on the same CPU: 17.6-20.3 -> 11.3-12.5). */
static inline int64_t rows_ahead_of(const struct attention_task *a, int t) {
    const int ahead = t / a->block_size + BLOCKS_AHEAD;
    const int begins = t % a->block_size == 0, exists = ahead * a->block_size < a->length;
    const int asked_at_start = ahead * a->block_size <= a->start + BLOCKS_AHEAD * a->block_size;
    return begins && exists && !asked_at_start ? block_base(a, ahead) : -1;
}
#endif

#if defined(__AVX512F__)
#define CHUNK 16 /* tokens whose scores are exponentiated together */

/* Chunks of up to 16 tokens of one cache block: their scores (four tokens' dot products reduced at
 * once; bf16 caches multiply in bf16 pairs as stored, the scale applied to the sum, ~15 % faster than
 * converting each K row), one online-softmax update for the chunk with a vectorized exp, then the
 * weighted sum of their V rows. Per-token work is a few vector instructions, not a dependent chain
 * of scalar ones. */
static inline __attribute__((always_inline)) void attend_shaped(const struct attention_task *a, const int dtype,
                                                              const int group, const int chunks, const int whole) {
    const int head_dim = whole ? 16 * chunks : a->head_dim; /* whole: a constant, no tail masks */
    __m512 qv[MAX_GROUP][MAX_HEAD_DIM / 16], acc[MAX_GROUP][MAX_HEAD_DIM / 16];
    float row_max[MAX_GROUP], row_sum[MAX_GROUP];
    __mmask16 tail[MAX_HEAD_DIM / 16];
    for (int c = 0; c < chunks; c++)
        tail[c] = head_dim - 16 * c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (head_dim - 16 * c)) - 1);
#if defined(__AVX512BF16__)
    const int in_pairs = dtype == DTYPE_BF16 && head_dim % 32 == 0; /* Q.K on the bf16 pairs as stored */
    __m512bh qh[MAX_GROUP][MAX_HEAD_DIM / 32];
    if (in_pairs)
        for (int g = 0; g < group; g++)
            for (int c = 0; c < head_dim / 32; c++)
                qh[g][c] = (__m512bh)_mm512_loadu_si512((const uint16_t *)a->q + a->q_offset + g * a->q_head_stride + 32 * c);
#else
    const int in_pairs = 0;
#endif
    for (int g = 0; g < group; g++) {
        for (int c = 0; c < chunks; c++) {
            /* only the fp32 dot products read qv: in the bf16 pairs' instances it is never live, which
             * leaves the sums their registers (SmolLM2's shape spilled them to the stack on every token) */
            if (!in_pairs) {
                const __m512 raw = load16(a->q, a->q_offset + g * a->q_head_stride + 16 * c, tail[c], dtype);
                qv[g][c] = _mm512_mul_ps(raw, _mm512_set1_ps(a->scale));
            }
            acc[g][c] = _mm512_setzero_ps();
        }
        row_max[g] = -FLT_MAX;
        row_sum[g] = 0.0f;
    }
    for (int t = a->start; t < a->length;) {
        int64_t base;
        const int n = next_chunk(a, t, CHUNK, &base, dtype);
        const int64_t next_rows = rows_ahead_of(a, t); /* a row a step of the V loop's first pass */
        float scores[MAX_GROUP][CHUNK];
#if defined(__AVX512BF16__)
        if (in_pairs)
            for (int g = 0; g < group; g++)
                for (int j = 0; j < n; j += 4) {
                    __m512 dot[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
                    for (int c = 0; c < head_dim / 32; c++)
                        for (int u = 0; u < 4; u++) {
                            const int64_t row = base + (int64_t)(j + u < n ? j + u : n - 1) * a->token_stride;
                            dot[u] = _mm512_dpbf16_ps(dot[u], qh[g][c], (__m512bh)_mm512_loadu_si512((const uint16_t *)a->k_cache + row + 32 * c));
                        }
                    _mm_storeu_ps(scores[g] + j, _mm_mul_ps(sum4(dot[0], dot[1], dot[2], dot[3]), _mm_set1_ps(a->scale)));
                }
        else
#endif
        for (int g = 0; g < group; g++)
            for (int j = 0; j < n; j += 4) {
                __m512 dot[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
                for (int c = 0; c < chunks; c++)
                    for (int u = 0; u < 4; u++) { /* past the chunk: its last token again, dropped below */
                        const int64_t row = base + (int64_t)(j + u < n ? j + u : n - 1) * a->token_stride;
                        dot[u] = _mm512_fmadd_ps(qv[g][c], load16(a->k_cache, row + 16 * c, tail[c], dtype), dot[u]);
                    }
                _mm_storeu_ps(scores[g] + j, sum4(dot[0], dot[1], dot[2], dot[3])); /* past n: dropped below */
            }
        const __mmask16 valid = (__mmask16)((1u << n) - 1);
        float probs[MAX_GROUP][CHUNK];
        for (int g = 0; g < group; g++) {
            const __m512 s = _mm512_maskz_loadu_ps(valid, scores[g]);
            const float chunk_max = _mm512_mask_reduce_max_ps(valid, s);
            if (chunk_max > row_max[g]) { /* rescale what was summed under the old maximum */
                const float correction = expf(row_max[g] - chunk_max);
                row_sum[g] *= correction;
                for (int c = 0; c < chunks; c++) acc[g][c] = _mm512_mul_ps(acc[g][c], _mm512_set1_ps(correction));
                row_max[g] = chunk_max;
            }
            const __m512 e = _mm512_maskz_mov_ps(valid, exp_avx512(_mm512_sub_ps(s, _mm512_set1_ps(row_max[g]))));
            row_sum[g] += _mm512_reduce_add_ps(e);
            _mm512_storeu_ps(probs[g], e);
        }
        /* Token by token, all of the group's sums: a token's V row is loaded once and feeds group *
         * chunks FMAs that do not wait on each other. A 16-dim slice at a time, each sum's FMAs had
         * waited on each other token after token. Zen 5, caches from DRAM, 16-64 sequences of
         * 100-2,000 tokens, the same outputs bit for bit: SmolLM2's shape (3 query heads of 64 per KV
         * head) bf16 0.79-0.95x the time, fp32 0.76-0.97x (`kernel_ab.py --attention`, three runs);
         * Llama 3 8B's (4 of 128) 0.59-0.65x and 0.72-0.76x; 1-8 query heads of 64 or 128 per KV
         * head 0.67-0.98x and 0.60-0.89x. */
        for (int j = 0; j < n; j++) {
            const int64_t row = base + (int64_t)j * a->token_stride;
            if (next_rows >= 0) prefetch_row(a, next_rows + (int64_t)j * a->token_stride, dtype, head_dim);
            for (int c = 0; c < chunks; c++) {
                const __m512 v = load16(a->v_cache, row + 16 * c, tail[c], dtype);
                for (int g = 0; g < group; g++)
                    acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(probs[g][j]), v, acc[g][c]);
            }
        }
        t += n;
    }
    for (int g = 0; g < group; g++) {
        if (a->piece) {
            float sums[MAX_HEAD_DIM];
            for (int c = 0; c < chunks; c++) _mm512_mask_storeu_ps(sums + 16 * c, tail[c], acc[g][c]);
            keep_piece(a, g, sums, row_max[g], row_sum[g]);
            continue;
        }
        const __m512 inv = _mm512_set1_ps(row_sum[g] > 0.0f ? 1.0f / row_sum[g] : 0.0f);
        for (int c = 0; c < chunks; c++)
            store16(a->out, a->out_offset + g * head_dim + 16 * c, _mm512_mul_ps(acc[g][c], inv), tail[c], dtype);
    }
}

/* attend with common shapes' group and head size as constants (each one more instance to compile):
 * the queries stay in registers and the loops unroll, where the generic ones keep them in memory
 * (16 sequences of 60-500 tokens, cold caches, 30 layers, Sapphire Rapids class: fp32 8-11 % and bf16
 * 4-6 % faster; at 150 tokens fp32 7.1-7.4 -> 6.5-6.7 ms). The scores stored four at once and no fp32
 * query in a bf16 instance (with the V pass of that time, a slice of four heads' sums at a time):
 * Zen 5, SmolLM2's shape, 30 layers from cold caches, 1-64 sequences of 100-2,000 tokens, bf16
 * 0.76-0.93x the time, fp32 0.81-0.98x, the same outputs bit for bit (`kernel_ab.py --attention`). */
static void attend(const struct attention_task *a, const int dtype) {
    const int chunks = (a->head_dim + 15) / 16;
#define ATTEND_SHAPE(g, c)                                                                   \
    if (a->group == (g) && a->head_dim == 16 * (c)) {                                        \
        if (dtype == DTYPE_BF16) attend_shaped(a, DTYPE_BF16, g, c, 1); else attend_shaped(a, DTYPE_F32, g, c, 1); \
        return;                                                                              \
    }
    ATTEND_SHAPE(1, 4) ATTEND_SHAPE(3, 4) ATTEND_SHAPE(4, 4) ATTEND_SHAPE(8, 4) /* SmolLM2, TinyLlama, ... */
    ATTEND_SHAPE(4, 8) ATTEND_SHAPE(8, 8)                                        /* Llama 3 / Mistral 7-8B, ... */
#undef ATTEND_SHAPE
    attend_shaped(a, dtype, a->group, chunks, 0);
}
#elif defined(PAGODA_AVX2)
/* attend's AVX-512 version in 8 lanes: chunks of up to 16 tokens of a block, one query head at a
 * time. Each 8 tokens' scores come from 8 independent dot products (AVX2's FMAs are 4 cycles deep:
 * four chains left half the FMA slots idle) reduced into one vector; one online-softmax update per
 * chunk; then the V rows weighed 64 dims at a time (`weigh_values`), so the sums stay in AVX2's 16
 * registers (a whole group's spilled to the stack on every token) and wait in memory between
 * chunks. Zen 3, 16 sequences x 64-256 tokens from L2/L3: 37-47 -> 25-29 ns per token and KV head. */
#define CHUNK 16 /* tokens whose scores are exponentiated together: a block, two vectors */
#define SLICE 8 /* vectors of one head's sums in registers at once */

static inline __attribute__((always_inline)) void weigh_values(const struct attention_task *a, int64_t base,
                                                               int n, const float *probs, float correction,
                                                               float *sums, int c0, const int width,
                                                               const int dtype, const int whole, int64_t next_rows) {
    __m256 acc[SLICE];
    for (int c = 0; c < width; c++) acc[c] = _mm256_mul_ps(_mm256_loadu_ps(sums + 8 * c), _mm256_set1_ps(correction));
    for (int j = 0; j < n; j++) {
        if (next_rows >= 0) prefetch_row(a, next_rows + (int64_t)j * a->token_stride, dtype, a->head_dim);
        const __m256 p = _mm256_set1_ps(probs[j]);
        const int64_t row = base + (int64_t)j * a->token_stride + 8 * c0;
        for (int c = 0; c < width; c++)
            acc[c] = _mm256_fmadd_ps(p, load8(a->v_cache, row + 8 * c, whole ? 8 : a->head_dim - 8 * (c0 + c), dtype), acc[c]);
    }
    for (int c = 0; c < width; c++) _mm256_storeu_ps(sums + 8 * c, acc[c]);
}

static inline __attribute__((always_inline)) void attend_in(const struct attention_task *a, const int dtype, const int whole) {
    const int group = a->group, head_dim = a->head_dim, chunks = (head_dim + 7) / 8;
    __m256 qv[MAX_GROUP][MAX_HEAD_DIM / 8];
    float sums[MAX_GROUP][MAX_HEAD_DIM], row_max[MAX_GROUP], row_sum[MAX_GROUP];
    for (int g = 0; g < group; g++) {
        for (int c = 0; c < chunks; c++) {
            const __m256 raw = load8(a->q, a->q_offset + g * a->q_head_stride + 8 * c, head_dim - 8 * c, dtype);
            qv[g][c] = _mm256_mul_ps(raw, _mm256_set1_ps(a->scale));
            _mm256_storeu_ps(sums[g] + 8 * c, _mm256_setzero_ps());
        }
        row_max[g] = -FLT_MAX;
        row_sum[g] = 0.0f;
    }
    for (int t = a->start; t < a->length;) {
        int64_t base;
        const int n = next_chunk(a, t, CHUNK, &base, dtype);
        const int64_t next_rows = rows_ahead_of(a, t); /* a row a step of the first head's first V pass */
        int64_t rows[CHUNK]; /* past the chunk: its last token again, dropped by `valid` */
        for (int u = 0; u < CHUNK; u++) rows[u] = base + (int64_t)(u < n ? u : n - 1) * a->token_stride;
        __m256 valid[CHUNK / 8];
        for (int h = 0; h < CHUNK / 8; h++) valid[h] = _mm256_castsi256_ps(lanes_below(n - 8 * h));
        for (int g = 0; g < group; g++) {
            __m256 scores[CHUNK / 8];
            for (int h = (n + 7) / 8; h < CHUNK / 8; h++) scores[h] = _mm256_set1_ps(-FLT_MAX);
            for (int h = 0; h < (n + 7) / 8; h++) { /* 8 tokens' dot products at once: 8 FMA chains */
                __m256 dot[8];
                for (int u = 0; u < 8; u++) dot[u] = _mm256_setzero_ps();
                for (int c = 0; c < chunks; c++)
                    for (int u = 0; u < 8; u++)
                        dot[u] = _mm256_fmadd_ps(qv[g][c], load8(a->k_cache, rows[8 * h + u] + 8 * c, whole ? 8 : head_dim - 8 * c, dtype), dot[u]);
                scores[h] = _mm256_blendv_ps(_mm256_set1_ps(-FLT_MAX), sum8_avx2(dot), valid[h]);
            }
            __m256 top = scores[0];
            for (int h = 1; h < CHUNK / 8; h++) top = _mm256_max_ps(top, scores[h]);
            const float chunk_max = hmax8(top);
            float correction = 1.0f;
            if (chunk_max > row_max[g]) { /* rescale what was summed under the old maximum (none at first) */
                correction = row_max[g] == -FLT_MAX ? 0.0f : expf(row_max[g] - chunk_max);
                row_sum[g] *= correction;
                row_max[g] = chunk_max;
            }
            float probs[CHUNK];
            __m256 total = _mm256_setzero_ps();
            for (int h = 0; h < CHUNK / 8; h++) {
                const __m256 e = _mm256_and_ps(valid[h], exp_avx2(_mm256_sub_ps(scores[h], _mm256_set1_ps(row_max[g]))));
                total = _mm256_add_ps(total, e);
                _mm256_storeu_ps(probs + 8 * h, e);
            }
            row_sum[g] += hsum8(total);
            for (int c0 = 0; c0 < chunks; c0 += SLICE) {
                const int64_t rows = g == 0 && c0 == 0 ? next_rows : -1; /* asked for in the first pass only */
                if (chunks - c0 >= SLICE)
                    weigh_values(a, base, n, probs, correction, sums[g] + 8 * c0, c0, SLICE, dtype, whole, rows);
                else
                    weigh_values(a, base, n, probs, correction, sums[g] + 8 * c0, c0, chunks - c0, dtype, whole, rows);
            }
        }
        t += n;
    }
    for (int g = 0; g < group; g++) {
        if (a->piece) {
            keep_piece(a, g, sums[g], row_max[g], row_sum[g]);
            continue;
        }
        const __m256 inv = _mm256_set1_ps(row_sum[g] > 0.0f ? 1.0f / row_sum[g] : 0.0f);
        for (int c = 0; c < chunks; c++)
            store8(a->out, a->out_offset + g * head_dim + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(sums[g] + 8 * c), inv),
                   head_dim - 8 * c, dtype);
    }
}

/* Head sizes of whole vectors (64, 128, ...) without a tail test per load. */
static void attend(const struct attention_task *a, const int dtype) {
    if (a->head_dim % 8 == 0) attend_in(a, dtype, 1);
    else attend_in(a, dtype, 0);
}
#else
/* Token by token, for CPUs without AVX-512 or AVX2. */
static void attend(const struct attention_task *a, const int dtype) {
    const int group = a->group, head_dim = a->head_dim;
    float qf[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM];
    float row_max[MAX_GROUP], row_sum[MAX_GROUP], kf[MAX_HEAD_DIM], vf[MAX_HEAD_DIM];
    for (int g = 0; g < group; g++) {
        load_f32(a->q, a->q_offset + g * a->q_head_stride, dtype, qf[g], head_dim);
        for (int i = 0; i < head_dim; i++) {
            qf[g][i] *= a->scale;
            acc[g][i] = 0.0f;
        }
        row_max[g] = -FLT_MAX;
        row_sum[g] = 0.0f;
    }
    for (int t = a->start; t < a->length; t++) {
        const int64_t offset =
            ((int64_t)a->table[t / a->block_size] * a->block_size + t % a->block_size) * a->token_stride + a->kv_offset;
        load_f32(a->k_cache, offset, dtype, kf, head_dim);
        load_f32(a->v_cache, offset, dtype, vf, head_dim);
        for (int g = 0; g < group; g++) {
            float score = 0.0f;
#pragma omp simd reduction(+ : score)
            for (int i = 0; i < head_dim; i++) score += qf[g][i] * kf[i];
            if (score > row_max[g]) { /* rescale what was summed under the old maximum */
                const float correction = expf(row_max[g] - score);
                row_sum[g] *= correction;
#pragma omp simd
                for (int i = 0; i < head_dim; i++) acc[g][i] *= correction;
                row_max[g] = score;
            }
            const float p = expf(score - row_max[g]);
            row_sum[g] += p;
#pragma omp simd
            for (int i = 0; i < head_dim; i++) acc[g][i] += p * vf[i];
        }
    }
    for (int g = 0; g < group; g++) {
        if (a->piece) {
            keep_piece(a, g, acc[g], row_max[g], row_sum[g]);
            continue;
        }
        const float inv = row_sum[g] > 0.0f ? 1.0f / row_sum[g] : 0.0f;
        for (int i = 0; i < head_dim; i++) acc[g][i] *= inv;
        store_f32(a->out, a->out_offset + g * head_dim, dtype, acc[g], head_dim);
    }
}
#endif

/* Every block a sequence's context reads is inside the cache (the attention kernels' -2 otherwise). */
static int blocks_exist(const int32_t *block_tables, int64_t block_table_stride, const int32_t *context_lens,
                        int num_seqs, int block_size, int num_blocks) {
    for (int seq = 0; seq < num_seqs; seq++)
        for (int b = 0; b * block_size < context_lens[seq]; b++) {
            const int32_t block = block_tables[seq * block_table_stride + b];
            if (block < 0 || block >= num_blocks) return 0;
        }
    return 1;
}

/* ---- A long context of few sequences, split across threads ---------------------------------------
 * A task per (sequence, KV head) leaves threads idle when there are fewer than two tasks a thread: one
 * sequence of SmolLM2's 3 KV heads keeps one of 2 threads waiting a third of the layer, and 13 of 16
 * threads all of it. Then each context splits into pieces of PIECE_TOKENS_MIN tokens or more, sized so
 * that the layer's work makes ~TASKS_PER_THREAD tasks a thread. A piece's sums stay unnormalized
 * (`keep_piece`); `merge_pieces` rescales each to the largest max and normalizes, as the online softmax
 * over the whole context would have. */
#define PIECE_TOKENS_MIN 512 /* each piece's first block waits for memory: a few microseconds of work at least */
#define TASKS_PER_THREAD 8

/* Tokens [start, end) of a sequence; record: the first of its group records in the pieces' buffer, or
 * -1 where the piece is the whole context (its outputs go straight to out). */
struct piece {
    int seq, start, end;
    int64_t record;
};

static inline int window_start(int length, int sliding_window) {
    return sliding_window > 0 && length > sliding_window ? length - sliding_window : 0;
}

/* The step's pieces (*count of them; NULL: no memory) and how many hold records (*split). */
static struct piece *split_contexts(const int32_t *context_lens, int num_seqs, int num_heads, int num_kv_heads,
                                    int head_dim, int block_size, int sliding_window, int num_threads, int *count,
                                    int64_t *split) {
    int64_t tokens = 0;
    for (int s = 0; s < num_seqs; s++) tokens += context_lens[s] - window_start(context_lens[s], sliding_window);
    int64_t size = tokens > 0 ? tokens : 1; /* enough tasks already, or one thread: every context whole */
    if (num_threads > 1 && (int64_t)num_seqs * num_kv_heads < 2 * num_threads) {
        size = tokens * num_kv_heads / ((int64_t)num_threads * TASKS_PER_THREAD);
        if (size < PIECE_TOKENS_MIN) size = PIECE_TOKENS_MIN;
    }
    struct piece *pieces = malloc(((size_t)(tokens / size) + num_seqs) * sizeof *pieces);
    if (!pieces) return 0;
    int n = 0;
    *split = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int start = window_start(context_lens[s], sliding_window), length = context_lens[s];
        const int64_t parts = (length - start + size - 1) / size;
        if (parts <= 1) {
            pieces[n++] = (struct piece){s, start, length, -1};
            continue;
        }
        /* equal pieces of whole blocks (each prefetched as it begins) */
        const int64_t step = ((length - start + parts - 1) / parts + block_size - 1) / block_size * block_size;
        for (int64_t from = start; from < length; from += step) {
            pieces[n++] = (struct piece){s, (int)from, from + step < length ? (int)(from + step) : length,
                                         *split * num_heads * (head_dim + 2)};
            (*split)++;
        }
    }
    *count = n;
    return pieces;
}

/* Head h of the pieces [first, last) of one sequence, merged into its output row. */
static void merge_pieces(const float *records, const struct piece *pieces, int first, int last, int h,
                         int num_heads, int head_dim, void *out, int dtype) {
    float max = -FLT_MAX, total = 0.0f, merged[MAX_HEAD_DIM];
    for (int p = first; p < last; p++) {
        const float *record = records + pieces[p].record + (int64_t)h * (head_dim + 2);
        if (record[head_dim] > max) max = record[head_dim];
    }
    for (int i = 0; i < head_dim; i++) merged[i] = 0.0f;
    for (int p = first; p < last; p++) {
        const float *record = records + pieces[p].record + (int64_t)h * (head_dim + 2);
        const float weight = expf(record[head_dim] - max);
        total += record[head_dim + 1] * weight;
#pragma omp simd
        for (int i = 0; i < head_dim; i++) merged[i] += record[i] * weight;
    }
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    for (int i = 0; i < head_dim; i++) merged[i] *= inv;
    store_f32(out, ((int64_t)pieces[first].seq * num_heads + h) * head_dim, dtype, merged, head_dim);
}

int pagoda_paged_decode_attention(const void *q, int64_t q_seq_stride, int64_t q_head_stride,
                                  const void *k_cache, const void *v_cache, const int32_t *block_tables,
                                  int64_t block_table_stride, const int32_t *context_lens, void *out,
                                  int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                                  int block_size, int num_blocks, float scale, int sliding_window, int dtype,
                                  int num_threads) {
    const int group = num_heads / num_kv_heads;
    if (head_dim > MAX_HEAD_DIM || group > MAX_GROUP || group * num_kv_heads != num_heads) return -1;
    if (!blocks_exist(block_tables, block_table_stride, context_lens, num_seqs, block_size, num_blocks)) return -2;
    int num_pieces = 0;
    int64_t split = 0;
    struct piece *pieces = split_contexts(context_lens, num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                                          sliding_window, num_threads, &num_pieces, &split);
    float *records = split ? malloc((size_t)split * num_heads * (head_dim + 2) * sizeof(float)) : 0;
    if (!pieces || (split && !records)) {
        free(pieces);
        free(records);
        return -1;
    }
    /* Enough pieces to share out: a thread takes all of a piece's heads, which read the same token
     * rows (cold caches from DRAM: 64 sequences ~15 % faster than head by head). */
    const int per_grab = num_pieces >= 2 * num_threads ? num_kv_heads : 1;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(dynamic, per_grab)
        for (int task = 0; task < num_pieces * num_kv_heads; task++) {
            const struct piece *p = pieces + task / num_kv_heads;
            const int seq = p->seq, kv_head = task % num_kv_heads;
            const struct attention_task a = {
                .q = q, .k_cache = k_cache, .v_cache = v_cache, .out = out,
                .piece = p->record < 0 ? 0 : records + p->record + (int64_t)kv_head * group * (head_dim + 2),
                .table = block_tables + seq * block_table_stride,
                .q_offset = seq * q_seq_stride + (int64_t)kv_head * group * q_head_stride,
                .q_head_stride = q_head_stride,
                .out_offset = ((int64_t)seq * num_heads + kv_head * group) * head_dim,
                .kv_offset = (int64_t)kv_head * head_dim,
                .token_stride = (int64_t)num_kv_heads * head_dim,
                .group = group, .head_dim = head_dim, .block_size = block_size,
                .start = p->start, .length = p->end, .dtype = dtype, .scale = scale,
            };
            if (dtype == DTYPE_BF16) attend(&a, DTYPE_BF16); else attend(&a, DTYPE_F32);
        }
        if (split) { /* every piece attended (the loop's barrier): each split sequence's heads merged */
#pragma omp for schedule(static)
            for (int i = 0; i < num_pieces * num_heads; i++) {
                const int first = i / num_heads, h = i % num_heads;
                if (pieces[first].record < 0 || (first > 0 && pieces[first - 1].seq == pieces[first].seq)) continue;
                int last = first + 1;
                while (last < num_pieces && pieces[last].seq == pieces[first].seq) last++;
                merge_pieces(records, pieces, first, last, h, num_heads, head_dim, out, dtype);
            }
        }
    }
    free(pieces);
    free(records);
    return 0;
}

/* ---- Prefill attention: a tile of query tokens per chunk of keys ---------------------------------
 * The new tokens of a prompt (or of a prompt's chunk after its cached tokens) attend causally to
 * their sequence's cache. Token by token (the decode kernel above) each query reads its whole context
 * and reduces each key's dot products across lanes: ~130 GFLOP/s at 2,047 tokens on Zen 5, no faster
 * than torch's flash attention. Here a task is a tile of PREFILL_TILE consecutive tokens times the
 * query heads of one KV head: each chunk of up to 16 keys is transposed once (keys into lanes) and
 * serves every row of the tile, whose scores then come out as one vector of 16 keys, ready for the
 * online softmax; each V row weighs into two rows' sums at a time. q: [tokens, num_heads, head_dim]
 * (strides given, elements), out: [tokens, num_heads, head_dim] contiguous; sequence s's new tokens
 * are q's rows seq_starts[s] to seq_starts[s + 1], the last at position context_lens[s] - 1. */
#define PREFILL_TILE 8
#if defined(__AVX512F__)
struct prefill_task {
    const void *q, *k_cache, *v_cache;
    const int32_t *table;
    void *out;
    int64_t q_token_stride, q_head_stride, kv_offset, token_stride;
    int first_token, first_pos, tokens; /* the tile: q's row of its first token, that token's position, how many */
    int kv_head, group, num_heads, head_dim, block_size;
    int window; /* 0: none; else a token at position p sees the keys at p - window + 1 .. p */
    float scale;
};

/* Lanes lo..hi - 1 of 16 (clamped; none where hi <= lo). */
static inline __mmask16 lanes_between(int lo, int hi) {
    lo = lo < 0 ? 0 : lo;
    hi = hi > 16 ? 16 : hi;
    return hi <= lo ? 0 : (__mmask16)(((1u << hi) - 1) & ~((1u << lo) - 1));
}

/* The scores of one row against a chunk's keys (lanes), from the keys transposed: kt[d] holds dim d
 * of the 16 keys (bf16 pairs: kt[d] holds dims 2d, 2d + 1 as stored, for one dot-product instruction). */
INLINE __m512 prefill_scores(const __m512 *kt, const float *qf, const uint32_t *qpairs, const int in_pairs,
                             const int head_dim, const float scale) {
    /* four sums in named registers: indexed by d they went through memory on every step */
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps(), s2 = _mm512_setzero_ps(), s3 = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
    if (in_pairs) {
#define PAIRS(s, d) \
    s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_castps_si512(kt[d]), (__m512bh)_mm512_set1_epi32((int)qpairs[d]))
        for (int d = 0; d < head_dim / 2; d += 4) {
            PAIRS(s0, d);
            PAIRS(s1, d + 1);
            PAIRS(s2, d + 2);
            PAIRS(s3, d + 3);
        }
#undef PAIRS
        return _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)), _mm512_set1_ps(scale));
    }
#endif
    (void)qpairs, (void)in_pairs;
    for (int d = 0; d < head_dim; d += 4) {
        s0 = _mm512_fmadd_ps(kt[d], _mm512_set1_ps(qf[d]), s0);
        s1 = _mm512_fmadd_ps(kt[d + 1], _mm512_set1_ps(qf[d + 1]), s1);
        s2 = _mm512_fmadd_ps(kt[d + 2], _mm512_set1_ps(qf[d + 2]), s2);
        s3 = _mm512_fmadd_ps(kt[d + 3], _mm512_set1_ps(qf[d + 3]), s3);
    }
    return _mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3));
}

INLINE void prefill_tile_shaped(const struct prefill_task *a, const int dtype, const int vecs) {
    const int group = a->group, rows = a->tokens * group, head_dim = 16 * vecs;
#if defined(__AVX512BF16__)
    const int in_pairs = dtype == DTYPE_BF16 && head_dim % 32 == 0; /* Q.K on the bf16 pairs as stored */
#else
    const int in_pairs = 0; /* AVX-512 without bf16 arithmetic (Skylake-SP to Ice Lake): widened to fp32 */
#endif
    float qf[rows][head_dim], probs[rows][16], row_max[rows];
    uint32_t qpairs[rows][head_dim / 2];
    __m512 acc[rows][vecs], row_sum[rows], kt[head_dim], vf[16][vecs]; /* sums lane by lane: reduced once, at the end */
    for (int r = 0; r < rows; r++) {
        const int64_t at = (int64_t)(a->first_token + r / group) * a->q_token_stride +
                           (int64_t)(a->kv_head * group + r % group) * a->q_head_stride;
        if (in_pairs)
            memcpy(qpairs[r], (const uint16_t *)a->q + at, head_dim * 2);
        else
            for (int c = 0; c < vecs; c++)
                _mm512_storeu_ps(qf[r] + 16 * c,
                                 _mm512_mul_ps(load16(a->q, at + 16 * c, 0xffff, dtype), _mm512_set1_ps(a->scale)));
        for (int c = 0; c < vecs; c++) acc[r][c] = _mm512_setzero_ps();
        row_max[r] = -FLT_MAX;
        row_sum[r] = _mm512_setzero_ps();
    }
    const int end = a->first_pos + a->tokens; /* keys the tile's last token sees */
    const int start = a->window > 0 && a->first_pos - a->window + 1 > 0 ? a->first_pos - a->window + 1 : 0;
    for (int t = start; t < end;) {
        const int block = t / a->block_size, in_block = t % a->block_size;
        int n = a->block_size - in_block;
        if (n > 16) n = 16;
        if (n > end - t) n = end - t;
        const int64_t base = ((int64_t)a->table[block] * a->block_size + in_block) * a->token_stride + a->kv_offset;
        /* the chunk's keys into lanes (rows past n: zeros, masked below) */
        const int words = in_pairs ? head_dim / 2 : head_dim; /* 32-bit elements of a key row */
        for (int w = 0; w < words; w += 16) {
            __m512 block16[16];
            for (int j = 0; j < 16; j++) {
                const int64_t row = base + (int64_t)(j < n ? j : 0) * a->token_stride;
                block16[j] = j >= n ? _mm512_setzero_ps()
                             : in_pairs ? _mm512_castsi512_ps(_mm512_loadu_si512((const uint16_t *)a->k_cache + row + 2 * w))
                                        : load16(a->k_cache, row + w, 0xffff, dtype);
            }
            transpose16(block16);
            for (int d = 0; d < 16; d++) kt[w + d] = block16[d];
        }
        for (int j = 0; j < n; j++)
            for (int c = 0; c < vecs; c++)
                vf[j][c] = load16(a->v_cache, base + (int64_t)j * a->token_stride + 16 * c, 0xffff, dtype);
        for (int r = 0; r < rows; r++) {
            const int pos = a->first_pos + r / group; /* the row sees the chunk's keys up to its own, in its window */
            const int last = pos - t + 1 < n ? pos - t + 1 : n;
            const __mmask16 mask = lanes_between(a->window > 0 ? pos - a->window + 1 - t : 0, last);
            if (!mask) {
                _mm512_storeu_ps(probs[r], _mm512_setzero_ps());
                continue;
            }
            const __m512 s = prefill_scores(kt, qf[r], qpairs[r], in_pairs, head_dim, a->scale);
            const float chunk_max = _mm512_mask_reduce_max_ps(mask, s);
            if (chunk_max > row_max[r]) { /* rescale what was summed under the old maximum */
                const float correction = expf(row_max[r] - chunk_max);
                row_sum[r] = _mm512_mul_ps(row_sum[r], _mm512_set1_ps(correction));
                for (int c = 0; c < vecs; c++) acc[r][c] = _mm512_mul_ps(acc[r][c], _mm512_set1_ps(correction));
                row_max[r] = chunk_max;
            }
            const __m512 e = _mm512_maskz_mov_ps(mask, exp_avx512(_mm512_sub_ps(s, _mm512_set1_ps(row_max[r]))));
            row_sum[r] = _mm512_add_ps(row_sum[r], e);
            _mm512_storeu_ps(probs[r], e);
        }
        for (int r = 0; r < rows; r += 2) { /* two rows a pass: each V vector loaded once for both */
            const int pair = r + 1 < rows;
            __m512 s0[vecs], s1[vecs];
            for (int c = 0; c < vecs; c++) s0[c] = acc[r][c], s1[c] = pair ? acc[r + 1][c] : _mm512_setzero_ps();
            for (int j = 0; j < n; j++) {
                const __m512 p0 = _mm512_set1_ps(probs[r][j]), p1 = _mm512_set1_ps(pair ? probs[r + 1][j] : 0.0f);
                for (int c = 0; c < vecs; c++) {
                    s0[c] = _mm512_fmadd_ps(p0, vf[j][c], s0[c]);
                    s1[c] = _mm512_fmadd_ps(p1, vf[j][c], s1[c]);
                }
            }
            for (int c = 0; c < vecs; c++) {
                acc[r][c] = s0[c];
                if (pair) acc[r + 1][c] = s1[c];
            }
        }
        t += n;
    }
    for (int r = 0; r < rows; r++) {
        const float sum = _mm512_reduce_add_ps(row_sum[r]);
        const __m512 inv = _mm512_set1_ps(sum > 0.0f ? 1.0f / sum : 0.0f);
        const int64_t token = a->first_token + r / group, head = a->kv_head * group + r % group;
        const int64_t at = (token * a->num_heads + head) * head_dim;
        for (int c = 0; c < vecs; c++) store16(a->out, at + 16 * c, _mm512_mul_ps(acc[r][c], inv), 0xffff, dtype);
    }
}

static void prefill_tile(const struct prefill_task *a, const int dtype) {
    const int vecs = a->head_dim / 16;
#define PREFILL_SHAPE(v)                                                                              \
    if (vecs == (v)) {                                                                                \
        if (dtype == DTYPE_BF16) prefill_tile_shaped(a, DTYPE_BF16, v); else prefill_tile_shaped(a, DTYPE_F32, v); \
        return;                                                                                       \
    }
    PREFILL_SHAPE(4) PREFILL_SHAPE(8)
#undef PREFILL_SHAPE
    if (dtype == DTYPE_BF16) prefill_tile_shaped(a, DTYPE_BF16, vecs); else prefill_tile_shaped(a, DTYPE_F32, vecs);
}

/* 0 where the kernel takes these shapes and tables; else -1 (shapes, or new tokens past a context) or -2 (a
 * block outside the cache). Checked before anything is written (the fused decode layers check up front). */
static int prefill_refuses(const int32_t *block_tables, int64_t block_table_stride, const int32_t *seq_starts,
                           const int32_t *context_lens, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                           int block_size, int num_blocks) {
    const int group = num_heads / num_kv_heads;
    if (head_dim % 16 || head_dim > MAX_HEAD_DIM || group > MAX_GROUP || group * num_kv_heads != num_heads) return -1;
    for (int seq = 0; seq < num_seqs; seq++) {
        const int new_tokens = seq_starts[seq + 1] - seq_starts[seq];
        if (new_tokens < 0 || new_tokens > context_lens[seq]) return -1;
    }
    return blocks_exist(block_tables, block_table_stride, context_lens, num_seqs, block_size, num_blocks) ? 0 : -2;
}

int pagoda_prefill_attention(const void *q, int64_t q_token_stride, int64_t q_head_stride, const void *k_cache,
                             const void *v_cache, const int32_t *block_tables, int64_t block_table_stride,
                             const int32_t *seq_starts, const int32_t *context_lens, void *out, int num_seqs,
                             int num_heads, int num_kv_heads, int head_dim, int block_size, int num_blocks,
                             float scale, int sliding_window, int dtype, int num_threads) {
    const int group = num_heads / num_kv_heads;
    const int refused = prefill_refuses(block_tables, block_table_stride, seq_starts, context_lens, num_seqs, num_heads,
                                        num_kv_heads, head_dim, block_size, num_blocks);
    if (refused) return refused;
    int tiles = 0;
    for (int seq = 0; seq < num_seqs; seq++)
        tiles += (seq_starts[seq + 1] - seq_starts[seq] + PREFILL_TILE - 1) / PREFILL_TILE;
    int *tile_seq = malloc((size_t)(tiles > 0 ? tiles : 1) * 2 * sizeof(int)), *tile_first = tile_seq + tiles;
    if (!tile_seq) return -1;
    for (int seq = 0, at = 0; seq < num_seqs; seq++)
        for (int first = seq_starts[seq]; first < seq_starts[seq + 1]; first += PREFILL_TILE, at++)
            tile_seq[at] = seq, tile_first[at] = first;
    /* KV head by KV head: both threads then read one head's rows, which stay in their L2; each head's
     * tiles from the last (which see the most keys) so the shorter ones even out the end. */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int task = 0; task < tiles * num_kv_heads; task++) {
        const int kv_head = task / tiles, tile = tiles - 1 - task % tiles;
        const int seq = tile_seq[tile], first = tile_first[tile];
        const int left = seq_starts[seq + 1] - first;
        const int new_tokens = seq_starts[seq + 1] - seq_starts[seq];
        const struct prefill_task a = {
            .q = q, .k_cache = k_cache, .v_cache = v_cache, .out = out,
            .table = block_tables + seq * block_table_stride,
            .q_token_stride = q_token_stride, .q_head_stride = q_head_stride,
            .kv_offset = (int64_t)kv_head * head_dim, .token_stride = (int64_t)num_kv_heads * head_dim,
            .first_token = first, .first_pos = context_lens[seq] - new_tokens + (first - seq_starts[seq]),
            .tokens = left < PREFILL_TILE ? left : PREFILL_TILE,
            .kv_head = kv_head, .group = group, .num_heads = num_heads, .head_dim = head_dim,
            .block_size = block_size, .window = sliding_window > 0 ? sliding_window : 0, .scale = scale,
        };
        if (dtype == DTYPE_BF16) prefill_tile(&a, DTYPE_BF16); else prefill_tile(&a, DTYPE_F32);
    }
    free(tile_seq);
    return 0;
}
#else
int pagoda_prefill_attention(const void *q, int64_t q_token_stride, int64_t q_head_stride, const void *k_cache,
                             const void *v_cache, const int32_t *block_tables, int64_t block_table_stride,
                             const int32_t *seq_starts, const int32_t *context_lens, void *out, int num_seqs,
                             int num_heads, int num_kv_heads, int head_dim, int block_size, int num_blocks,
                             float scale, int sliding_window, int dtype, int num_threads) {
    return -1; /* the AVX-512 kernel only: elsewhere torch's flash attention */
}

static int prefill_refuses(const int32_t *block_tables, int64_t block_table_stride, const int32_t *seq_starts,
                           const int32_t *context_lens, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                           int block_size, int num_blocks) {
    return -1;
}
#endif

/* ---- Fused per-token ops: one call where torch runs several small ops, each paying a dispatch ----
 * Rounding follows the model dtype where transformers rounds (the residual sum, the normalized
 * value before the weight), so bf16 results stay those of the op-by-op path. */

static inline float round_to(float v, int dtype) { return dtype == DTYPE_BF16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

/* Whether a per-row op of `rows` x `row_elems` is worth both threads: a fork and join costs ~0.7 us
 * here, what ~2k elements of a norm, the rotary or SiLU x up take on one core (Sapphire Rapids class). */
#define SPLIT_ELEMS 2048
static inline int split_rows(int rows, int64_t row_elems) { return rows > 1 && rows * row_elems >= SPLIT_ELEMS; }

/* Each fused op is a per-row function of a constant dtype, called from the parallel loop in both
 * instantiations: with the dtype known, its conversions and roundings vectorize. */
#define PER_DTYPE(row_fn, ...) \
    (dtype == DTYPE_BF16 ? row_fn(__VA_ARGS__, DTYPE_BF16) : row_fn(__VA_ARGS__, DTYPE_F32))
#define MAX_HIDDEN 16384

INLINE void rms_norm_row(const void *x, const void *residual, void *summed, const void *weight, void *out,
                         int64_t offset, int hidden, float eps, const int dtype) {
    float row[MAX_HIDDEN], other[MAX_HIDDEN];
    load_f32(x, offset, dtype, row, hidden);
    if (residual) {
        load_f32(residual, offset, dtype, other, hidden);
#pragma omp simd
        for (int i = 0; i < hidden; i++) row[i] = round_to(row[i] + other[i], dtype);
        store_f32(summed, offset, dtype, row, hidden);
    }
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int i = 0; i < hidden; i++) squares += row[i] * row[i];
    const float inv = 1.0f / sqrtf(squares / hidden + eps);
    load_f32(weight, 0, dtype, other, hidden);
#pragma omp simd
    for (int i = 0; i < hidden; i++) row[i] = other[i] * round_to(row[i] * inv, dtype);
    store_f32(out, offset, dtype, row, hidden);
}

/* With residual: summed = x + residual, out = weight * rmsnorm(summed). Without: out = weight * rmsnorm(x).
 * All [rows, hidden] contiguous; weight [hidden]. */
int pagoda_rms_norm(const void *x, const void *residual, void *summed, const void *weight, void *out, int rows,
                    int hidden, float eps, int dtype, int num_threads) {
    if (hidden > MAX_HIDDEN) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (split_rows(rows, hidden))
    for (int r = 0; r < rows; r++)
        PER_DTYPE(rms_norm_row, x, residual, summed, weight, out, (int64_t)r * hidden, hidden, eps);
    return 0;
}

/* x * cos + rotate_half(x) * sin for each head of a token, in place, rounded after each op as torch's
 * three ops are (hence no contraction into fused multiply-adds). Each half of a head is one loop over
 * contiguous lanes: rotate_half's negation is exact, so -(a * b) rounds as a * b does. */
#define NO_CONTRACTION __attribute__((optimize("fp-contract=off")))
static inline __attribute__((always_inline)) NO_CONTRACTION void rotate_heads(
    void *x, int64_t offset, int heads, int head_dim, const float *cos, const float *sin, const int dtype) {
    const int half = head_dim / 2;
    float row[MAX_HEAD_DIM], out[MAX_HEAD_DIM];
    for (int h = 0; h < heads; h++) {
        const int64_t at = offset + (int64_t)h * head_dim;
        load_f32(x, at, dtype, row, head_dim);
#pragma omp simd
        for (int i = 0; i < half; i++) {
            out[i] = round_to(round_to(row[i] * cos[i], dtype) - round_to(row[i + half] * sin[i], dtype), dtype);
            out[i + half] = round_to(
                round_to(row[i + half] * cos[i + half], dtype) + round_to(row[i] * sin[i + half], dtype), dtype);
        }
        store_f32(x, at, dtype, out, head_dim);
    }
}

static NO_CONTRACTION void rotate(void *x, int64_t offset, int heads, int head_dim, const float *cos,
                                  const float *sin, int dtype) {
    PER_DTYPE(rotate_heads, x, offset, heads, head_dim, cos, sin);
}

INLINE void rotary_row(void *x, int64_t offset, int heads, int head_dim, const void *cos, const void *sin,
                       int64_t angle_offset, const int dtype) {
    float cos32[MAX_HEAD_DIM], sin32[MAX_HEAD_DIM];
    load_f32(cos, angle_offset, dtype, cos32, head_dim);
    load_f32(sin, angle_offset, dtype, sin32, head_dim);
    rotate(x, offset, heads, head_dim, cos32, sin32, dtype);
}

/* Rotary embeddings in place: x rows of `heads` heads side by side (row r starts at r * row_stride
 * elements, its heads contiguous), cos/sin [rows, head_dim] contiguous, all in the model dtype.
 * torch's five ops made a temporary each: a 2,000-token prompt's q and k, 30 layers, 86-126 ms in fp32
 * (14 here), 54-124 in bf16 (16-18). */
int pagoda_rotary(void *x, int64_t row_stride, int rows, int heads, int head_dim, const void *cos, const void *sin,
                  int dtype, int num_threads) {
    if (head_dim > MAX_HEAD_DIM || head_dim % 2) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (split_rows(rows, (int64_t)heads * head_dim))
    for (int r = 0; r < rows; r++)
        PER_DTYPE(rotary_row, x, (int64_t)r * row_stride, heads, head_dim, cos, sin, (int64_t)r * head_dim);
    return 0;
}

/* out [rows, inter] = silu(gate) * up of gate_up [rows, 2 * inter] contiguous (gate first), a vector
 * (16 or 8 elements) at a time.
 * bf16 rounds where torch's two ops do: silu(gate), then the product. */
#if defined(__AVX512F__)
INLINE void silu_mul_row(const void *gate_up, void *out, int64_t row, int inter, const int dtype) {
    const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
    for (int i = 0; i < inter; i += 16) {
        const __mmask16 mask = inter - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (inter - i)) - 1);
        const __m512 gate = load16(gate_up, row * 2 * inter + i, mask, dtype);
        const __m512 up = load16(gate_up, row * 2 * inter + inter + i, mask, dtype);
        const __m512 silu = _mm512_div_ps(gate, _mm512_add_ps(one, exp_avx512(_mm512_sub_ps(zero, gate))));
        store16(out, row * inter + i, _mm512_mul_ps(round16(silu, dtype), up), mask, dtype);
    }
}
#elif defined(PAGODA_AVX2)
INLINE void silu_mul_row(const void *gate_up, void *out, int64_t row, int inter, const int dtype) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (int i = 0; i < inter; i += 8) {
        const int n = inter - i;
        const __m256 gate = load8(gate_up, row * 2 * inter + i, n, dtype);
        const __m256 up = load8(gate_up, row * 2 * inter + inter + i, n, dtype);
        const __m256 silu = _mm256_div_ps(gate, _mm256_add_ps(one, exp_avx2(_mm256_sub_ps(zero, gate))));
        store8(out, row * inter + i, _mm256_mul_ps(round8(silu, dtype), up), n, dtype);
    }
}
#endif

#if defined(__AVX512F__) || defined(PAGODA_AVX2)
int pagoda_silu_mul(const void *gate_up, void *out, int rows, int inter, int dtype, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (split_rows(rows, inter))
    for (int r = 0; r < rows; r++) PER_DTYPE(silu_mul_row, gate_up, out, r, inter);
    return 0;
}
#else
int pagoda_silu_mul(const void *gate_up, void *out, int rows, int inter, int dtype, int num_threads) {
    return -1;
}
#endif

/* ---- Each row's greedy token and log-normalizer, for fp32 logits [rows, vocab] -----------------------
 * One pass for the maximum and its first index (lane by lane, then the lowest index among the lanes
 * holding it), one for the sum of exponentials. torch's argmax alone took ~16x its amax at a 49k
 * vocabulary: a tenth of a 16-row decode step. A row with a NaN or a maximum that is not finite gets
 * index -1: the caller applies torch's rules to it. */
#if defined(__AVX512F__)
static void argmax_logsumexp_row(const float *x, int vocab, int64_t *index, float *log_norm) {
    const __m512 lowest = _mm512_set1_ps(-INFINITY);
    __m512 best = lowest;
    __m512i best_at = _mm512_setzero_si512(), at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __mmask16 nan = 0;
    for (int i = 0; i < vocab; i += 16) {
        const __mmask16 m = vocab - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (vocab - i)) - 1);
        const __m512 v = _mm512_mask_loadu_ps(lowest, m, x + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        const __mmask16 above = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ); /* strictly: a lane keeps its first */
        best = _mm512_mask_mov_ps(best, above, v);
        best_at = _mm512_mask_mov_epi32(best_at, above, at);
        at = _mm512_add_epi32(at, _mm512_set1_epi32(16));
    }
    const float top = _mm512_reduce_max_ps(best);
    if (nan || !isfinite(top)) {
        *index = -1;
        return;
    }
    *index = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ), best_at);
    __m512 sums[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const __m512 shift = _mm512_set1_ps(top);
    for (int i = 0, chain = 0; i < vocab; i += 16, chain = (chain + 1) & 3) {
        const __mmask16 m = vocab - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (vocab - i)) - 1);
        const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), shift));
        sums[chain] = _mm512_add_ps(sums[chain], _mm512_maskz_mov_ps(m, e));
    }
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(sums[0], sums[1]), _mm512_add_ps(sums[2], sums[3]));
    *log_norm = top + logf(_mm512_reduce_add_ps(sum));
}
#elif defined(PAGODA_AVX2)
static void argmax_logsumexp_row(const float *x, int vocab, int64_t *index, float *log_norm) {
    const __m256 lowest = _mm256_set1_ps(-INFINITY);
    __m256 best = lowest, nan = _mm256_setzero_ps();
    __m256i best_at = _mm256_setzero_si256(), at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int i = 0; i < vocab; i += 8) {
        const __m256 v = vocab - i >= 8 ? _mm256_loadu_ps(x + i)
                                        : _mm256_blendv_ps(lowest, load8(x, i, vocab - i, DTYPE_F32),
                                                           _mm256_castsi256_ps(lanes_below(vocab - i)));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        const __m256 above = _mm256_cmp_ps(v, best, _CMP_GT_OQ); /* strictly: a lane keeps its first */
        best = _mm256_blendv_ps(best, v, above);
        best_at = _mm256_blendv_epi8(best_at, at, _mm256_castps_si256(above));
        at = _mm256_add_epi32(at, _mm256_set1_epi32(8));
    }
    float lanes[8];
    int32_t lane_at[8];
    _mm256_storeu_ps(lanes, best);
    _mm256_storeu_si256((__m256i *)lane_at, best_at);
    float top = lanes[0];
    for (int l = 1; l < 8; l++) top = lanes[l] > top ? lanes[l] : top;
    if (_mm256_movemask_ps(nan) || !isfinite(top)) {
        *index = -1;
        return;
    }
    int32_t first = INT32_MAX;
    for (int l = 0; l < 8; l++)
        if (lanes[l] == top && lane_at[l] < first) first = lane_at[l];
    *index = first;
    __m256 sums[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    const __m256 shift = _mm256_set1_ps(top);
    for (int i = 0, chain = 0; i < vocab; i += 8, chain = (chain + 1) & 3) {
        const __m256 e = exp_avx2(_mm256_sub_ps(load8(x, i, vocab - i, DTYPE_F32), shift));
        sums[chain] = _mm256_add_ps(sums[chain], _mm256_and_ps(e, _mm256_castsi256_ps(lanes_below(vocab - i))));
    }
    *log_norm = top + logf(hsum8(_mm256_add_ps(_mm256_add_ps(sums[0], sums[1]), _mm256_add_ps(sums[2], sums[3]))));
}
#endif

#if defined(__AVX512F__) || defined(PAGODA_AVX2)
/* Returns how many rows were left to the caller. */
int pagoda_argmax_logsumexp(const float *logits, int rows, int vocab, int64_t *index, float *log_norm,
                            int num_threads) {
    int left = 0;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (split_rows(rows, vocab)) reduction(+ : left)
    for (int r = 0; r < rows; r++) {
        argmax_logsumexp_row(logits + (int64_t)r * vocab, vocab, index + r, log_norm + r);
        left += index[r] < 0;
    }
    return left;
}
#else
int pagoda_argmax_logsumexp(const float *logits, int rows, int vocab, int64_t *index, float *log_norm,
                            int num_threads) {
    return -1;
}
#endif

/* ---- Each row's sampled token at one uniform number, for fp32 logits [rows, vocab] ---------------
 * The inverse of softmax(x / t)'s cumulative distribution at u, as the sampler's torch path takes it
 * (the first token whose running sum of probabilities exceeds u x the total), without the
 * distribution written out: a pass for the maximum, a pass for the exponentials exp((x - max) / t)
 * summed per chunk of SAMPLE_CHUNK tokens, then a walk over the chunk sums (in double) to the chunk
 * that crosses u x the total, and over that chunk's tokens. The walk adds the same chunk sums in the
 * same order as the total, so it crosses; inside the chunk a token's own exponential decides, and a
 * rounding gap there falls to the chunk's last token of nonzero probability. A -inf logit has
 * probability 0 and is never chosen. torch's divide, softmax, cumsum and searchsorted took ~0.5 ms a
 * row at a 49k vocabulary (2.6 ms for 16 rows), ~1 ms in a decode step whose weights had evicted them
 * from the caches. A row with a NaN or a maximum that is not finite gets -1: the caller's torch path. */
#define SAMPLE_CHUNK 64

/* exp((x[i] - top) * inv_t) for i < n <= SAMPLE_CHUNK (0 for x[i] = -inf), into out when it is not
 * NULL; returns their sum, added lane by lane, then across the lanes. */
#if defined(__AVX512F__)
static inline float exp_chunk(const float *x, int n, float top, float inv_t, float *out) {
    __m512 sum = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
        const __mmask16 keep = m & _mm512_cmp_ps_mask(v, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
        const __m512 e = _mm512_maskz_mov_ps(
            keep, exp_avx512(_mm512_mul_ps(_mm512_sub_ps(v, _mm512_set1_ps(top)), _mm512_set1_ps(inv_t))));
        sum = _mm512_add_ps(sum, e);
        if (out) _mm512_mask_storeu_ps(out + i, m, e);
    }
    return _mm512_reduce_add_ps(sum);
}

/* The row's maximum; *nan set if it holds a NaN. */
static inline float row_max(const float *x, int vocab, int *nan) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    __mmask16 unordered = 0;
    for (int i = 0; i < vocab; i += 16) {
        const __mmask16 m = vocab - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (vocab - i)) - 1);
        const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, x + i);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        top = _mm512_max_ps(top, v);
    }
    *nan = unordered != 0;
    return _mm512_reduce_max_ps(top);
}
#elif defined(PAGODA_AVX2)
static inline float exp_chunk(const float *x, int n, float top, float inv_t, float *out) {
    __m256 sum = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) {
        const __m256 v = load8(x, i, n - i, DTYPE_F32);
        const __m256 keep = _mm256_and_ps(_mm256_cmp_ps(v, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ),
                                          _mm256_castsi256_ps(lanes_below(n - i)));
        const __m256 e = _mm256_and_ps(
            keep, exp_avx2(_mm256_mul_ps(_mm256_sub_ps(v, _mm256_set1_ps(top)), _mm256_set1_ps(inv_t))));
        sum = _mm256_add_ps(sum, e);
        if (out) store8(out, i, e, n - i, DTYPE_F32);
    }
    return hsum8(sum);
}

static inline float row_max(const float *x, int vocab, int *nan) {
    __m256 top = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    for (int i = 0; i < vocab; i += 8) {
        const __m256 v = vocab - i >= 8 ? _mm256_loadu_ps(x + i)
                                        : _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), load8(x, i, vocab - i, DTYPE_F32),
                                                           _mm256_castsi256_ps(lanes_below(vocab - i)));
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        top = _mm256_max_ps(top, v);
    }
    *nan = _mm256_movemask_ps(unordered) != 0;
    return hmax8(top);
}
#endif

#if defined(__AVX512F__) || defined(PAGODA_AVX2)
static inline int chunk_len(int vocab, int c) {
    return vocab - c * SAMPLE_CHUNK < SAMPLE_CHUNK ? vocab - c * SAMPLE_CHUNK : SAMPLE_CHUNK;
}

static int64_t sample_row(const float *x, int vocab, float inv_t, double u, float *chunk_sums) {
    int nan;
    const float top = row_max(x, vocab, &nan);
    if (nan || !isfinite(top)) return -1;
    const int chunks = (vocab + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK;
    double total = 0.0;
    for (int c = 0; c < chunks; c++) {
        const int n = chunk_len(vocab, c);
        chunk_sums[c] = exp_chunk(x + (int64_t)c * SAMPLE_CHUNK, n, top, inv_t, 0);
        total += chunk_sums[c];
    }
    const double target = u * total;
    double below = 0.0;
    for (int c = 0; c < chunks; c++) {
        if (below + chunk_sums[c] <= target) {
            below += chunk_sums[c];
            continue;
        }
        const int n = chunk_len(vocab, c);
        float e[SAMPLE_CHUNK];
        exp_chunk(x + (int64_t)c * SAMPLE_CHUNK, n, top, inv_t, e);
        int last = 0;
        for (int i = 0; i < n; i++) {
            if (e[i] > 0.0f) last = i;
            below += e[i];
            if (below > target) return (int64_t)c * SAMPLE_CHUNK + i; /* a 0 cannot cross: below was <= target */
        }
        return (int64_t)c * SAMPLE_CHUNK + last;
    }
    return -1; /* not reached for u < 1: the walk's last sum is the total */
}

/* Row r samples at temperature temps[r] with uniforms[r] in [0, 1), or takes its greedy token where
 * temps[r] is 0. With `logprob`, also each token's log-probability under the raw logits (the logit less
 * the row's logsumexp, in fp32 as torch subtracts): the sampler's whole work for rows that need nothing
 * else (no top-k / top-p / min-p, penalties or bias) in one call. The dozen torch ops around these
 * passes took a one-row decode step's sampling from ~0.06 to 0.2-0.35 ms, each slow on the caches the
 * step's weights had just streamed through. bf16 logits are widened a row at a time into the thread's
 * own fp32 row (the same values as torch's `.float()`, in L2): a fresh fp32 copy of a 16-row step's
 * logits (3 MB) took ~0.25 ms more. Returns how many rows were left to the caller (index -1: a NaN, or
 * a maximum that is not finite), or -1 without memory. */
int pagoda_sample_rows(const void *logits, int dtype, int rows, int vocab, const float *temps,
                       const double *uniforms, int64_t *index, float *logprob, int num_threads) {
    const int chunks = (vocab + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK;
    const int wide_rows = dtype == DTYPE_F32 ? 0 : num_threads;
    float *chunk_sums = malloc(((size_t)rows * chunks + (size_t)wide_rows * vocab) * sizeof(float));
    if (!chunk_sums) return -1;
    float *wide = chunk_sums + (size_t)rows * chunks;
    int left = 0;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (split_rows(rows, vocab)) reduction(+ : left)
    for (int r = 0; r < rows; r++) {
        const float *x = (const float *)logits + (int64_t)r * vocab;
        if (wide_rows) {
            float *row = wide + (size_t)omp_get_thread_num() * vocab;
            load_f32(logits, (int64_t)r * vocab, dtype, row, vocab);
            x = row;
        }
        float log_norm = 0.0f;
        index[r] = 0;
        if (logprob || temps[r] <= 0.0f) argmax_logsumexp_row(x, vocab, index + r, &log_norm);
        if (index[r] >= 0 && temps[r] > 0.0f)
            index[r] = sample_row(x, vocab, 1.0f / temps[r], uniforms[r], chunk_sums + (size_t)r * chunks);
        if (index[r] < 0)
            left++;
        else if (logprob)
            logprob[r] = x[index[r]] - log_norm;
    }
    free(chunk_sums);
    return left;
}
#else
int pagoda_sample_rows(const void *logits, int dtype, int rows, int vocab, const float *temps,
                       const double *uniforms, int64_t *index, float *logprob, int num_threads) {
    return -1;
}
#endif

/* k_cache/v_cache [num_blocks * block_size, kv_heads * head_dim] rows at `slots` (-1: skipped) take
 * key/value rows [tokens, kv_heads * head_dim] (token strides given, the rest contiguous). */
int pagoda_store_kv(const void *key, int64_t key_stride, const void *value, int64_t value_stride, void *k_cache,
                    void *v_cache, const int64_t *slots, int tokens, int row_elems, int64_t num_slots, int dtype) {
    const size_t size = dtype == DTYPE_BF16 ? 2 : 4, bytes = (size_t)row_elems * size;
    for (int t = 0; t < tokens; t++)
        if (slots[t] >= num_slots) return -1;
    for (int t = 0; t < tokens; t++) {
        if (slots[t] < 0) continue;
        memcpy((char *)k_cache + slots[t] * bytes, (const char *)key + t * key_stride * size, bytes);
        memcpy((char *)v_cache + slots[t] * bytes, (const char *)value + t * value_stride * size, bytes);
    }
    return 0;
}

/* ---- y[M, N] = x[M, K] W[N, K]^T (+ bias), for decode-sized steps ----------------------------
 * Tiles of up to 4 rows x 4 outputs: each weight row is read from DRAM once per step (the first
 * row tile; the others find it in L1) and every row of the step reuses it from registers. While the
 * row tiles compute, the weight rows of a tile ahead are prefetched, so the DRAM stream and the
 * arithmetic overlap (past a few rows the arithmetic is as long as the stream on two cores). The
 * four sums of a row leave as one vector: a scalar epilogue cost a fifth of the arithmetic at K=576. */
#define TILE 4
/* How far ahead of the row it computes a one-row kernel prefetches (the row that starts this many
 * bytes on). One core of a server Xeon reads ~12 GB/s from DRAM, bound by its misses in flight, and
 * its hardware prefetcher alone left the one-row kernels at 60-75 % of that (Sapphire Rapids class,
 * SmolLM2 at one row: bf16 layers + head 14.8 -> 10.3-11.0 ms, the 4-bit layers 12.4 -> 6.8 ms). */
#define ROW_AHEAD_BYTES 16384
/* Past this many bytes of rows, each output tile would read x from L2 again: two output tiles then
 * take each row tile in turn, so the second finds its rows in L1. Zen 5, SmolLM2's projections from
 * DRAM at 16-128 rows: bf16's down projection (x of 48-384 KB) 0.85-0.96x the time, fp32's 576-input
 * ones 0.78-0.95x; the engine's 12-16-row steps of the c16 workload fp32 0.85x, bf16 0.94-0.97x
 * (`kernel_ab.py`, twice each). Below it, two tiles' weight streams at once cost (bf16, 576 inputs at
 * 8-16 rows: 1.14-1.24x the time). The AVX2 tier (the x86-64-v3 build on Zen 5) never pairs: its
 * down projection paired at 6-11 rows took 1.03-1.07x the time. */
#if defined(__AVX512F__)
#define X_IN_L1_BYTES 32768
#else
#define X_IN_L1_BYTES INT64_MAX
#endif

/* The driver both element types share: 4-output tiles split between the threads, 4-row tiles within.
 * One row reuses nothing, so each thread reads its static share of the rows start to end, one output
 * at a time (a tile's four neighbouring rows plus the tile prefetch reached 75-85 % of a plain read:
 * Zen 4, SmolLM2's layers at one row bf16 8.3 -> 7.1 ms, fp32 15.6 -> 10.4 ms; at two rows the tiles
 * are ahead), the row ROW_AHEAD_BYTES on prefetched. Except where the L2 streamer carries the rows
 * (`streamer_carries_rows`): there the share is cut into TILE runs, and each tile takes an output of
 * each run, its four rows far apart read side by side with no prefetch (one output per call leaves an
 * fp32 row's 36 FMAs waiting on each other: 40.8 against 52.5 GB/s, Zen 5 at a 53 GB/s plain read). */
#define DEFINE_LINEAR(name, T, WT, tile_fn)                                                              \
    int name(const T *x, const WT *w, const T *bias, T *y, int M, int N, int K, int num_threads) {      \
        if (M == 1) {                                                                                   \
            const int carried = streamer_carries_rows();                                                \
            const int ahead = rows_ahead(K * (int64_t)sizeof(WT));                                      \
            _Pragma("omp parallel num_threads(num_threads)")                                            \
            {                                                                                           \
                const int t = omp_get_thread_num(), team = omp_get_num_threads();                       \
                const int lo = (int)((int64_t)N * t / team), hi = (int)((int64_t)N * (t + 1) / team);   \
                const int part = carried ? (hi - lo) / TILE : 0; /* outputs n, n + part, ... a tile */  \
                for (int n = lo; n < lo + part; n++)                                                    \
                    tile_fn(x, w + (int64_t)n * K, bias ? bias + n : 0, y + n, K, N, 1, TILE, 0, 0, part); \
                for (int n = lo + TILE * part; n < hi; n++) /* the row ahead a line per step */         \
                    tile_fn(x, w + (int64_t)n * K, bias ? bias + n : 0, y + n, K, N, 1, 1,              \
                            !carried && n + ahead < N ? w + (int64_t)(n + ahead) * K : 0, 1, 1);       \
            }                                                                                           \
            return 0;                                                                                   \
        }                                                                                               \
        const int tiles = (N + TILE - 1) / TILE;                                                        \
        const int row_tiles = (M + TILE - 1) / TILE, share = (TILE + row_tiles - 1) / row_tiles;        \
        const int tiles_ahead = row_tiles == 1 ? 1 : 2; /* the tile whose weights are prefetched */     \
        const int pair = (int64_t)M * K * (int64_t)sizeof(T) > X_IN_L1_BYTES ? 2 : 1;                  \
        _Pragma("omp parallel for schedule(guided) num_threads(num_threads)")                           \
        for (int first_tile = 0; first_tile < tiles; first_tile += pair)                                \
            for (int m0 = 0; m0 < M; m0 += TILE)                                                        \
                for (int tile = first_tile; tile < first_tile + pair && tile < tiles; tile++) {          \
                    const int n0 = tile * TILE, NB = N - n0 < TILE ? N - n0 : TILE;                      \
                    const int MB = M - m0 < TILE ? M - m0 : TILE;                                        \
                    const WT *wn = w + (int64_t)n0 * K;                                                  \
                    const T *bn = bias ? bias + n0 : 0, *xm = x + (int64_t)m0 * K;                      \
                    T *ym = y + (int64_t)m0 * N + n0;                                                   \
                    /* one row tile asks for the next tile; more share the tile after the next, each */ \
                    /* its rows of it a line per step, so the stream runs through all of the tile's */  \
                    /* arithmetic (the first row tile asking for all of it: fp32 at 16 rows 29.0 -> */  \
                    /* 25.3 ms for SmolLM2's weights, Sapphire Rapids class; lines asked for twice */   \
                    /* cost 3-14 %) */                                                                  \
                    const WT *ahead = tile + tiles_ahead < tiles ? wn + (int64_t)tiles_ahead * TILE * K : 0; \
                    const int beyond = N - n0 - tiles_ahead * TILE;                                      \
                    const int first = m0 / TILE * share, left = (beyond < TILE ? beyond : TILE) - first; \
                    const int pf_rows = left < share ? left : share;                                    \
                    const WT *pf = ahead && pf_rows > 0 ? ahead + (int64_t)first * K : 0;               \
                    switch (MB * 8 + NB) { /* constant tile sizes: the accumulators stay in registers */ \
                        TILE_CASES(tile_fn)                                                             \
                    }                                                                                   \
                }                                                                                       \
        return 0;                                                                                       \
    }
#define TILE_CASE(tile_fn, mb, nb) \
    case (mb) * 8 + (nb): tile_fn(xm, wn, bn, ym, K, N, mb, nb, pf, pf_rows, 1); break;
#define TILE_CASES(f)                                                                     \
    TILE_CASE(f, 1, 1) TILE_CASE(f, 1, 2) TILE_CASE(f, 1, 3) TILE_CASE(f, 1, 4)           \
    TILE_CASE(f, 2, 1) TILE_CASE(f, 2, 2) TILE_CASE(f, 2, 3) TILE_CASE(f, 2, 4)           \
    TILE_CASE(f, 3, 1) TILE_CASE(f, 3, 2) TILE_CASE(f, 3, 3) TILE_CASE(f, 3, 4)           \
    TILE_CASE(f, 4, 1) TILE_CASE(f, 4, 2) TILE_CASE(f, 4, 3) TILE_CASE(f, 4, 4)

#if defined(__AVX512F__)
/* A tile's accumulators, one vector per (row, output), zeroed. */
#define TILE_ACCUMULATORS(acc, MB, NB)                                                       \
    __m512 acc[TILE][TILE];                                                                  \
    for (int m = 0; m < MB; m++)                                                             \
        for (int n = 0; n < NB; n++) acc[m][n] = _mm512_setzero_ps();

/* The row sums of acc[m][0..NB) for the tile's rows, in out[m][n]. */
#define TILE_SUMS(acc, out, MB, NB)                                                          \
    for (int m = 0; m < MB; m++) {                                                           \
        if (NB == TILE)                                                                      \
            _mm_storeu_ps(out[m], sum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));         \
        else                                                                                 \
            for (int n = 0; n < NB; n++) out[m][n] = _mm512_reduce_add_ps(acc[m][n]);        \
    }
#endif

#if defined(__AVX512F__) || defined(PAGODA_AVX2)
/* The next tile's weights, `next_rows` cache lines per step of the k loop, in address order: a
 * tile's rows are contiguous, and one sequential stream runs at 30+ GB/s where a line of each row
 * per step (four interleaved streams) reached ~22 (one row, Zen 4). Into L2, not L1: a prefetch to L1
 * holds one of its few miss buffers until the line arrives, which capped the stream while the rows
 * compute (Zen 4, 8-16 rows: +40-70 % and +20-40 % GFLOP/s; one row: the same). */
#define PREFETCH_NEXT(next, next_rows, K, k)                                                 \
    if (next)                                                                                \
        for (int n = 0; n < next_rows; n++)                                                  \
            _mm_prefetch((const char *)(next) + ((int64_t)(k) / (64 / sizeof *(next)) * (next_rows) + n) * 64, _MM_HINT_T2);

/* A one-row kernel prefetches, into L2, the weight row `rows_ahead` rows on (see ROW_AHEAD_BYTES):
 * the dense ones a line per step of their inner loop (the whole row at once was 10-15 % slower in
 * bf16), the low-bit ones the whole row before computing one (`prefetch_span`). */
static inline int rows_ahead(int64_t row_bytes) { return (int)(ROW_AHEAD_BYTES / row_bytes) + 1; }

/* ---- One row: several weight streams per thread ----------------------------------------------
 * A one-row step reads every weight once, so the weight stream bounds it. One sequential stream per
 * core read 29-31 GB/s on Zen 3, where a plain read walking four places of its share at once read
 * 38-50 (the L2 streamer follows each stream on its own: more lines in flight). So where the
 * streamer carries them, a thread cuts its share of the outputs into TILE runs and a tile takes an
 * output of each (DEFINE_LINEAR), with no software prefetch: SmolLM2's layers + head at one row, bf16,
 * AVX2 on Zen 3: 7.7-8.2 -> 7.3-7.6 ms (best of 11, the two builds alternated), ahead of a plain read
 * of the same bytes in one stream per core; the prefetch on top made it 2-5 % slower. On a Sapphire
 * Rapids class Xeon the AVX-512 tier's one stream with its prefetch stayed ahead (four streams
 * 1.02-1.15x slower), so there the AVX-512 tier leaves the runs to AMD:
 * Zen 5, SmolLM2's projections and head at one row, a plain read at 50-53 GB/s: bf16 in one run with
 * the prefetch 38.6 GB/s, without it 41.9-47.1, four runs 49.5-53.5 (one row per call; a tile of four
 * far-apart rows 51.7); fp32 in four runs one row per call 40.8, a tile of four 52.5. At 33 GB/s all
 * of them read 30.5-35. The low-bit rows, more arithmetic per byte, keep their prefetch everywhere
 * (the 4-bit ones without: 1.03x). */
static inline int streamer_carries_rows(void) {
#if defined(__AVX512F__)
    return __builtin_cpu_is("amd");
#else
    return 1;
#endif
}

static inline void prefetch_span(const void *start, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch((const char *)start + at, _MM_HINT_T2);
}
#endif

#if defined(__AVX512BF16__)
int pagoda_has_bf16_linear(void) { return 1; }

static inline __attribute__((always_inline)) void tile_bf16(const uint16_t *x, const uint16_t *w,
                                                            const uint16_t *bias, uint16_t *y, int K,
                                                            int ldy, const int MB, const int NB,
                                                            const uint16_t *next, int next_rows, int64_t apart) {
    TILE_ACCUMULATORS(acc, MB, NB)
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        PREFETCH_NEXT(next, next_rows, K, k)
        __m512bh wv[TILE];
        for (int n = 0; n < NB; n++) wv[n] = (__m512bh)_mm512_loadu_si512(w + n * apart * K + k);
        for (int m = 0; m < MB; m++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (int64_t)m * K + k);
            for (int n = 0; n < NB; n++) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv, wv[n]);
        }
    }
    if (k < K) {
        const __mmask32 mask = _cvtu32_mask32((uint32_t)((1ull << (K - k)) - 1));
        __m512bh wv[TILE];
        for (int n = 0; n < NB; n++) wv[n] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + n * apart * K + k);
        for (int m = 0; m < MB; m++) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + (int64_t)m * K + k);
            for (int n = 0; n < NB; n++) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv, wv[n]);
        }
    }
    if (NB == TILE) { /* a row's four outputs summed, biased and rounded as one vector */
        const __m128 b4 = !bias ? _mm_setzero_ps()
                          : apart == 1 ? _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)bias)), 16))
                                       : _mm_setr_ps(bf16_to_f32(bias[0]), bf16_to_f32(bias[apart]),
                                                     bf16_to_f32(bias[2 * apart]), bf16_to_f32(bias[3 * apart]));
        for (int m = 0; m < MB; m++) {
            const __m128 sums = _mm_add_ps(sum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]), b4);
            const __m256i bits = _mm512_cvtepi32_epi16(bf16_bits(_mm512_zextps128_ps512(sums)));
            if (apart == 1) {
                _mm_storel_epi64((__m128i *)(y + (int64_t)m * ldy), _mm256_castsi256_si128(bits));
            } else {
                uint16_t out[8];
                _mm_storeu_si128((__m128i *)out, _mm256_castsi256_si128(bits));
                for (int n = 0; n < TILE; n++) y[(int64_t)m * ldy + n * apart] = out[n];
            }
        }
        return;
    }
    float sums[TILE][TILE];
    TILE_SUMS(acc, sums, MB, NB)
    for (int m = 0; m < MB; m++)
        for (int n = 0; n < NB; n++)
            y[(int64_t)m * ldy + n * apart] = f32_to_bf16(sums[m][n] + (bias ? bf16_to_f32(bias[n * apart]) : 0.0f));
}

DEFINE_LINEAR(pagoda_linear_bf16, uint16_t, uint16_t, tile_bf16)
#elif !defined(PAGODA_AVX2) /* AVX2's bf16 linear widens to fp32: with its fp32 kernels below */
int pagoda_has_bf16_linear(void) { return 0; }
int pagoda_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int M, int N,
                       int K, int num_threads) {
    return -1;
}
#endif


/* ---- AMX: y[M, N] = x W^T in bf16 for CPUs with tile registers --------------------------------
 * The weight is read in its own row-major layout as the A operand (16 weight rows x 32 inputs a
 * tile), the step's rows are packed once per call as the B operand (pairs of inputs, VNNI order),
 * so C holds 16 outputs x 16 rows. One tile instruction does 16 x 16 x 32 multiply-adds (~5.5 ns on
 * one core here): at up to 16 rows the weight stream sets the pace; past that each weight tile feeds
 * two row tiles, and a step of 64-512 rows takes 0.65-0.9x oneDNN's time (which reorders the weight
 * on every call; Sapphire Rapids class, SmolLM2's projections, docs/benchmarks.md). */
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int pagoda_amx_init(void) { /* Linux hands tile state to a process only on request */
    return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
}

struct tile_config {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

int pagoda_linear_bf16_amx(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int M,
                           int N, int K, int num_threads) {
    if (M < 1 || K % 32 || N < 16) return -1;
    /* B: [K/2][padded] input pairs; past 16 rows, padded with zero rows to whole tiles of 16 */
    const int pairs = K / 2, full = N / 16 * 16, padded = M <= 16 ? M : (M + 15) / 16 * 16;
    const int row_tiles = (padded + 15) / 16, cols = M <= 16 ? M : 16;
    uint32_t *packed = malloc((size_t)pairs * padded * sizeof *packed); /* every entry written below */
    if (!packed) return -1;
    const uint32_t *x32 = (const uint32_t *)x;
    /* Tiles 0-3 accumulate, 4-5 hold weights (A), 6-7 rows (B): a pass takes 2 output tiles x up to 2
     * row tiles, each A and B feeding two. 32 weight rows a pass, not 64: at up to 16 rows their
     * interleaved streams then stay within what the hardware prefetcher follows (2-16 rows 5-8 %
     * faster, Sapphire Rapids class). */
    const int groups = (full / 16 + 1) / 2;
#pragma omp parallel num_threads(num_threads)
    {
        struct tile_config cfg = {0};
        cfg.palette_id = 1;
        for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
        for (int t = 0; t < 4; t++) cfg.colsb[t] = (uint16_t)(4 * cols); /* C */
        cfg.colsb[6] = cfg.colsb[7] = (uint16_t)(4 * cols);            /* B */
        _tile_loadconfig(&cfg);
#pragma omp for schedule(static) /* 16 pairs x 16 rows a block, transposed in registers */
        for (int p0 = 0; p0 < pairs; p0 += 16)
            for (int m0 = 0; m0 < M; m0 += 16) {
                __m512 r[16];
                for (int m = 0; m < 16; m++)
                    r[m] = m0 + m < M ? _mm512_loadu_ps(x32 + (int64_t)(m0 + m) * pairs + p0) : _mm512_setzero_ps();
                transpose16(r);
                const __mmask16 width = padded - m0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (padded - m0)) - 1);
                for (int p = 0; p < 16; p++) _mm512_mask_storeu_ps(packed + (int64_t)(p0 + p) * padded + m0, width, r[p]);
            }
        float out[16 * 16] = {0}; /* C rows of `cols` values: the rest stays 0 */
#pragma omp for schedule(static)
        for (int group = 0; group < groups; group++) {
            const int n0 = group * 32, tiles = full - n0 < 32 ? 1 : 2;
            const uint16_t *a = w + (int64_t)n0 * K;
            const int64_t a_tile = 16 * (int64_t)K;
            for (int r0 = 0; r0 < row_tiles; r0 += 2) {
                const int two_rows = r0 + 1 < row_tiles;
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                for (int k = 0; k < K; k += 32) {
                    /* the next group's weights into L2, in address order, while this one computes (one
                     * row tile: the hardware's prefetch alone was as fast) */
                    if (row_tiles > 1 && r0 == 0 && group + 1 < groups) {
                        const int64_t lines = 2 * 16 * (int64_t)K * 2 / 64, steps = K / 32;
                        const char *next = (const char *)(a + 2 * a_tile);
                        for (int64_t l = lines * (k / 32) / steps; l < lines * (k / 32 + 1) / steps; l++)
                            _mm_prefetch(next + l * 64, _MM_HINT_T2);
                    }
                    const uint32_t *b = packed + (int64_t)(k / 2) * padded + 16 * r0;
                    _tile_loadd(6, b, 4 * padded);
                    _tile_loadd(4, a + k, 2 * K); _tile_dpbf16ps(0, 4, 6);
                    if (tiles > 1) { _tile_loadd(5, a + a_tile + k, 2 * K); _tile_dpbf16ps(2, 5, 6); }
                    if (two_rows) {
                        _tile_loadd(7, b + 16, 4 * padded); _tile_dpbf16ps(1, 4, 7);
                        if (tiles > 1) _tile_dpbf16ps(3, 5, 7);
                    }
                }
                for (int c = 0; c < 4; c++) { /* C tile c: output tile c / 2, row tile r0 + c % 2 */
                    const int t = c / 2, r = c % 2;
                    if (t >= tiles || (r == 1 && !two_rows)) continue;
                    switch (c) {
                        case 0: _tile_stored(0, out, 64); break;
                        case 1: _tile_stored(1, out, 64); break;
                        case 2: _tile_stored(2, out, 64); break;
                        default: _tile_stored(3, out, 64); break;
                    }
                    const int nt = n0 + 16 * t, m0 = 16 * (r0 + r);
                    const __m512 b16 = bias ? load16(bias, nt, 0xffff, DTYPE_BF16) : _mm512_setzero_ps();
                    __m512 v[16]; /* C's 16 outputs x 16 rows, transposed: a row's 16 outputs each */
                    for (int n = 0; n < 16; n++) v[n] = _mm512_loadu_ps(out + 16 * n);
                    transpose16(v);
                    for (int m = m0; m < M && m < m0 + 16; m++)
                        _mm256_storeu_si256((__m256i *)(y + (int64_t)m * N + nt),
                                            _mm512_cvtepi32_epi16(bf16_bits(_mm512_add_ps(v[m - m0], b16))));
                }
            }
        }
        _tile_release();
    }
    if (full < N) { /* the last N % 16 outputs */
        for (int m0 = 0; m0 < M; m0 += TILE)
            for (int n0 = full; n0 < N; n0++) {
                const int MB = M - m0 < TILE ? M - m0 : TILE;
                const uint16_t *xm = x + (int64_t)m0 * K, *wn = w + (int64_t)n0 * K, *bn = bias ? bias + n0 : 0;
                uint16_t *ym = y + (int64_t)m0 * N + n0;
                const uint16_t *pf = 0;
                const int pf_rows = 0;
                switch (MB * 8 + 1) { TILE_CASE(tile_bf16, 1, 1) TILE_CASE(tile_bf16, 2, 1) TILE_CASE(tile_bf16, 3, 1) TILE_CASE(tile_bf16, 4, 1) }
            }
    }
    free(packed);
    return 0;
}
#else
int pagoda_amx_init(void) { return -1; }
int pagoda_linear_bf16_amx(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int M,
                           int N, int K, int num_threads) {
    return -1;
}
#endif

#if defined(__AVX512F__)
int pagoda_has_f32_linear(void) { return 1; }

/* acc's row sums (+ bias) into y: the epilogue of both fp32 tiles. */
INLINE void store_tile_f32(__m512 acc[TILE][TILE], const float *bias, float *y, int ldy, const int MB, const int NB,
                           int64_t apart) {
    if (NB == TILE) { /* a row's four outputs summed and biased as one vector */
        const __m128 b4 = !bias ? _mm_setzero_ps()
                          : apart == 1 ? _mm_loadu_ps(bias)
                                       : _mm_setr_ps(bias[0], bias[apart], bias[2 * apart], bias[3 * apart]);
        for (int m = 0; m < MB; m++) {
            const __m128 sums = sum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]);
            float *row = y + (int64_t)m * ldy;
            if (apart == 1) {
                _mm_storeu_ps(row, bias ? _mm_add_ps(sums, b4) : sums);
            } else {
                float out[TILE];
                _mm_storeu_ps(out, bias ? _mm_add_ps(sums, b4) : sums);
                for (int n = 0; n < TILE; n++) row[n * apart] = out[n];
            }
        }
        return;
    }
    float sums[TILE][TILE];
    TILE_SUMS(acc, sums, MB, NB)
    for (int m = 0; m < MB; m++)
        for (int n = 0; n < NB; n++)
            y[(int64_t)m * ldy + n * apart] = bias ? sums[m][n] + bias[n * apart] : sums[m][n];
}

static inline __attribute__((always_inline)) void tile_f32(const float *x, const float *w, const float *bias,
                                                           float *y, int K, int ldy, const int MB, const int NB,
                                                           const float *next, int next_rows, int64_t apart) {
    TILE_ACCUMULATORS(acc, MB, NB)
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        PREFETCH_NEXT(next, next_rows, K, k)
        __m512 wv[TILE];
        for (int n = 0; n < NB; n++) wv[n] = load_kept(w + n * apart * K + k);
        for (int m = 0; m < MB; m++) {
            const __m512 xv = load_kept(x + (int64_t)m * K + k);
            for (int n = 0; n < NB; n++) acc[m][n] = _mm512_fmadd_ps(xv, wv[n], acc[m][n]);
        }
    }
    if (k < K) {
        const __mmask16 mask = (__mmask16)((1u << (K - k)) - 1);
        __m512 wv[TILE];
        for (int n = 0; n < NB; n++) wv[n] = _mm512_maskz_loadu_ps(mask, w + n * apart * K + k);
        for (int m = 0; m < MB; m++) {
            const __m512 xv = _mm512_maskz_loadu_ps(mask, x + (int64_t)m * K + k);
            for (int n = 0; n < NB; n++) acc[m][n] = _mm512_fmadd_ps(xv, wv[n], acc[m][n]);
        }
    }
    store_tile_f32(acc, bias, y, ldy, MB, NB, apart);
}

DEFINE_LINEAR(dot_linear_f32, float, float, tile_f32)

/* fp32 rows against bf16 weights widened in registers (exact: a bf16 is the top half of an fp32), for
 * checkpoints whose weights are bf16 values served in fp32: the arithmetic and the order of the sums
 * are tile_f32's on the widened weights, bit for bit, from half the bytes. 32 inputs a step: one
 * 64-byte load per weight row, so the tile prefetch asks for each line once. */
static inline __attribute__((always_inline)) void tile_f32_bf16w(const float *x, const uint16_t *w,
                                                                 const float *bias, float *y, int K, int ldy,
                                                                 const int MB, const int NB,
                                                                 const uint16_t *next, int next_rows, int64_t apart) {
    TILE_ACCUMULATORS(acc, MB, NB)
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        PREFETCH_NEXT(next, next_rows, K, k)
        __m512 lo[TILE], hi[TILE];
        for (int n = 0; n < NB; n++) {
            const __m512i raw = _mm512_loadu_si512(w + n * apart * K + k);
            lo[n] = widen_bf16(_mm512_castsi512_si256(raw)), hi[n] = widen_bf16(_mm512_extracti64x4_epi64(raw, 1));
        }
        for (int m = 0; m < MB; m++) {
            const __m512 x_lo = load_kept(x + (int64_t)m * K + k), x_hi = load_kept(x + (int64_t)m * K + k + 16);
            for (int n = 0; n < NB; n++) acc[m][n] = _mm512_fmadd_ps(x_hi, hi[n], _mm512_fmadd_ps(x_lo, lo[n], acc[m][n]));
        }
    }
    for (; k < K; k += 16) {
        const __mmask16 mask = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1);
        __m512 wv[TILE];
        for (int n = 0; n < NB; n++) wv[n] = load16(w, n * apart * K + k, mask, DTYPE_BF16);
        for (int m = 0; m < MB; m++) {
            const __m512 xv = _mm512_maskz_loadu_ps(mask, x + (int64_t)m * K + k);
            for (int n = 0; n < NB; n++) acc[m][n] = _mm512_fmadd_ps(xv, wv[n], acc[m][n]);
        }
    }
    store_tile_f32(acc, bias, y, ldy, MB, NB, apart);
}

DEFINE_LINEAR(dot_linear_f32_bf16w, float, uint16_t, tile_f32_bf16w)

/* ---- Many fp32 rows: weight panels packed, an outer-product register tile ----------------------
 * The dot-product tiles above reduce each output across its 16 lanes at the end and, past a few dozen
 * rows, reload the rows from L2 for every 4 outputs: ~60-75 % of the FMA peak. Here each thread packs
 * 32 outputs' weights at a time into a panel [K][32] (16 x 16 blocks transposed in registers, bf16
 * widened exactly), and 12 rows at a time broadcast their inputs against it: 24 accumulators, 2
 * panel loads and 12 broadcasts per 24 FMAs, no reductions; the panel stays in L2 while every row
 * block passes. Each output is the fp32 sum over k in order. From 256 rows, where it is ahead (Zen 5,
 * SmolLM2's projections: 321-378 GFLOP/s at 256-2,048 rows against the dot-product tiles' 263-327,
 * behind them at 48-128 rows, 175-294 against 290-359, packing a panel per 32 outputs included). */
#define PANEL 32
#define PANEL_ROWS 12
#define PACKED_MIN_ROWS 256

INLINE void pack_panel(const void *w, const int wdtype, int64_t n0, int NB, int K, float *panel) {
    for (int j0 = 0; j0 < PANEL; j0 += 16)
        for (int k = 0; k < K; k += 16) {
            const __mmask16 mask = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1);
            __m512 r[16];
            for (int i = 0; i < 16; i++)
                r[i] = j0 + i < NB ? load16(w, (n0 + j0 + i) * K + k, mask, wdtype) : _mm512_setzero_ps();
            transpose16(r); /* r[kk]: input k + kk of the 16 outputs */
            for (int kk = 0; kk < 16 && k + kk < K; kk++) _mm512_store_ps(panel + (int64_t)(k + kk) * PANEL + j0, r[kk]);
        }
}

INLINE void panel_tile(const float *x, int K, const float *panel, const float *bias, float *y, int ldy, int NB,
                       const int MB) {
    __m512 acc[PANEL_ROWS][2];
    for (int m = 0; m < MB; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int k = 0; k < K; k++) {
        const __m512 lo = _mm512_load_ps(panel + (int64_t)k * PANEL), hi = _mm512_load_ps(panel + (int64_t)k * PANEL + 16);
        for (int m = 0; m < MB; m++) {
            const __m512 a = _mm512_set1_ps(x[(int64_t)m * K + k]);
            acc[m][0] = _mm512_fmadd_ps(a, lo, acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(a, hi, acc[m][1]);
        }
    }
    const __mmask16 lo_mask = NB >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << NB) - 1);
    const __mmask16 hi_mask = NB >= 32 ? (__mmask16)0xffff : NB > 16 ? (__mmask16)((1u << (NB - 16)) - 1) : 0;
    const __m512 b_lo = bias ? _mm512_maskz_loadu_ps(lo_mask, bias) : _mm512_setzero_ps();
    const __m512 b_hi = bias ? _mm512_maskz_loadu_ps(hi_mask, bias + 16) : _mm512_setzero_ps();
    for (int m = 0; m < MB; m++) {
        _mm512_mask_storeu_ps(y + (int64_t)m * ldy, lo_mask, bias ? _mm512_add_ps(acc[m][0], b_lo) : acc[m][0]);
        _mm512_mask_storeu_ps(y + (int64_t)m * ldy + 16, hi_mask, bias ? _mm512_add_ps(acc[m][1], b_hi) : acc[m][1]);
    }
}

#elif defined(PAGODA_AVX2)
int pagoda_has_f32_linear(void) { return 1; }

/* Rows x weights in 8 fp32 lanes: fp32 rows on fp32 or bf16 weights, bf16 rows on bf16 weights (both
 * widened, exactly: the products and fp32 sums AVX512-BF16's dot products take, the output rounded
 * once). AVX2 has 16 vector registers: a pass takes up to 2 rows x 4 outputs (8 accumulators, 4
 * weight vectors, a row's), a 3-4 row tile two passes (the second finds the weights in L1), and
 * passes of up to 4 products keep two sets of accumulators, one for each half of 16 inputs, so two
 * FMA chains run (a one-row step otherwise waits on one FMA's latency per 8 inputs). fp32 rows take
 * the halves in order, so that bf16 weights under them give the bits of the fp32 weights they widen
 * to; bf16 rows take widen8_of16_bf16's halves (Zen 1: 0.6-0.8x the time at 1-8 rows). The tile's
 * prefetch is PREFETCH_NEXT's, by bytes: a line of each next row per 64 bytes of weight row. A pass's
 * outputs are `apart` apart (their weight rows and their places in y and bias): 1 for a tile,
 * further for a one-row tile's runs. */
INLINE void pass_rows(const void *x, const int dtype, const void *w, const int wdtype, const void *bias, void *y, int K,
                      int ldy, const int MB, const int NB, const char *next, int next_rows, int64_t apart) {
    enum { SETS = 2 };
    const int sets = MB * NB <= 4 ? 2 : 1, wsize = wdtype == DTYPE_BF16 ? 2 : 4;
    __m256 acc[SETS][2][TILE];
    for (int s = 0; s < sets; s++)
        for (int m = 0; m < MB; m++)
            for (int n = 0; n < NB; n++) acc[s][m][n] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        const int64_t line = (int64_t)k * wsize / 64;
        if (next && (int64_t)k * wsize % 64 == 0)
            for (int r = 0; r < next_rows; r++) _mm_prefetch(next + (line * next_rows + r) * 64, _MM_HINT_T2);
        for (int h = 0; h < 2; h++) {
            const int s = sets == 2 ? h : 0;
            __m256 wv[TILE];
            for (int n = 0; n < NB; n++)
                wv[n] = dtype == DTYPE_BF16 ? widen8_of16_bf16((const uint16_t *)w + n * apart * K + k, h)
                                            : load8(w, n * apart * K + k + 8 * h, 8, wdtype);
            for (int m = 0; m < MB; m++) {
                const __m256 xv = dtype == DTYPE_BF16 ? widen8_of16_bf16((const uint16_t *)x + (int64_t)m * K + k, h)
                                                      : load8(x, (int64_t)m * K + k + 8 * h, 8, dtype);
                for (int n = 0; n < NB; n++) acc[s][m][n] = _mm256_fmadd_ps(xv, wv[n], acc[s][m][n]);
            }
        }
    }
    for (; k < K; k += 8) {
        __m256 wv[TILE];
        for (int n = 0; n < NB; n++) wv[n] = load8(w, n * apart * K + k, K - k, wdtype);
        for (int m = 0; m < MB; m++) {
            const __m256 xv = load8(x, (int64_t)m * K + k, K - k, dtype);
            for (int n = 0; n < NB; n++) acc[0][m][n] = _mm256_fmadd_ps(xv, wv[n], acc[0][m][n]);
        }
    }
    for (int m = 0; m < MB; m++) {
        if (sets == 2)
            for (int n = 0; n < NB; n++) acc[0][m][n] = _mm256_add_ps(acc[0][m][n], acc[1][m][n]);
        float sums[TILE];
        if (NB == TILE) /* a row's four outputs summed as one vector */
            _mm_storeu_ps(sums, sum4_avx2(acc[0][m][0], acc[0][m][1], acc[0][m][2], acc[0][m][3]));
        else
            for (int n = 0; n < NB; n++) sums[n] = hsum8(acc[0][m][n]);
        for (int n = 0; n < NB; n++) store_output(y, (int64_t)m * ldy + n * apart, sums[n], bias, n * apart, dtype);
    }
}

/* A tile of up to 4 rows: passes of 2 (the registers' limit), the prefetch in the first. */
#define PASS_ROWS(T, dtype, wdtype)                                                                          \
    do {                                                                                                    \
        pass_rows(x, dtype, w, wdtype, bias, y, K, ldy, MB < 2 ? MB : 2, NB, (const char *)next, next_rows, apart); \
        if (MB > 2)                                                                                         \
            pass_rows((const T *)x + 2 * (int64_t)K, dtype, w, wdtype, bias, (T *)y + 2 * (int64_t)ldy, K, ldy, \
                      MB - 2, NB, 0, 0, apart);                                                             \
    } while (0)

INLINE void tile_f32(const float *x, const float *w, const float *bias, float *y, int K, int ldy, const int MB,
                     const int NB, const float *next, int next_rows, int64_t apart) {
    PASS_ROWS(float, DTYPE_F32, DTYPE_F32);
}

INLINE void tile_f32_bf16w(const float *x, const uint16_t *w, const float *bias, float *y, int K, int ldy,
                           const int MB, const int NB, const uint16_t *next, int next_rows, int64_t apart) {
    PASS_ROWS(float, DTYPE_F32, DTYPE_BF16);
}

INLINE void tile_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int K, int ldy,
                      const int MB, const int NB, const uint16_t *next, int next_rows, int64_t apart) {
    PASS_ROWS(uint16_t, DTYPE_BF16, DTYPE_BF16);
}
#undef PASS_ROWS

int pagoda_has_bf16_linear(void) { return 1; }
DEFINE_LINEAR(dot_linear_bf16, uint16_t, uint16_t, tile_bf16)
DEFINE_LINEAR(dot_linear_f32, float, float, tile_f32)
DEFINE_LINEAR(dot_linear_f32_bf16w, float, uint16_t, tile_f32_bf16w)

/* Many fp32 rows in 8 lanes: the AVX-512 tier's packed panels (see there), 16 outputs wide. Each thread
 * packs 16 outputs' weights into a [K][16] panel (8 x 8 blocks transposed in registers, bf16 widened
 * exactly) and 6 rows at a time broadcast their inputs against it: 12 accumulators, 2 panel loads and 6
 * broadcasts per 12 FMAs, no reductions (16 registers). Each output is the fp32 sum over k in order.
 * From PACKED_MIN_ROWS, where the dot-product passes reload each row block for every 4 outputs
 * (Zen 3, SmolLM2's projections and head: equal at 32 rows, 100-113 vs 146-159 ms at 64, 176-183 vs
 * 232-272 at 128; see docs/benchmarks.md for torch's GEMM past that). */
#define PANEL 16
#define PANEL_ROWS 6
#define PACKED_MIN_ROWS 48

INLINE void transpose8(__m256 r[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20), r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20), r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31), r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31), r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

INLINE void pack_panel(const void *w, const int wdtype, int64_t n0, int NB, int K, float *panel) {
    for (int j0 = 0; j0 < PANEL; j0 += 8)
        for (int k = 0; k < K; k += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++)
                r[i] = j0 + i < NB ? load8(w, (n0 + j0 + i) * K + k, K - k, wdtype) : _mm256_setzero_ps();
            transpose8(r); /* r[kk]: input k + kk of the 8 outputs */
            for (int kk = 0; kk < 8 && k + kk < K; kk++) _mm256_store_ps(panel + (int64_t)(k + kk) * PANEL + j0, r[kk]);
        }
}

INLINE void panel_tile(const float *x, int K, const float *panel, const float *bias, float *y, int ldy, int NB,
                        const int MB) {
    __m256 acc[PANEL_ROWS][2];
    for (int m = 0; m < MB; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int k = 0; k < K; k++) {
        const __m256 lo = _mm256_load_ps(panel + (int64_t)k * PANEL), hi = _mm256_load_ps(panel + (int64_t)k * PANEL + 8);
        for (int m = 0; m < MB; m++) {
            const __m256 a = _mm256_broadcast_ss(x + (int64_t)m * K + k);
            acc[m][0] = _mm256_fmadd_ps(a, lo, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(a, hi, acc[m][1]);
        }
    }
    const int lo_n = NB < 8 ? NB : 8, hi_n = NB > 8 ? NB - 8 : 0;
    const __m256 b_lo = bias ? load8(bias, 0, lo_n, DTYPE_F32) : _mm256_setzero_ps();
    const __m256 b_hi = bias && hi_n ? load8(bias, 8, hi_n, DTYPE_F32) : _mm256_setzero_ps();
    for (int m = 0; m < MB; m++) {
        store8(y, (int64_t)m * ldy, bias ? _mm256_add_ps(acc[m][0], b_lo) : acc[m][0], lo_n, DTYPE_F32);
        if (hi_n) store8(y, (int64_t)m * ldy + 8, bias ? _mm256_add_ps(acc[m][1], b_hi) : acc[m][1], hi_n, DTYPE_F32);
    }
}

/* ---- Rows in 8 lanes, the weights read in place: fp32 steps of 12-47 rows, bf16 steps from 12 ----
 * The step's rows are transposed once per call into blocks of 16 ([K][16] fp32, bf16 rows widened,
 * zero-padded; a last block of up to 8 rows is [K][8]), and each thread takes 6 outputs at a time:
 * for each input k, the block's two 8-row vectors of x^T against each output's weight broadcast from
 * its row (12 accumulators, 2 + 6 loads per 12 FMAs, no reductions, 15 registers). The weights stay
 * in their layout (bf16 ones widened as broadcast), read as 6 sequential streams, the next 6 rows
 * prefetched into L2 while the first block computes; further blocks find them in L1 / L2. Each
 * output is the fp32 sum over k in order (the packed panels' arithmetic: for fp32 rows the two give
 * the same bits), rounded once to the rows' dtype. Where the dot-product passes (2 rows x 4 outputs)
 * reduce 8 sums per output and reload the rows for every 4 outputs, this ran SmolLM2's projections
 * (Zen 3, 2 threads, weights from DRAM) in fp32 at 16 rows 1.2-1.4x as fast (25-34 against 34-42
 * ms), at 20-47 rows 1.0-1.2x, on bf16 weights 1.0-1.3x at 12-40 rows; in bf16 1.2-1.6x at 12-512
 * rows (138-151 against 90-96 GFLOP/s from 16 rows). Below 12 rows, where a block of 16 lanes holds
 * fewer rows and the weight stream bounds the step, it was 0.85-1.0x (docs/benchmarks.md). */
#define LANES_MIN_ROWS 12
#define LANE_BLOCK 16
#define LANE_OUTPUTS 6

/* Whether an M-row step is the lanes kernel's: from LANES_MIN_ROWS, unless its last block would hold
 * one or two rows (another pass over each tile for little arithmetic: 0.9x the dot products at 17-18). */
static inline int lanes_take(int M) {
    const int last = M % LANE_BLOCK;
    return M >= LANES_MIN_ROWS && (last == 0 || last > 2);
}

/* Weight i of w in 8 fp32 lanes, exactly (a bf16 is the top half of an fp32). A bf16 at i >= 1 is
 * broadcast as one 32-bit word with the bf16 before it, whose bits are masked off: one load and one
 * AND, where widening it alone took four instructions (0.7-0.8x the dot products at 12-40 rows). */
INLINE __m256 broadcast_weight(const void *w, int64_t i, const int wdtype, const int first) {
    if (wdtype == DTYPE_F32) return _mm256_broadcast_ss((const float *)w + i);
    if (first) return _mm256_castsi256_ps(_mm256_set1_epi32((int)((const uint16_t *)w)[i] << 16));
    const __m256 top_half = _mm256_castsi256_ps(_mm256_set1_epi32((int)0xFFFF0000u));
    return _mm256_and_ps(_mm256_broadcast_ss((const float *)((const uint16_t *)w + i - 1)), top_half);
}

/* Input k of the tile: the rows' x^T vectors (lo: rows 0-7, hi: 8-15) times each output's weight. */
INLINE void lanes_step(__m256 acc[2][LANE_OUTPUTS], const float *xt, int k, const char *const w[LANE_OUTPUTS],
                       const int wdtype, const int vectors, const int first) {
    const int width = vectors * 8;
    const __m256 lo = _mm256_load_ps(xt + (int64_t)k * width);
    const __m256 hi = vectors == 2 ? _mm256_load_ps(xt + (int64_t)k * width + 8) : lo;
    _Pragma("GCC unroll 8") for (int n = 0; n < LANE_OUTPUTS; n++) {
        const __m256 b = broadcast_weight(w[n], k, wdtype, first);
        acc[0][n] = _mm256_fmadd_ps(lo, b, acc[0][n]);
        if (vectors == 2) acc[1][n] = _mm256_fmadd_ps(hi, b, acc[1][n]);
    }
}

/* Outputs w[0..6) (rows of K weights; repeats of the last past NB) for the `vectors` x 8 rows of xt. */
INLINE void lanes_tile(const float *xt, int K, const char *const w[LANE_OUTPUTS], const int wdtype, const void *bias,
                       void *y, int64_t at, int ldy, int rows, int NB, const char *next, const int vectors, const int dtype) {
    const int wsize = wdtype == DTYPE_BF16 ? 2 : 4;
    __m256 acc[2][LANE_OUTPUTS];
    _Pragma("GCC unroll 8") for (int n = 0; n < LANE_OUTPUTS; n++) acc[0][n] = acc[1][n] = _mm256_setzero_ps();
    lanes_step(acc, xt, 0, w, wdtype, vectors, 1);
    for (int k = 1; k < K; k++) {
        if (next && (int64_t)k * wsize % 64 == 0) /* a line of each next row per line of these */
            _Pragma("GCC unroll 8") for (int n = 0; n < LANE_OUTPUTS; n++)
                _mm_prefetch(next + ((int64_t)n * K + k) * wsize, _MM_HINT_T2);
        lanes_step(acc, xt, k, w, wdtype, vectors, 0);
    }
    _Pragma("GCC unroll 8") for (int n = 0; n < LANE_OUTPUTS; n++) { /* constant bounds: acc stays in registers */
        if (n >= NB) break;
        float sums[LANE_BLOCK];
        _mm256_storeu_ps(sums, acc[0][n]);
        _mm256_storeu_ps(sums + 8, acc[1][n]); /* zeros for one vector */
        for (int m = 0; m < rows; m++) store_output(y, at + (int64_t)m * ldy + n, sums[m], bias, n, dtype);
    }
}

/* y[M, N] = x W^T (+ bias), x, y and bias in `dtype` (rounded once per output), W in `wdtype`. */
static int lanes_linear(const void *x, const int dtype, const void *w, const int wdtype, const void *bias, void *y,
                        int M, int N, int K, int num_threads) {
    const int blocks = (M + LANE_BLOCK - 1) / LANE_BLOCK;
    const int64_t row_bytes = (int64_t)K * (wdtype == DTYPE_BF16 ? 2 : 4);
    float *xt = aligned_alloc(64, (size_t)blocks * LANE_BLOCK * K * sizeof(float));
    if (!xt) return -1;
    for (int b = 0; b < blocks; b++) { /* block b: rows 16b.. as [K][width], at xt + 16bK */
        const int m0 = b * LANE_BLOCK, rows = M - m0 < LANE_BLOCK ? M - m0 : LANE_BLOCK, width = rows > 8 ? 16 : 8;
        float *block = xt + (size_t)m0 * K;
        for (int m = 0; m < width; m++) {
            const int64_t row = (int64_t)(m0 + m) * K;
            for (int k = 0; k < K; k++)
                block[(int64_t)k * width + m] = m >= rows                ? 0.0f
                                                : dtype == DTYPE_BF16 ? bf16_to_f32(((const uint16_t *)x)[row + k])
                                                                      : ((const float *)x)[row + k];
        }
    }
    const int tiles = (N + LANE_OUTPUTS - 1) / LANE_OUTPUTS;
    const size_t esize = dtype == DTYPE_BF16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int t = 0; t < tiles; t++) {
        const int n0 = t * LANE_OUTPUTS, NB = N - n0 < LANE_OUTPUTS ? N - n0 : LANE_OUTPUTS;
        const char *rows_of[LANE_OUTPUTS];
        for (int n = 0; n < LANE_OUTPUTS; n++) rows_of[n] = (const char *)w + (n0 + (n < NB ? n : NB - 1)) * row_bytes;
        const char *next = N - n0 >= 2 * LANE_OUTPUTS ? (const char *)w + (n0 + LANE_OUTPUTS) * row_bytes : 0;
        const void *bn = bias ? (const char *)bias + n0 * esize : 0;
        for (int b = 0; b < blocks; b++) {
            const int m0 = b * LANE_BLOCK, rows = M - m0 < LANE_BLOCK ? M - m0 : LANE_BLOCK;
            const float *block = xt + (size_t)m0 * K;
            const char *pf = b == 0 ? next : 0;
            const int64_t at = (int64_t)m0 * N + n0;
#define LANES_CASE(d, wd)                                                                          \
    if (rows > 8) lanes_tile(block, K, rows_of, wd, bn, y, at, N, rows, NB, pf, 2, d);            \
    else lanes_tile(block, K, rows_of, wd, bn, y, at, N, rows, NB, pf, 1, d);
            if (dtype == DTYPE_BF16) { LANES_CASE(DTYPE_BF16, DTYPE_BF16) }
            else if (wdtype == DTYPE_BF16) { LANES_CASE(DTYPE_F32, DTYPE_BF16) }
            else { LANES_CASE(DTYPE_F32, DTYPE_F32) }
#undef LANES_CASE
        }
    }
    free(xt);
    return 0;
}

/* bf16 rows on bf16 weights: the rows widened once into x^T, each output rounded once. */
int pagoda_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int M, int N, int K,
                       int num_threads) {
    if (lanes_take(M)) return lanes_linear(x, DTYPE_BF16, w, DTYPE_BF16, bias, y, M, N, K, num_threads);
    return dot_linear_bf16(x, w, bias, y, M, N, K, num_threads);
}

#else
int pagoda_has_f32_linear(void) { return 0; }
int pagoda_linear_f32(const float *x, const float *w, const float *bias, float *y, int M, int N, int K,
                      int num_threads) {
    return -1;
}
int pagoda_linear_f32_bf16w(const float *x, const uint16_t *w, const float *bias, float *y, int M, int N, int K,
                            int num_threads) {
    return -1;
}
#endif

#if defined(__AVX512F__) || defined(PAGODA_AVX2)
/* Many fp32 rows, either tier: each thread packs PANEL outputs' weights at a time (`pack_panel`) and
 * PANEL_ROWS rows at a time broadcast their inputs against it (`panel_tile`), from PACKED_MIN_ROWS. */
static int packed_linear_f32(const float *x, const void *w, const int wdtype, const float *bias, float *y, int M,
                             int N, int K, int num_threads) {
    const int panels = (N + PANEL - 1) / PANEL;
    const size_t panel_floats = (size_t)K * PANEL;
    float *scratch = aligned_alloc(64, (size_t)num_threads * panel_floats * sizeof(float));
    if (!scratch) return -1;
#pragma omp parallel num_threads(num_threads)
    {
        float *panel = scratch + (size_t)omp_get_thread_num() * panel_floats;
#pragma omp for schedule(guided)
        for (int p = 0; p < panels; p++) {
            const int n0 = p * PANEL, NB = N - n0 < PANEL ? N - n0 : PANEL;
            pack_panel(w, wdtype, n0, NB, K, panel);
            const float *bp = bias ? bias + n0 : 0;
            for (int m0 = 0; m0 < M; m0 += PANEL_ROWS) {
                const float *xm = x + (int64_t)m0 * K;
                float *ym = y + (int64_t)m0 * N + n0;
#define PANEL_CASE(mb) case mb: panel_tile(xm, K, panel, bp, ym, N, NB, mb); break;
                switch (M - m0 < PANEL_ROWS ? M - m0 : PANEL_ROWS) { /* constant row counts: registers */
                    PANEL_CASE(1) PANEL_CASE(2) PANEL_CASE(3) PANEL_CASE(4) PANEL_CASE(5) PANEL_CASE(6)
#if PANEL_ROWS > 6
                    PANEL_CASE(7) PANEL_CASE(8) PANEL_CASE(9) PANEL_CASE(10) PANEL_CASE(11) PANEL_CASE(12)
#endif
                }
#undef PANEL_CASE
            }
        }
    }
    free(scratch);
    return 0;
}

int pagoda_linear_f32(const float *x, const float *w, const float *bias, float *y, int M, int N, int K,
                      int num_threads) {
    if (M >= PACKED_MIN_ROWS) return packed_linear_f32(x, w, DTYPE_F32, bias, y, M, N, K, num_threads);
#if defined(PAGODA_AVX2)
    if (lanes_take(M)) return lanes_linear(x, DTYPE_F32, w, DTYPE_F32, bias, y, M, N, K, num_threads);
#endif
    return dot_linear_f32(x, w, bias, y, M, N, K, num_threads);
}

int pagoda_linear_f32_bf16w(const float *x, const uint16_t *w, const float *bias, float *y, int M, int N, int K,
                            int num_threads) {
    if (M >= PACKED_MIN_ROWS) return packed_linear_f32(x, w, DTYPE_BF16, bias, y, M, N, K, num_threads);
#if defined(PAGODA_AVX2)
    if (lanes_take(M)) return lanes_linear(x, DTYPE_F32, w, DTYPE_BF16, bias, y, M, N, K, num_threads);
#endif
    return dot_linear_f32_bf16w(x, w, bias, y, M, N, K, num_threads);
}
#endif

/* ---- The decoder layers of a decode step in one call ------------------------------------------
 * What the model's layers do op by op (norm, q/k/v, rotary, KV store, attention, o, norm, gate/up,
 * SiLU x up, down), each by the kernel above it would run on, in the same order and with the same
 * roundings: the result is the op-by-op one, bit for bit, without a Python dispatch per op (about
 * a fifth of a one-row step). Llama-family layers without q/k norms; the projections' kernels are
 * chosen by the caller (`linear_kernel` in cpu_native.py), one per projection. */
struct projection {
    const void *weight, *bias;
    const uint8_t *nibbles; /* the 4-bit copy (LINEAR_INT4), if any */
    const float *scales, *mins;
    int64_t group;
    int64_t weight_dtype; /* DTYPE_BF16 under fp32 rows: bf16 weights widened (pagoda_linear_f32_bf16w) */
};

struct decoder_layer {
    const void *input_norm, *post_norm;
    struct projection qkv, o, gate_up, down;
    void *k_cache, *v_cache;
    int64_t sliding_window; /* 0: full attention */
};

struct decoder_shape {
    int hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size, num_blocks, dtype;
    int qkv_kernel, o_kernel, gate_up_kernel, down_kernel; /* LINEAR_* */
    float eps, scale;
};

enum { LINEAR_DOT = 0, LINEAR_AMX = 1, LINEAR_INT4 = 2 };

int pagoda_linear_int4(const void *x, const uint8_t *q, const float *scales, const float *mins, const void *bias,
                       void *y, int M, int N, int K, int group, int dtype, int num_threads);

/* The fp32 lanes of the vector kernels built here: 16 (AVX-512), 8 (AVX2), 0 (none: SiLU x up, the
 * low-bit kernels and the fused decode layers are not built). */
int pagoda_vector_lanes(void) {
#if defined(__AVX512F__)
    return 16;
#elif defined(PAGODA_AVX2)
    return 8;
#else
    return 0;
#endif
}

static int run_linear(int kernel, int dtype, const void *x, const struct projection *p, void *y, int M, int N, int K,
                      int num_threads) {
    if (kernel == LINEAR_INT4)
        return pagoda_linear_int4(x, p->nibbles, p->scales, p->mins, p->bias, y, M, N, K, (int)p->group, dtype, num_threads);
    if (kernel == LINEAR_AMX) return pagoda_linear_bf16_amx(x, p->weight, p->bias, y, M, N, K, num_threads);
    if (dtype == DTYPE_BF16) return pagoda_linear_bf16(x, p->weight, p->bias, y, M, N, K, num_threads);
    return p->weight_dtype == DTYPE_BF16 ? pagoda_linear_f32_bf16w(x, p->weight, p->bias, y, M, N, K, num_threads)
                                         : pagoda_linear_f32(x, p->weight, p->bias, y, M, N, K, num_threads);
}

/* A step's prefill tokens, attended a tile at a time (`pagoda_prefill_attention`'s arguments): sequence s's
 * new tokens are rows starts[s]..starts[s + 1] of the step. */
struct prefill_part {
    const int32_t *starts, *context_lens, *block_tables;
    int64_t block_table_stride;
    int64_t num_seqs;
};

/* hidden [rows, hidden]: the embeddings in, the model's final norm of the last layer's output out
 * (final_norm: that norm's weight, with the layers' eps). cos/sin: the rotary tables [table_rows,
 * head_dim] in the model dtype, row r rotating at positions[r] (a position past them: -4, the caller
 * grows them); slots as the attention's. The first prefill->starts[num_seqs] rows are the prefill's
 * (prefill NULL: none), attended by the tiled kernel; each row after them is a decode query with its
 * own row of block tables and context lengths. Shapes, positions, tables and slots are checked before
 * anything is written. */
int pagoda_decode_layers(const struct decoder_layer *layers, int num_layers, const struct decoder_shape *s,
                         void *hidden, const void *final_norm, const void *cos, const void *sin,
                         const int64_t *positions, int64_t table_rows, const int64_t *slots,
                         const struct prefill_part *prefill, const int32_t *block_tables, int64_t block_table_stride,
                         const int32_t *context_lens, int rows, int num_threads) {
    const int dtype = s->dtype, hd = s->head_dim;
    const int q_size = s->num_heads * hd, kv_size = s->num_kv_heads * hd, qkv_size = q_size + 2 * kv_size;
    const size_t elem = dtype == DTYPE_BF16 ? 2 : 4;
    const int64_t num_slots = (int64_t)s->num_blocks * s->block_size;
    if (hd > MAX_HEAD_DIM || hd % 2 || s->hidden > MAX_HIDDEN) return -1;
    for (int r = 0; r < rows; r++) {
        if (slots[r] >= num_slots) return -3;
        if (positions[r] < 0 || positions[r] >= table_rows) return -4;
    }
    const int prefill_seqs = prefill ? (int)prefill->num_seqs : 0;
    const int prefill_rows = prefill_seqs ? prefill->starts[prefill_seqs] : 0;
    if (prefill_seqs) {
        if (prefill->starts[0] != 0 || prefill_rows > rows) return -1;
        const int refused = prefill_refuses(prefill->block_tables, prefill->block_table_stride, prefill->starts,
                                            prefill->context_lens, prefill_seqs, s->num_heads, s->num_kv_heads, hd,
                                            s->block_size, s->num_blocks);
        if (refused) return refused;
    }
    const int decode_rows = rows - prefill_rows;
    if (!blocks_exist(block_tables, block_table_stride, context_lens, decode_rows, s->block_size, s->num_blocks))
        return -2;
    const size_t wide = (size_t)(qkv_size > 2 * s->intermediate ? qkv_size : 2 * s->intermediate);
    const size_t narrow = (size_t)(q_size > s->intermediate ? q_size : s->intermediate);
    char *scratch = malloc((size_t)rows * ((2 * s->hidden + wide + narrow) * elem + 2 * hd * sizeof(float)));
    if (!scratch) return -1;
    void *residual = scratch, *normed = scratch + (size_t)rows * s->hidden * elem;
    void *qkv_or_gate_up = (char *)normed + (size_t)rows * s->hidden * elem;
    void *attended_or_act = (char *)qkv_or_gate_up + (size_t)rows * wide * elem;
    float *cos32 = (float *)((char *)attended_or_act + (size_t)rows * narrow * elem), *sin32 = cos32 + (size_t)rows * hd;
    for (int r = 0; r < rows; r++) {
        load_f32(cos, positions[r] * hd, dtype, cos32 + (int64_t)r * hd, hd);
        load_f32(sin, positions[r] * hd, dtype, sin32 + (int64_t)r * hd, hd);
    }
    int status = 0;
    for (int l = 0; l < num_layers && status == 0; l++) {
        const struct decoder_layer *L = layers + l;
        if (l == 0) { /* the residual stream starts as the embeddings */
            memcpy(residual, hidden, (size_t)rows * s->hidden * elem);
            pagoda_rms_norm(hidden, 0, 0, L->input_norm, normed, rows, s->hidden, s->eps, dtype, num_threads);
        } else {
            pagoda_rms_norm(hidden, residual, residual, L->input_norm, normed, rows, s->hidden, s->eps, dtype, num_threads);
        }
        status |= run_linear(s->qkv_kernel, dtype, normed, &L->qkv, qkv_or_gate_up, rows, qkv_size, s->hidden, num_threads);
        const int rotated = s->num_heads + s->num_kv_heads; /* q and k heads rotate together: side by side */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (split_rows(rows, (int64_t)rotated * hd))
        for (int r = 0; r < rows; r++)
            rotate(qkv_or_gate_up, (int64_t)r * qkv_size, rotated, hd, cos32 + (int64_t)r * hd, sin32 + (int64_t)r * hd,
                   dtype);
        const char *k = (const char *)qkv_or_gate_up + (size_t)q_size * elem, *v = k + (size_t)kv_size * elem;
        pagoda_store_kv(k, qkv_size, v, qkv_size, L->k_cache, L->v_cache, slots, rows, kv_size, num_slots, dtype);
        int attended = 0;
        const int window = (int)L->sliding_window;
        if (prefill_rows)
            attended = pagoda_prefill_attention(
                qkv_or_gate_up, qkv_size, hd, L->k_cache, L->v_cache, prefill->block_tables,
                prefill->block_table_stride, prefill->starts, prefill->context_lens, attended_or_act, prefill_seqs,
                s->num_heads, s->num_kv_heads, hd, s->block_size, s->num_blocks, s->scale, window, dtype, num_threads);
        if (!attended && decode_rows)
            attended = pagoda_paged_decode_attention(
                (const char *)qkv_or_gate_up + (size_t)prefill_rows * qkv_size * elem, qkv_size, hd, L->k_cache,
                L->v_cache, block_tables, block_table_stride, context_lens,
                (char *)attended_or_act + (size_t)prefill_rows * q_size * elem, decode_rows, s->num_heads,
                s->num_kv_heads, hd, s->block_size, s->num_blocks, s->scale, window, dtype, num_threads);
        if (attended) {
            status = attended;
            break;
        }
        status |= run_linear(s->o_kernel, dtype, attended_or_act, &L->o, hidden, rows, s->hidden, q_size, num_threads);
        pagoda_rms_norm(hidden, residual, residual, L->post_norm, normed, rows, s->hidden, s->eps, dtype, num_threads);
        status |= run_linear(s->gate_up_kernel, dtype, normed, &L->gate_up, qkv_or_gate_up, rows,
                             2 * s->intermediate, s->hidden, num_threads);
        status |= pagoda_silu_mul(qkv_or_gate_up, attended_or_act, rows, s->intermediate, dtype, num_threads);
        status |= run_linear(s->down_kernel, dtype, attended_or_act, &L->down, hidden, rows, s->hidden,
                             s->intermediate, num_threads);
    }
    if (status == 0) /* in place: a row is read whole before its norm is written */
        pagoda_rms_norm(hidden, residual, residual, final_norm, hidden, rows, s->hidden, s->eps, dtype, num_threads);
    free(scratch);
    return status;
}

/* ---- y[M, N] = x W^T (+ bias) with W in 4-bit groups, for steps of a few rows ------------------
 * W row n, group g of `group` inputs: w = q * scale + min, q in 0..15 (GGUF Q4_0/Q4_1 blocks are of
 * this form). Nibbles: each 32 inputs are 16 bytes, byte j holding input j (low nibble) and j + 16
 * (high), as GGUF stores them; scales and mins [N][K / group] fp32. y[n] = sum_g scale_g (q_g . x_g)
 * + sum_g min_g sum(x_g): the sums of x per group are taken once per row, the second sum is a short
 * dot product per output. The weights are read once per step at a quarter of bf16's bytes; the
 * arithmetic is fp32 (one bf16 row: bf16 products, summed in fp32, `int4_row_bf16`), on AVX2 integer
 * products with the rows quantized to int16 (`quantize_rows_int16`). */
#if defined(__AVX512F__) || defined(PAGODA_AVX2)
#define INT4_MAX_GROUPS 1024
#endif

#if defined(__AVX512F__)
/* The rows in fp32, then each row's sums of its groups of inputs (freed by the caller; NULL: no memory). */
static float *int4_inputs(const void *x, int M, int K, int group, int dtype) {
    const int groups = K / group;
    float *x32 = malloc((size_t)M * (K + groups) * sizeof(float));
    if (!x32) return 0;
    float *xsum = x32 + (size_t)M * K;
    for (int m = 0; m < M; m++) {
        load_f32(x, (int64_t)m * K, dtype, x32 + (int64_t)m * K, K);
        for (int g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int i = 0; i < group; i++) s += x32[(int64_t)m * K + g * group + i];
            xsum[m * groups + g] = s;
        }
    }
    return x32;
}


INLINE void int4_tile(const float *x, const uint8_t *q, const float *scales, const float *mins, const float *xsum,
                      const void *bias, void *y, int K, int group, int ldy, int n0, const int MB, const int NB,
                      const int dtype) {
    TILE_ACCUMULATORS(acc, MB, NB)
    const int groups = K / group, chunks = group / 32;
    const __m512i low = _mm512_set1_epi32(0x0f);
    for (int g = 0; g < groups; g++)
        for (int n = 0; n < NB; n++) {
            __m512 part[TILE];
            for (int m = 0; m < MB; m++) part[m] = _mm512_setzero_ps();
            for (int c = 0; c < chunks; c++) {
                const int k = g * group + 32 * c;
                const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + ((int64_t)n * K + k) / 2)));
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, low));
                const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
                for (int m = 0; m < MB; m++)
                    part[m] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + (int64_t)m * K + k),
                                              _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + (int64_t)m * K + k + 16), part[m]));
            }
            const __m512 scale = _mm512_set1_ps(scales[(int64_t)n * groups + g]);
            for (int m = 0; m < MB; m++) acc[m][n] = _mm512_fmadd_ps(part[m], scale, acc[m][n]);
        }
    for (int m = 0; m < MB; m++)
        for (int n = 0; n < NB; n++) { /* the mins' part: sum_g min_g sum(x_g), 16 groups a step */
            __m512 shift = _mm512_setzero_ps();
            for (int g = 0; g < groups; g += 16) {
                const __mmask16 mask = groups - g >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (groups - g)) - 1);
                shift = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, mins + (int64_t)n * groups + g),
                                        _mm512_maskz_loadu_ps(mask, xsum + m * groups + g), shift);
            }
            acc[m][n] = _mm512_add_ps(acc[m][n], shift);
        }
    float sums[TILE][TILE];
    TILE_SUMS(acc, sums, MB, NB)
    for (int m = 0; m < MB; m++)
        for (int n = 0; n < NB; n++) store_output(y, (int64_t)m * ldy + n0 + n, sums[m][n], bias, n0 + n, dtype);
}

#if defined(__AVX512BF16__)
/* One output of one bf16 row, the weights read start to end: each 32 nibbles become bf16 0..15 (a
 * 16-entry table lookup, exact) for one dot-product instruction with x, where widening them to fp32
 * for fused multiply-adds took twice as long at one row (SmolLM2's gate/up projections, Zen 4: 4.3 ->
 * 2.1 ms over 30 layers). 64 inputs a step: 32 bytes widen in one instruction. */
static const uint16_t BF16_OF_NIBBLE[32] = {0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
                                            0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

/* Adds 32 inputs' products to the group's partial sum; a group's last chunk scales it into acc. */
#define INT4_CHUNK_BF16(weights, xk)                                                            \
    do {                                                                                        \
        part = _mm512_dpbf16_ps(part, (__m512bh)(weights), (__m512bh)_mm512_loadu_si512(xk));  \
        if (--chunks_left == 0) {                                                               \
            acc = _mm512_fmadd_ps(part, _mm512_set1_ps(scales[g++]), acc);                      \
            part = _mm512_setzero_ps();                                                         \
            chunks_left = group / 32;                                                           \
        }                                                                                       \
    } while (0)

INLINE float int4_row_bf16(const uint16_t *x, const uint8_t *q, const float *scales, const float *mins,
                           const float *xsum, int K, int group) {
    const __m512i table = _mm512_loadu_si512(BF16_OF_NIBBLE), low = _mm512_set1_epi16(0x0f);
    const int groups = K / group;
    __m512 acc = _mm512_setzero_ps(), part = _mm512_setzero_ps();
    int k = 0, g = 0, chunks_left = group / 32;
    for (; k + 64 <= K; k += 64) {
        const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(q + k / 2)));
        const __m512i lo = _mm512_and_si512(bytes, low), hi = _mm512_srli_epi16(bytes, 4);
        /* inputs k..k+31 are the first 16 bytes' low then high nibbles; k+32..k+63 the next 16's */
        INT4_CHUNK_BF16(_mm512_permutexvar_epi16(_mm512_shuffle_i64x2(lo, hi, 0x44), table), x + k);
        INT4_CHUNK_BF16(_mm512_permutexvar_epi16(_mm512_shuffle_i64x2(lo, hi, 0xee), table), x + k + 32);
    }
    if (k < K) { /* the last 32 inputs */
        const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(q + k / 2)));
        const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, _mm256_set1_epi16(0x0f))),
                                             _mm256_srli_epi16(bytes, 4), 1);
        INT4_CHUNK_BF16(_mm512_permutexvar_epi16(v, table), x + k);
    }
    __m512 shift = _mm512_setzero_ps(); /* sum_g min_g sum(x_g) */
    for (int i = 0; i < groups; i += 16) {
        const __mmask16 mask = groups - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (groups - i)) - 1);
        shift = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, mins + i), _mm512_maskz_loadu_ps(mask, xsum + i), shift);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc, shift));
}
#undef INT4_CHUNK_BF16

/* int4_row_bf16 for GGUF's groups of 32, without the table: OR-ing a nibble q into 0x4300 gives the
 * bf16 of 128 + q exactly (7 mantissa bits), and the 128 * sum(x_g) it adds comes off with the mins'
 * part. Each 64 nibbles are used in the order the bytes hold them (inputs 0-15 and 32-47, then 16-31
 * and 48-63), so x comes permuted to match (`permute_for_nibbles`): a dot product's lanes 0-7 then sum
 * the first group and lanes 8-15 the second, each scaled by its own. No lookups or lane shuffles
 * but the widening: SmolLM2's 120 layer projections at one row (Zen 5, the two builds alternated,
 * medians) from DRAM 2.32 -> 2.06 ms, from the caches 2.23 -> 1.89; the one-row GGUF forward 3.8 -> 3.6. */
INLINE float int4_row_bf16_g32(const uint16_t *xp, const uint8_t *q, const float *scales, const float *mins,
                               const float *xsum, int K) {
    const __m512i low = _mm512_set1_epi16(0x0f), offset = _mm512_set1_epi16(0x4300);
    const int groups = K / 32;
    __m512 acc = _mm512_setzero_ps();
    int k = 0, g = 0;
    for (; k + 64 <= K; k += 64, g += 2) {
        const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(q + k / 2)));
        const __m512i lo = _mm512_or_si512(_mm512_and_si512(bytes, low), offset);
        const __m512i hi = _mm512_or_si512(_mm512_srli_epi16(bytes, 4), offset);
        __m512 part = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)lo, (__m512bh)_mm512_loadu_si512(xp + k));
        part = _mm512_dpbf16_ps(part, (__m512bh)hi, (__m512bh)_mm512_loadu_si512(xp + k + 32));
        const __m512 scale = _mm512_mask_broadcastss_ps(_mm512_set1_ps(scales[g]), 0xff00, _mm_load_ss(scales + g + 1));
        acc = _mm512_fmadd_ps(part, scale, acc);
    }
    if (k < K) { /* the last 32 inputs, in their own order */
        const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(q + k / 2)));
        const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, _mm256_set1_epi16(0x0f))),
                                             _mm256_srli_epi16(bytes, 4), 1);
        const __m512 part = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_or_si512(v, offset),
                                             (__m512bh)_mm512_loadu_si512(xp + k));
        acc = _mm512_fmadd_ps(part, _mm512_set1_ps(scales[g]), acc);
    }
    __m512 shift = _mm512_setzero_ps(); /* sum_g (min_g - 128 scale_g) sum(x_g) */
    for (int i = 0; i < groups; i += 16) {
        const __mmask16 mask = groups - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (groups - i)) - 1);
        const __m512 per_group = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), _mm512_maskz_loadu_ps(mask, scales + i),
                                                  _mm512_maskz_loadu_ps(mask, mins + i));
        shift = _mm512_fmadd_ps(per_group, _mm512_maskz_loadu_ps(mask, xsum + i), shift);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc, shift));
}

/* x for int4_row_bf16_g32 (NULL: no memory): in each 64 inputs the second and third 16 swap places;
 * a last 32 stay as they are. Freed by the caller. */
static uint16_t *permute_for_nibbles(const uint16_t *x, int K) {
    uint16_t *xp = malloc((size_t)K * sizeof *xp);
    if (!xp) return 0;
    int k = 0;
    for (; k + 64 <= K; k += 64) {
        memcpy(xp + k, x + k, 16 * sizeof *xp);
        memcpy(xp + k + 16, x + k + 32, 16 * sizeof *xp);
        memcpy(xp + k + 32, x + k + 16, 16 * sizeof *xp);
        memcpy(xp + k + 48, x + k + 48, 16 * sizeof *xp);
    }
    memcpy(xp + k, x + k, (size_t)(K - k) * sizeof *xp);
    return xp;
}
#endif

int pagoda_linear_int4(const void *x, const uint8_t *q, const float *scales, const float *mins, const void *bias,
                       void *y, int M, int N, int K, int group, int dtype, int num_threads) {
    if (group % 32 || K % group || K / group > INT4_MAX_GROUPS) return -1;
    const int groups = K / group;
    float *x32 = int4_inputs(x, M, K, group, dtype);
    if (!x32) return -1;
    const float *xsum = x32 + (size_t)M * K;
#if defined(__AVX512BF16__) /* AVX-512 CPUs without it (Skylake-SP to Ice Lake) take the tiles */
    if (M == 1 && dtype == DTYPE_BF16) {
        const int ahead = rows_ahead(K / 2 + 8 * groups); /* nibbles, scales and mins */
        uint16_t *xp = group == 32 ? permute_for_nibbles(x, K) : 0;
        if (group == 32 && !xp) {
            free(x32);
            return -1;
        }
#pragma omp parallel for schedule(guided) num_threads(num_threads)
        for (int n = 0; n < N; n++) {
            const uint8_t *qn = q + (int64_t)n * K / 2;
            const float *sn = scales + (int64_t)n * groups, *mn = mins + (int64_t)n * groups;
            if (n + ahead < N) {
                prefetch_span(qn + (int64_t)ahead * K / 2, K / 2);
                prefetch_span(sn + (int64_t)ahead * groups, 4 * groups);
                prefetch_span(mn + (int64_t)ahead * groups, 4 * groups);
            }
            const float v = xp ? int4_row_bf16_g32(xp, qn, sn, mn, xsum, K) : int4_row_bf16(x, qn, sn, mn, xsum, K, group);
            store_output(y, n, v, bias, n, DTYPE_BF16);
        }
        free(xp);
        free(x32);
        return 0;
    }
#endif
    const int tiles = (N + TILE - 1) / TILE;
#pragma omp parallel for schedule(guided) num_threads(num_threads)
    for (int tile = 0; tile < tiles; tile++) {
        const int n0 = tile * TILE, NB = N - n0 < TILE ? N - n0 : TILE;
        const uint8_t *qn = q + (int64_t)n0 * K / 2;
        const float *sn = scales + (int64_t)n0 * groups, *mn = mins + (int64_t)n0 * groups;
        for (int m0 = 0; m0 < M; m0 += TILE) {
            const int MB = M - m0 < TILE ? M - m0 : TILE;
            const float *xm = x32 + (int64_t)m0 * K, *sm = xsum + m0 * groups;
            void *ym = (char *)y + (int64_t)m0 * N * (dtype == DTYPE_BF16 ? 2 : 4);
#define INT4_CASE(mb, nb)                                                                                   \
    case (mb) * 8 + (nb):                                                                                   \
        if (dtype == DTYPE_BF16) int4_tile(xm, qn, sn, mn, sm, bias, ym, K, group, N, n0, mb, nb, DTYPE_BF16); \
        else int4_tile(xm, qn, sn, mn, sm, bias, ym, K, group, N, n0, mb, nb, DTYPE_F32);                    \
        break;
            switch (MB * 8 + NB) {
                INT4_CASE(1, 1) INT4_CASE(1, 2) INT4_CASE(1, 3) INT4_CASE(1, 4)
                INT4_CASE(2, 1) INT4_CASE(2, 2) INT4_CASE(2, 3) INT4_CASE(2, 4)
                INT4_CASE(3, 1) INT4_CASE(3, 2) INT4_CASE(3, 3) INT4_CASE(3, 4)
                INT4_CASE(4, 1) INT4_CASE(4, 2) INT4_CASE(4, 3) INT4_CASE(4, 4)
            }
        }
    }
    free(x32);
    return 0;
}
#elif defined(PAGODA_AVX2)
/* The rows quantized per 32 inputs to int16 (scale: the chunk's largest magnitude / 32767, values
 * rounded to nearest): each value within 2^-16 of the chunk's largest, closer than a bf16 rounding of
 * it, and a chunk's 32 products are integer ones (vpmaddwd). Zen 1 runs each 256-bit op as two halves,
 * and widening the nibbles to fp32 for fused multiply-adds (four conversions and four FMAs a chunk)
 * left the one-row 4-bit layers slower than bf16's stream (SmolLM2, served: 20.2 against 17.7 ms a
 * token). int8 rows (llama.cpp's Q8 activations) were faster still (the GGUF one-row step 18.1 -> 12.0
 * ms against 13.4 for int16) but changed the greedy answers twice as often as the 4-bit weights do
 * (docs/benchmarks.md). The mins' part keeps x's exact fp32 group sums. */
struct int16_rows { /* one allocation: free(scales) */
    int16_t *values; /* [M][K] */
    float *scales;   /* [M][K / 32] */
    float *sums;     /* [M][K / group]: fp32 sums of x */
};

/* 32 values to int16 at the scale their largest magnitude takes to 32767 (returned), each rounded to
 * nearest even as lrintf rounds (the conversion's default mode): for finite values the same bits. A
 * libm call per value and a scalar max, on one thread while the other waits, cost the AVX2 build's
 * one-row GGUF step 0.4-0.6 of its 6.0-7.6 ms on Zen 5. */
INLINE float quantize_chunk_int16(const float *v, int16_t *out) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 x[4], top = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        x[i] = _mm256_loadu_ps(v + 8 * i);
        top = _mm256_max_ps(top, _mm256_and_ps(x[i], magnitude));
    }
    const float largest = hmax8(top);
    const __m256 inverse = _mm256_set1_ps(largest > 0.0f ? 32767.0f / largest : 0.0f);
    for (int i = 0; i < 4; i += 2) { /* packs interleaves 128-bit halves: the permute puts them back in order */
        const __m256i packed = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(x[i], inverse)),
                                                  _mm256_cvtps_epi32(_mm256_mul_ps(x[i + 1], inverse)));
        _mm256_storeu_si256((__m256i *)(out + 8 * i), _mm256_permute4x64_epi64(packed, 0xd8));
    }
    return largest / 32767.0f;
}

static int quantize_rows_int16(const void *x, int M, int K, int group, int dtype, struct int16_rows *out) {
    const int chunks = K / 32, groups = K / group;
    char *memory = malloc((size_t)M * K * sizeof(int16_t) + ((size_t)M * (chunks + groups) + K) * sizeof(float));
    if (!memory) return -1;
    out->scales = (float *)memory;
    out->sums = out->scales + (size_t)M * chunks;
    float *row = out->sums + (size_t)M * groups;
    out->values = (int16_t *)(row + K);
    for (int m = 0; m < M; m++) {
        load_f32(x, (int64_t)m * K, dtype, row, K);
        for (int g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int i = 0; i < group; i++) s += row[g * group + i];
            out->sums[(int64_t)m * groups + g] = s;
        }
        for (int c = 0; c < chunks; c++)
            out->scales[(int64_t)m * chunks + c] = quantize_chunk_int16(row + 32 * c, out->values + (int64_t)m * K + 32 * c);
    }
    return 0;
}

/* Chunk c of a weight row against the row's int16 chunk: the 32 integer products summed (vpmaddwd: in
 * pairs, then the two halves), in 8 fp32 lanes. Nibbles: the low ones are inputs 0-15 of the chunk, the
 * high ones 16-31 (GGUF's layout). */
INLINE __m256 q4_int16_chunk(const uint8_t *q, const int16_t *xq, int c) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)(q + 16 * (int64_t)c)), low = _mm_set1_epi8(0x0f);
    const __m256i lo = _mm256_cvtepu8_epi16(_mm_and_si128(bytes, low));
    const __m256i hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), low));
    const __m256i *x16 = (const __m256i *)(xq + 32 * (int64_t)c);
    const __m256i sums = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256(x16)),
                                          _mm256_madd_epi16(hi, _mm256_loadu_si256(x16 + 1)));
    return _mm256_cvtepi32_ps(sums);
}

/* One output of one row: each chunk's integer dot scaled by its weight group's scale times the row
 * chunk's, two chains of FMAs (odd and even chunks); then sum_g min_g sum(x_g). */
INLINE float int4_row_int16(const int16_t *xq, const float *xscales, const uint8_t *q, const float *scales,
                            const float *mins, const float *xsum, int K, int group) {
    const int chunks = K / 32, groups = K / group, per_group = group / 32;
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int c = 0; c < chunks; c++)
        acc[c & 1] = _mm256_fmadd_ps(q4_int16_chunk(q, xq, c), _mm256_set1_ps(scales[c / per_group] * xscales[c]),
                                     acc[c & 1]);
    __m256 shift = _mm256_setzero_ps();
    for (int g = 0; g < groups; g += 8)
        shift = _mm256_fmadd_ps(load8(mins, g, groups - g, DTYPE_F32), load8(xsum, g, groups - g, DTYPE_F32), shift);
    return hsum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), shift));
}

/* Each output's weight row is read once from DRAM and again from L1 for the step's other rows. */
int pagoda_linear_int4(const void *x, const uint8_t *q, const float *scales, const float *mins, const void *bias,
                       void *y, int M, int N, int K, int group, int dtype, int num_threads) {
    if (group % 32 || K % group || K / group > INT4_MAX_GROUPS) return -1;
    const int groups = K / group, chunks = K / 32, ahead = rows_ahead(K / 2 + 8 * groups); /* nibbles, scales and mins */
    struct int16_rows rows;
    if (quantize_rows_int16(x, M, K, group, dtype, &rows)) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int n = 0; n < N; n++) {
        const uint8_t *qn = q + (int64_t)n * K / 2;
        const float *sn = scales + (int64_t)n * groups, *mn = mins + (int64_t)n * groups;
        if (n + ahead < N) {
            prefetch_span(qn + (int64_t)ahead * K / 2, K / 2);
            prefetch_span(sn + (int64_t)ahead * groups, 4 * groups);
            prefetch_span(mn + (int64_t)ahead * groups, 4 * groups);
        }
        for (int m = 0; m < M; m++) { /* GGUF's groups of 32 as a constant: a chunk's group is the chunk */
            const int16_t *xq = rows.values + (int64_t)m * K;
            const float *xs = rows.scales + (int64_t)m * chunks, *sm = rows.sums + (int64_t)m * groups;
            const float v = group == 32 ? int4_row_int16(xq, xs, qn, sn, mn, sm, K, 32)
                                        : int4_row_int16(xq, xs, qn, sn, mn, sm, K, group);
            store_output(y, (int64_t)m * N + n, v, bias, n, dtype);
        }
    }
    free(rows.scales);
    return 0;
}
#else
int pagoda_linear_int4(const void *x, const uint8_t *q, const float *scales, const float *mins, const void *bias,
                       void *y, int M, int N, int K, int group, int dtype, int num_threads) {
    return -1;
}
#endif

/* ---- y[1, N] = x W^T (+ bias) with W in int8, one scale per output row -----------------------
 * For a one-row step's LM head (the int8 copy of a GGUF Q8_0 head): half of bf16's bytes, each
 * weight row read start to end and widened to fp32 in registers for fused multiply-adds with the fp32
 * row (SmolLM2's 49152 x 576 head, Zen 4: 0.7 ms vs the bf16 kernel's 1.1-1.7 and torch's int8 kernel's
 * 2.9). Scales and bias in the activations' dtype; other row counts are torch's. */
#if defined(__AVX512F__)
int pagoda_linear_int8(const void *x, const int8_t *q, const void *scales, const void *bias, void *y, int M, int N,
                       int K, int dtype, int num_threads) {
    if (M != 1 || K % 32 || K > MAX_HIDDEN) return -1; /* K: a hidden size */
    float x32[MAX_HIDDEN];
    load_f32(x, 0, dtype, x32, K);
    const int ahead = rows_ahead(K);
#pragma omp parallel for schedule(guided) num_threads(num_threads)
    for (int n = 0; n < N; n++) {
        const int8_t *row = q + (int64_t)n * K;
        if (n + ahead < N) prefetch_span(row + (int64_t)ahead * K, K);
        __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps(); /* two chains: the FMA latency */
        for (int k = 0; k < K; k += 32) {
            even = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + k)))),
                                   _mm512_loadu_ps(x32 + k), even);
            odd = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + k + 16)))),
                                  _mm512_loadu_ps(x32 + k + 16), odd);
        }
        float v;
        load_f32(scales, n, dtype, &v, 1);
        v *= _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
        if (bias) {
            float b;
            load_f32(bias, n, dtype, &b, 1);
            v += b;
        }
        store_f32(y, n, dtype, &v, 1);
    }
    return 0;
}
#elif defined(PAGODA_AVX2)
/* The row quantized per 32 inputs (the 4-bit kernel's `quantize_rows_int16`), so a chunk of a weight
 * row is 32 integer products (vpmaddwd on the weights sign-extended to 16 bits), where widening them to
 * fp32 took four conversions and four FMAs. */
int pagoda_linear_int8(const void *x, const int8_t *q, const void *scales, const void *bias, void *y, int M, int N,
                       int K, int dtype, int num_threads) {
    if (M != 1 || K % 32 || K > MAX_HIDDEN) return -1; /* K: a hidden size */
    struct int16_rows row16;
    if (quantize_rows_int16(x, 1, K, 32, dtype, &row16)) return -1;
    const int16_t *xq = row16.values;
    const float *xscales = row16.scales;
    const int ahead = rows_ahead(K), chunks = K / 32;
#pragma omp parallel for schedule(guided) num_threads(num_threads)
    for (int n = 0; n < N; n++) {
        const int8_t *row = q + (int64_t)n * K;
        if (n + ahead < N) prefetch_span(row + (int64_t)ahead * K, K);
        __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int c = 0; c < chunks; c++) {
            const __m128i *w16 = (const __m128i *)(row + 32 * c);
            const __m256i *x16 = (const __m256i *)(xq + 32 * c);
            const __m256i sums = _mm256_add_epi32(
                _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(w16)), _mm256_loadu_si256(x16)),
                _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(w16 + 1)), _mm256_loadu_si256(x16 + 1)));
            acc[c & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(xscales[c]), acc[c & 1]);
        }
        float v;
        load_f32(scales, n, dtype, &v, 1);
        v *= hsum8(_mm256_add_ps(acc[0], acc[1]));
        if (bias) {
            float b;
            load_f32(bias, n, dtype, &b, 1);
            v += b;
        }
        store_f32(y, n, dtype, &v, 1);
    }
    free(row16.scales);
    return 0;
}
#else
int pagoda_linear_int8(const void *x, const int8_t *q, const void *scales, const void *bias, void *y, int M, int N,
                       int K, int dtype, int num_threads) {
    return -1;
}
#endif
