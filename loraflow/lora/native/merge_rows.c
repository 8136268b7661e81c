/* loraflow's LoRA merge kernel: out = W + scale * (B @ A) for rows of a BF16 or F32 weight.
 *
 * The arithmetic of loraflow/lora/merge_numerics.py's exact reference: each element of B @ A is a float32
 * chain of fused multiply-adds over k = 0 .. r-1 starting from 0, multiplied by scale in float32,
 * added to the weight in float32, then rounded once to the weight's dtype (BF16: to nearest even).
 * The same bits on every CPU and instruction set. (numpy, PEFT and torch sum the rank products in
 * their BLAS's order instead, which varies by CPU: they agree within merge_numerics' bound.)
 * Every FMA is explicit (fmaf or an FMA instruction) and the file is compiled with
 * -ffp-contract=off, so no other operation is fused.
 *
 * Where the numpy path makes a dozen passes over a block, this makes one: a tile of 128 columns of
 * a row of B @ A lives in registers (8 AVX-512 or 16 AVX2 accumulators, enough independent FMA
 * chains to keep both FMA units busy) and is combined with the weight at once. A is rearranged
 * tile by tile first, so that a tile's r rows are contiguous rather than a row length apart (the
 * same L1 sets); the caller does that once per tensor. Columns past the last whole tile, and CPUs
 * without AVX2+FMA, take the scalar path.
 *
 * Called through ctypes (which releases the GIL), one call per thread on its own range of rows.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define LORAFLOW_X86 1
#endif

#define TILE 128
#define EXP_BITS 0x7F800000u /* exponent all ones: Inf or NaN */
#define ABS_BITS 0x7FFFFFFFu

enum { ISA_AUTO = 0, ISA_SCALAR = 1, ISA_AVX2 = 2, ISA_AVX512 = 3 };
enum { MERGE_OK = -1, MERGE_NO_ISA = -3 };

/* What a call reports: the largest |update| as float bits (for non-NaN floats, bit order is value
 * order), whether any stored value differs from the weight, whether any merged value is not finite. */
typedef struct {
    uint32_t top, diff, bad;
} state_t;

static inline float f32_of_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t bits_of_f32(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* float32 bits -> bfloat16 bits, round to nearest even (finite values) */
static inline uint32_t round_bf16(uint32_t sb) { return (sb + 0x7FFFu + ((sb >> 16) & 1u)) >> 16; }

/* ---- scalar: any CPU; also the columns past the last whole tile ---- */

static inline float update_scalar(const float *a, const float *brow, int64_t n_cols, int64_t r, int64_t j, float scale,
                                  state_t *st) {
    float d = 0.0f;
    for (int64_t k = 0; k < r; k++) d = fmaf(brow[k], a[k * n_cols + j], d);
    const float upd = d * scale;
    const uint32_t ub = bits_of_f32(upd) & ABS_BITS;
    st->top = ub > st->top ? ub : st->top;
    return upd;
}

static void cols_bf16_scalar(const uint16_t *wi, uint16_t *oi, const float *a, const float *brow, int64_t n_cols,
                             int64_t r, int64_t j_from, float scale, state_t *st) {
    for (int64_t j = j_from; j < n_cols; j++) {
        const uint32_t sb = bits_of_f32(f32_of_bits((uint32_t)wi[j] << 16) + update_scalar(a, brow, n_cols, r, j, scale, st));
        const uint16_t o = (uint16_t)round_bf16(sb);
        st->bad |= (sb & EXP_BITS) == EXP_BITS;
        st->diff |= o != wi[j];
        oi[j] = o;
    }
}

static void cols_f32_scalar(const float *wi, float *oi, const float *a, const float *brow, int64_t n_cols, int64_t r,
                            int64_t j_from, float scale, state_t *st) {
    for (int64_t j = j_from; j < n_cols; j++) {
        const float s = wi[j] + update_scalar(a, brow, n_cols, r, j, scale, st);
        st->bad |= (bits_of_f32(s) & EXP_BITS) == EXP_BITS;
        st->diff |= bits_of_f32(s) != bits_of_f32(wi[j]);
        oi[j] = s;
    }
}

#ifdef LORAFLOW_X86

/* ---- AVX-512: two rows at a time, 8 accumulators of 16 each (16 FMA chains; each load of A
 * feeds two FMAs, so the FMA units rather than the load ports set the pace) ---- */

#define AVX512 __attribute__((target("avx512f,avx512bw,fma")))

/* upd[h][q] = scale * (B @ A)[row h, tile columns 16q .. 16q+15] for rows brow[0], brow[1]. */
AVX512 static inline void tile_avx512(const float *at, const float *const brow[2], int64_t r, __m512 scale,
                                      __m512 upd[2][8], __m512i *top) {
    __m512 acc0[8], acc1[8];
    for (int q = 0; q < 8; q++) acc0[q] = acc1[q] = _mm512_setzero_ps();
    for (int64_t k = 0; k < r; k++) {
        const __m512 b0 = _mm512_set1_ps(brow[0][k]), b1 = _mm512_set1_ps(brow[1][k]);
        const float *ak = at + k * TILE;
        for (int q = 0; q < 8; q++) {
            const __m512 av = _mm512_loadu_ps(ak + 16 * q);
            acc0[q] = _mm512_fmadd_ps(b0, av, acc0[q]);
            acc1[q] = _mm512_fmadd_ps(b1, av, acc1[q]);
        }
    }
    const __m512i abs_bits = _mm512_set1_epi32((int)ABS_BITS);
    for (int q = 0; q < 8; q++) {
        upd[0][q] = _mm512_mul_ps(acc0[q], scale);
        upd[1][q] = _mm512_mul_ps(acc1[q], scale);
        *top = _mm512_max_epu32(*top, _mm512_and_si512(_mm512_castps_si512(upd[0][q]), abs_bits));
        *top = _mm512_max_epu32(*top, _mm512_and_si512(_mm512_castps_si512(upd[1][q]), abs_bits));
    }
}

/* 16 columns of the result from the weight at w and the update u, stored at o: BF16 or F32.
 * *bad gets the lanes holding Inf/NaN, *diff the lanes whose stored value changed. */
AVX512 static inline void bf16_x16(const uint16_t *w, uint16_t *o, __m512 u, __mmask16 *bad, __mmask16 *diff) {
    const __m512i exp_bits = _mm512_set1_epi32((int)EXP_BITS);
    const __m512i wv = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)w));
    const __m512i sb = _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(wv, 16)), u));
    *bad |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(sb, exp_bits), exp_bits);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(sb, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(sb, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    *diff |= _mm512_cmpneq_epi32_mask(r, wv);
    _mm256_storeu_si256((__m256i *)o, _mm512_cvtepi32_epi16(r));
}

AVX512 static inline void f32_x16(const float *w, float *o, __m512 u, __mmask16 *bad, __mmask16 *diff) {
    const __m512i exp_bits = _mm512_set1_epi32((int)EXP_BITS);
    const __m512 wv = _mm512_loadu_ps(w);
    const __m512 s = _mm512_add_ps(wv, u);
    const __m512i sb = _mm512_castps_si512(s);
    *bad |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(sb, exp_bits), exp_bits);
    *diff |= _mm512_cmpneq_epi32_mask(sb, _mm512_castps_si512(wv));
    _mm512_storeu_ps(o, s);
}

/* The row loop, once per weight type: rows two at a time (an odd last row is paired with itself
 * and its twin's result dropped), whole tiles in registers, the tail columns on the scalar path. */
#define ROWS_AVX512(NAME, W_T, X16, COLS_SCALAR)                                                           \
    AVX512 static void NAME(const W_T *w, W_T *out, const float *a, const float *ap, const float *b,     \
                            int64_t n_rows, int64_t n_cols, int64_t r, float scale, state_t *st,         \
                            int64_t *first_bad) {                                                        \
        const __m512 vscale = _mm512_set1_ps(scale);                                                     \
        __m512i top = _mm512_setzero_si512();                                                            \
        __mmask16 diff = 0;                                                                              \
        for (int64_t i = 0; i < n_rows && *first_bad < 0; i += 2) {                                      \
            __mmask16 bad[2] = {0, 0};                                                                   \
            const float *const brow[2] = {b + i * r, b + (i + 1 < n_rows ? i + 1 : i) * r};             \
            const int rows = i + 1 < n_rows ? 2 : 1;                                                     \
            int64_t j0 = 0;                                                                              \
            for (; j0 + TILE <= n_cols; j0 += TILE) {                                                    \
                __m512 upd[2][8];                                                                        \
                tile_avx512(ap + j0 * r, brow, r, vscale, upd, &top);                                    \
                for (int h = 0; h < rows; h++)                                                           \
                    for (int q = 0; q < 8; q++)                                                          \
                        X16(w + (i + h) * n_cols + j0 + 16 * q, out + (i + h) * n_cols + j0 + 16 * q,    \
                            upd[h][q], &bad[h], &diff);                                                  \
            }                                                                                            \
            for (int h = 0; h < rows; h++) {                                                             \
                COLS_SCALAR(w + (i + h) * n_cols, out + (i + h) * n_cols, a, brow[h], n_cols, r, j0, scale, st); \
                if (*first_bad < 0 && (bad[h] || st->bad)) *first_bad = i + h;                           \
            }                                                                                            \
        }                                                                                                \
        const uint32_t t = _mm512_reduce_max_epu32(top);                                                 \
        st->top = t > st->top ? t : st->top;                                                             \
        st->diff |= diff != 0;                                                                           \
        st->bad |= *first_bad >= 0;                                                                      \
    }

ROWS_AVX512(rows_bf16_avx512, uint16_t, bf16_x16, cols_bf16_scalar)
ROWS_AVX512(rows_f32_avx512, float, f32_x16, cols_f32_scalar)

/* ---- AVX2: a tile in two halves of 8 accumulators of 8 ---- */

#define AVX2 __attribute__((target("avx2,fma")))

AVX2 static inline void half_avx2(const float *at, const float *brow, int64_t r, __m256 scale, __m256 *upd,
                                  __m256i *top) {
    __m256 acc[8];
    for (int q = 0; q < 8; q++) acc[q] = _mm256_setzero_ps();
    for (int64_t k = 0; k < r; k++) {
        const __m256 bk = _mm256_set1_ps(brow[k]);
        const float *ak = at + k * TILE;
        for (int q = 0; q < 8; q++) acc[q] = _mm256_fmadd_ps(bk, _mm256_loadu_ps(ak + 8 * q), acc[q]);
    }
    const __m256i abs_bits = _mm256_set1_epi32((int)ABS_BITS);
    for (int q = 0; q < 8; q++) {
        upd[q] = _mm256_mul_ps(acc[q], scale);
        *top = _mm256_max_epu32(*top, _mm256_and_si256(_mm256_castps_si256(upd[q]), abs_bits));
    }
}

AVX2 static inline uint32_t reduce_max_avx2(__m256i v) {
    uint32_t lanes[8], t = 0;
    _mm256_storeu_si256((__m256i *)lanes, v);
    for (int q = 0; q < 8; q++) t = lanes[q] > t ? lanes[q] : t;
    return t;
}

/* 8 columns, as bf16_x16 / f32_x16; *bad collects Inf/NaN lanes, *same clears lanes that changed. */
AVX2 static inline void bf16_x8(const uint16_t *w, uint16_t *o, __m256 u, __m256i *bad, __m256i *same) {
    const __m256i exp_bits = _mm256_set1_epi32((int)EXP_BITS);
    const __m256i wv = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)w));
    const __m256i sb = _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(_mm256_slli_epi32(wv, 16)), u));
    *bad = _mm256_or_si256(*bad, _mm256_cmpeq_epi32(_mm256_and_si256(sb, exp_bits), exp_bits));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(sb, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(sb, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    *same = _mm256_and_si256(*same, _mm256_cmpeq_epi32(r, wv));
    _mm_storeu_si128((__m128i *)o, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

AVX2 static inline void f32_x8(const float *w, float *o, __m256 u, __m256i *bad, __m256i *same) {
    const __m256i exp_bits = _mm256_set1_epi32((int)EXP_BITS);
    const __m256 wv = _mm256_loadu_ps(w);
    const __m256 s = _mm256_add_ps(wv, u);
    const __m256i sb = _mm256_castps_si256(s);
    *bad = _mm256_or_si256(*bad, _mm256_cmpeq_epi32(_mm256_and_si256(sb, exp_bits), exp_bits));
    *same = _mm256_and_si256(*same, _mm256_cmpeq_epi32(sb, _mm256_castps_si256(wv)));
    _mm256_storeu_ps(o, s);
}

#define ROWS_AVX2(NAME, W_T, X8, COLS_SCALAR)                                                              \
    AVX2 static void NAME(const W_T *w, W_T *out, const float *a, const float *ap, const float *b,       \
                          int64_t n_rows, int64_t n_cols, int64_t r, float scale, state_t *st,           \
                          int64_t *first_bad) {                                                          \
        const __m256 vscale = _mm256_set1_ps(scale);                                                     \
        __m256i top = _mm256_setzero_si256(), bad = _mm256_setzero_si256(), same = _mm256_set1_epi32(-1); \
        for (int64_t i = 0; i < n_rows && *first_bad < 0; i++) {                                         \
            const W_T *wi = w + i * n_cols;                                                              \
            W_T *oi = out + i * n_cols;                                                                  \
            const float *brow = b + i * r;                                                               \
            int64_t j0 = 0;                                                                              \
            for (; j0 + TILE <= n_cols; j0 += TILE)                                                      \
                for (int h = 0; h < TILE; h += 64) {                                                     \
                    __m256 upd[8];                                                                       \
                    half_avx2(ap + j0 * r + h, brow, r, vscale, upd, &top);                              \
                    for (int q = 0; q < 8; q++) X8(wi + j0 + h + 8 * q, oi + j0 + h + 8 * q, upd[q], &bad, &same); \
                }                                                                                        \
            COLS_SCALAR(wi, oi, a, brow, n_cols, r, j0, scale, st);                                      \
            if (!_mm256_testz_si256(bad, bad) || st->bad) *first_bad = i;                                \
        }                                                                                                \
        const uint32_t t = reduce_max_avx2(top);                                                         \
        st->top = t > st->top ? t : st->top;                                                             \
        st->diff |= _mm256_movemask_epi8(same) != -1;                                                    \
        st->bad |= *first_bad >= 0;                                                                      \
    }

ROWS_AVX2(rows_bf16_avx2, uint16_t, bf16_x8, cols_bf16_scalar)
ROWS_AVX2(rows_f32_avx2, float, f32_x8, cols_f32_scalar)

static int best_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return ISA_AVX2;
    return ISA_SCALAR;
}
#else
static int best_isa(void) { return ISA_SCALAR; }
#endif

/* The instruction set ISA_AUTO picks on this CPU (1 scalar, 2 AVX2+FMA, 3 AVX-512). */
int32_t loraflow_merge_isa(void) { return best_isa(); }

/* Columns per tile: the caller packs A's whole tiles as [n_cols / TILE][r][TILE] (a tile's r rows
 * contiguous; a row of A is n_cols floats long, so unpacked they would share a few L1 sets), once
 * per tensor, and passes both A and the packed tiles. */
int32_t loraflow_merge_tile(void) { return TILE; }

/* out[i, :] = W[i, :] + scale * (B @ A)[i, :] for i < n_rows. w/out: [n_rows, n_cols] (BF16 as uint16
 * bits, or F32), a: [r, n_cols] F32, a_tiles: A packed (see loraflow_merge_tile), b: [n_rows, r] F32,
 * all C-contiguous. isa: ISA_AUTO, or one to force (tests). Returns MERGE_OK (-1); MERGE_NO_ISA (-3)
 * when the forced instruction set is not available here; or the first row holding a non-finite
 * merged value (rows after it are not written). *max_update: max |scale * (B @ A)|; *changed: any
 * stored value differs. */
static int64_t merge_rows(int bf16, const void *w, void *out, const float *a, const float *ap, const float *b,
                          int64_t n_rows, int64_t n_cols, int64_t r, float scale, int32_t isa, float *max_update,
                          int32_t *changed) {
    const int best = best_isa();
    if (isa == ISA_AUTO) isa = best;
    if (isa > best || isa < ISA_SCALAR) return MERGE_NO_ISA;
    state_t st = {0, 0, 0};
    int64_t first_bad = MERGE_OK;
    if (isa == ISA_SCALAR) {
        for (int64_t i = 0; i < n_rows && first_bad < 0; i++) {
            if (bf16)
                cols_bf16_scalar((const uint16_t *)w + i * n_cols, (uint16_t *)out + i * n_cols, a, b + i * r, n_cols,
                                 r, 0, scale, &st);
            else
                cols_f32_scalar((const float *)w + i * n_cols, (float *)out + i * n_cols, a, b + i * r, n_cols, r, 0,
                                scale, &st);
            if (st.bad) first_bad = i;
        }
    }
#ifdef LORAFLOW_X86
    else if (isa == ISA_AVX512 && bf16)
        rows_bf16_avx512(w, out, a, ap, b, n_rows, n_cols, r, scale, &st, &first_bad);
    else if (isa == ISA_AVX512)
        rows_f32_avx512(w, out, a, ap, b, n_rows, n_cols, r, scale, &st, &first_bad);
    else if (bf16)
        rows_bf16_avx2(w, out, a, ap, b, n_rows, n_cols, r, scale, &st, &first_bad);
    else
        rows_f32_avx2(w, out, a, ap, b, n_rows, n_cols, r, scale, &st, &first_bad);
#endif
    *max_update = f32_of_bits(st.top);
    *changed = st.diff != 0;
    return first_bad;
}

int64_t loraflow_merge_rows_bf16(const uint16_t *w, uint16_t *out, const float *a, const float *a_tiles,
                                 const float *b, int64_t n_rows, int64_t n_cols, int64_t r, float scale, int32_t isa,
                                 float *max_update, int32_t *changed) {
    return merge_rows(1, w, out, a, a_tiles, b, n_rows, n_cols, r, scale, isa, max_update, changed);
}

int64_t loraflow_merge_rows_f32(const float *w, float *out, const float *a, const float *a_tiles, const float *b,
                                int64_t n_rows, int64_t n_cols, int64_t r, float scale, int32_t isa,
                                float *max_update, int32_t *changed) {
    return merge_rows(0, w, out, a, a_tiles, b, n_rows, n_cols, r, scale, isa, max_update, changed);
}
