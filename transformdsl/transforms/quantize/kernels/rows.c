/* Decode-sized matrix products over quantized weights, read where they are stored.
 *
 *     y[m, n] = sum_k x[m, k] * W[n, k]  (+ bias[n])      for a few rows m (decoding)
 *
 * W is never dequantized into memory: each weight block is widened to float32 in registers and
 * multiplied by float32 activations, so the result is the exact product of the stored values up to
 * float32 summation order (no activation rounding).  Three layouts, each as its layer saves it:
 *
 *   int8_rows  int8 W (N x K), one float32 scale per row          (quantize int8 weight_only=true)
 *   q8_0_rows  int8 W (N x K), one float16 scale per 32 inputs    (GGUF Q8_0)
 *   q4_0_rows  uint8 W (N x K/2), byte j of a block holding q[j] in its low nibble and q[j + 16] in
 *              its high one, standing for (q - 8) * d; one float16 d per 32 inputs   (GGUF Q4_0)
 *   q4_1_rows  as q4_0, standing for q * d + m; a float16 (d, m) per 32 inputs       (GGUF Q4_1)
 *   int4_rows  uint8 W (N x K/2), input 2j in byte j's low nibble and 2j + 1 in its high one, standing
 *              for (q - 8) * s + z with one (s, z) per group of G inputs, bfloat16 or float32
 *                                                                               (quantize int4)
 *
 * Why hand-written (benchmarks/bench_decode_kernels.py): aten's packed int8/int4 kernels take bfloat16
 * activations and, fed from memory, read weights at a third of the rate a float32 matmul reads its
 * own; decoding a model is these reads.  What makes this one fast is reading ROWS rows together (the
 * activation vector loaded once for all) and prefetching the next rows' bytes while these are summed.
 *
 * Compiled on the machine that runs it (-march=native): the vector width is the CPU's (AVX-512,
 * AVX2+FMA, or plain C).  Rows are split between OpenMP threads, the runtime torch itself uses.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

#define ROWS 8
#define LINE 64

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vset(float v) { return _mm512_set1_ps(v); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
static inline vf vint8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* LANES bytes -> (low nibbles - 8, high nibbles - 8) as floats */
static inline void vnibbles(const uint8_t *p, vf *lo, vf *hi) {
    /* a permute reads only the low 4 bits of each index: the nibble picks its value from -8..7 */
    const __m512 values = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_permutexvar_ps(b, values);
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), values);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline vf vset(float v) { return _mm256_set1_ps(v); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline vf vint8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline void vnibbles(const uint8_t *p, vf *lo, vf *hi) {
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)), eight = _mm256_set1_epi32(8);
    *lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b, _mm256_set1_epi32(15)), eight));
    *hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b, 4), eight));
}
#else
#define LANES 1
typedef float vf;
static inline vf vzero(void) { return 0.0f; }
static inline vf vload(const float *p) { return *p; }
static inline vf vset(float v) { return v; }
static inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
static inline float vsum(vf v) { return v; }
static inline vf vint8(const int8_t *p) { return (float)*p; }
static inline void vnibbles(const uint8_t *p, vf *lo, vf *hi) { *lo = (float)(*p & 15) - 8; *hi = (float)(*p >> 4) - 8; }
#endif

#if defined(__F16C__)
static inline float half(uint16_t h) { return _cvtsh_ss(h); }
#else
static inline float half(uint16_t h) {  /* IEEE binary16 -> binary32, every value exactly */
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 31) bits = sign | 0x7f800000 | (man << 13);
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) bits = sign;
    else {  /* subnormal: normalize */
        exp = 113;
        while (!(man & 1024)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 1023) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif

static inline void prefetch(const void *p) { __builtin_prefetch(p, 0, 3); }

int kernel_lanes(void) { return LANES; }

/* threads <= 0: as many as torch's intra-op setting (torch.set_num_threads sets this OpenMP runtime's) */
static inline int thread_count(int threads) {
#ifdef _OPENMP
    return threads > 0 ? threads : omp_get_max_threads();
#else
    (void)threads;
    return 1;
#endif
}

/* Each layout's dot products for one block of ROWS weight rows and MT (1 or 2) input rows: the weights
 * are widened once and used for both input rows.  Written as always-inline functions with constant MT,
 * so the compiler unrolls the small loops and keeps the accumulators in registers. */
#define MT_MAX 2
#define INLINE static inline __attribute__((always_inline))

INLINE void int8_block(const float *x, const int8_t *w, const float *scale, int64_t n, int64_t rows,
                       int64_t K, const int mt, int fetch, float out[MT_MAX][ROWS])
{
    const int8_t *wr[ROWS];
    vf acc[MT_MAX][ROWS];
    for (int i = 0; i < ROWS; i++) {
        wr[i] = w + (n + (i < rows ? i : 0)) * K;
        for (int j = 0; j < mt; j++) acc[j][i] = vzero();
    }
    int64_t k = 0;
    for (; k + LANES <= K; k += LANES) {
        if (fetch && (k % LINE) == 0)
            for (int i = 0; i < ROWS; i++) prefetch(wr[i] + k + ROWS * K);
        vf xv[MT_MAX];
        for (int j = 0; j < mt; j++) xv[j] = vload(x + j * K + k);
        for (int i = 0; i < ROWS; i++) {
            vf wv = vint8(wr[i] + k);
            for (int j = 0; j < mt; j++) acc[j][i] = vfma(xv[j], wv, acc[j][i]);
        }
    }
    for (int j = 0; j < mt; j++)
        for (int i = 0; i < ROWS; i++) {
            float sum = vsum(acc[j][i]);
            for (int64_t t = k; t < K; t++) sum += x[j * K + t] * (float)wr[i][t];
            out[j][i] = sum * scale[n + (i < rows ? i : 0)];
        }
}

/* GGUF blocks of 32 inputs: per block, the vector sum of x * q for each input row, times the block's d.
 * kind 0: Q8_0; 1: Q4_0 ((q - 8) * d); 2: Q4_1 (q * d + m: (q - 8) * d + (8d + m), the second term times
 * the block's sum of x, read as 16 pairwise sums per block, ``xsum``, so that it is a vector product) */
#define CHUNK 64  /* blocks whose scales are converted to float32 at a time (8 rows: 4 KB on the stack) */

INLINE void gguf_block(const float *x, const float *xsum, const uint8_t *w, const uint16_t *d, int64_t n,
                       int64_t rows, int64_t K, const int mt, int fetch, const int kind, float out[MT_MAX][ROWS])
{
    const int q4 = kind != 0, pairs = kind == 2 ? 2 : 1;
    const int64_t blocks = K / 32, row_bytes = q4 ? K / 2 : K, block_bytes = q4 ? 16 : 32;
    const uint8_t *wr[ROWS];
    const uint16_t *dr[ROWS];
    vf acc[MT_MAX][ROWS];
    /* the chunk's scales (and Q4_1's offsets 8d + m) as float32, read by broadcasts from memory in the
     * loop: converting a float16 there cost the vector ports as much as the nibbles did */
    float scale[ROWS][CHUNK], offset[ROWS][CHUNK];
    for (int i = 0; i < ROWS; i++) {
        int64_t r = n + (i < rows ? i : 0);
        wr[i] = w + r * row_bytes;
        dr[i] = d + r * blocks * pairs;
        for (int j = 0; j < mt; j++) acc[j][i] = vzero();
    }
    for (int64_t b0 = 0; b0 < blocks; b0 += CHUNK) {
        const int64_t count = blocks - b0 < CHUNK ? blocks - b0 : CHUNK;
        for (int i = 0; i < ROWS; i++)
            for (int64_t c = 0; c < count; c++) {
                scale[i][c] = half(dr[i][(b0 + c) * pairs]);
                if (kind == 2) offset[i][c] = 8.0f * scale[i][c] + half(dr[i][(b0 + c) * 2 + 1]);
            }
        for (int64_t c = 0; c < count; c++) {
            const int64_t b = b0 + c, at = b * block_bytes;
            if (fetch && (at % LINE) == 0)
                for (int i = 0; i < ROWS; i++) prefetch(wr[i] + at + ROWS * row_bytes);
            if (fetch && (b * pairs % (LINE / 2)) == 0)
                for (int i = 0; i < ROWS; i++) prefetch(dr[i] + b * pairs + ROWS * blocks * pairs);
            const float *xb = x + b * 32;
            for (int i = 0; i < ROWS; i++) {
                const uint8_t *q = wr[i] + at;
                vf t[MT_MAX];
                for (int j = 0; j < mt; j++) t[j] = vzero();
                if (q4) {
                    for (int e = 0; e < 16; e += LANES) {
                        vf lo, hi;
                        vnibbles(q + e, &lo, &hi);
                        for (int j = 0; j < mt; j++) {
                            t[j] = vfma(vload(xb + j * K + e), lo, t[j]);
                            t[j] = vfma(vload(xb + j * K + 16 + e), hi, t[j]);
                        }
                    }
                } else {
                    for (int e = 0; e < 32; e += LANES) {
                        vf wv = vint8((const int8_t *)q + e);
                        for (int j = 0; j < mt; j++) t[j] = vfma(vload(xb + j * K + e), wv, t[j]);
                    }
                }
                for (int j = 0; j < mt; j++) acc[j][i] = vfma(t[j], vset(scale[i][c]), acc[j][i]);
                if (kind == 2)  /* (8d + m) times the block's x, as 16 pairwise sums: a vector product */
                    for (int j = 0; j < mt; j++)
                        for (int e = 0; e < 16; e += LANES)
                            acc[j][i] = vfma(vload(xsum + j * K / 2 + b * 16 + e), vset(offset[i][c]), acc[j][i]);
            }
        }
    }
    for (int j = 0; j < mt; j++)
        for (int i = 0; i < ROWS; i++) out[j][i] = vsum(acc[j][i]);
}

/* The loop every layout shares: blocks of ROWS weight rows split between threads (``threads`` <= 0:
 * torch's count); each block meets the input rows two at a time (the weights stay in L1 meanwhile;
 * only the first pass prefetches the next block's bytes). */
#define ROW_LOOP(BLOCK_CALL)                                                                  \
    threads = thread_count(threads);                                                          \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1)")        \
    for (int64_t n = 0; n < N; n += ROWS) {                                                   \
        int64_t rows = N - n < ROWS ? N - n : ROWS;                                           \
        float out[MT_MAX][ROWS];                                                              \
        for (int64_t m = 0; m < M; m += MT_MAX) {                                             \
            const float *xm = x + m * K;                                                      \
            int mt = M - m >= MT_MAX ? MT_MAX : 1;                                            \
            if (mt == MT_MAX) BLOCK_CALL(MT_MAX); else BLOCK_CALL(1);                         \
            for (int j = 0; j < mt; j++)                                                      \
                for (int64_t i = 0; i < rows; i++)                                            \
                    y[(m + j) * N + n + i] = out[j][i] + (bias ? bias[n + i] : 0.0f);         \
        }                                                                                     \
    }

void int8_rows(const float *x, const int8_t *w, const float *scale, const float *bias, float *y,
               int64_t M, int64_t N, int64_t K, int threads)
{
#define INT8_CALL(MT) int8_block(xm, w, scale, n, rows, K, MT, m == 0, out)
    ROW_LOOP(INT8_CALL)
}

void q8_0_rows(const float *x, const uint8_t *w, const uint16_t *d, const float *bias, float *y,
               int64_t M, int64_t N, int64_t K, int threads)
{
#define Q8_0_CALL(MT) gguf_block(xm, NULL, w, d, n, rows, K, MT, m == 0, 0, out)
    ROW_LOOP(Q8_0_CALL)
}

void q4_0_rows(const float *x, const uint8_t *w, const uint16_t *d, const float *bias, float *y,
               int64_t M, int64_t N, int64_t K, int threads)
{
#define Q4_0_CALL(MT) gguf_block(xm, NULL, w, d, n, rows, K, MT, m == 0, 1, out)
    ROW_LOOP(Q4_0_CALL)
}

/* ``scratch``: M * K / 2 floats (the caller's): per block of 32 inputs, x[e] + x[e + 16] for e < 16 */
void q4_1_rows(const float *x, const uint8_t *w, const uint16_t *d, float *scratch, const float *bias, float *y,
               int64_t M, int64_t N, int64_t K, int threads)
{
    for (int64_t b = 0; b < M * K / 32; b++)
        for (int e = 0; e < 16; e++) scratch[b * 16 + e] = x[b * 32 + e] + x[b * 32 + 16 + e];
#define Q4_1_CALL(MT) gguf_block(xm, scratch + m * (K / 2), w, d, n, rows, K, MT, m == 0, 2, out)
    ROW_LOOP(Q4_1_CALL)
}

/* quantize int4: nibbles interleaved (even input low, odd high), a scale and a zero per group of G inputs.
 * Per 32 inputs, x is read from a copy reordered to (even inputs, odd inputs) so that the nibbles pair
 * with it as Q4_0's do; the zeros contribute z * (sum of the group's x), summed once per group. */
static inline float bf16(uint16_t h) { uint32_t bits = (uint32_t)h << 16; float f; memcpy(&f, &bits, 4); return f; }

INLINE void int4_block(const float *x, const float *xsum, const uint8_t *w, const void *scale, const void *zero,
                       int bf, int64_t n, int64_t rows, int64_t K, int64_t G, const int mt, int fetch,
                       float out[MT_MAX][ROWS])
{
    const int64_t row_bytes = K / 2, groups = K / G, per_group = G / 32;
    const uint8_t *wr[ROWS];
    int64_t first[ROWS];
    vf acc[MT_MAX][ROWS];
    float zacc[MT_MAX][ROWS];
    for (int i = 0; i < ROWS; i++) {
        int64_t r = n + (i < rows ? i : 0);
        first[i] = r * groups;
        wr[i] = w + r * row_bytes;
        for (int j = 0; j < mt; j++) { acc[j][i] = vzero(); zacc[j][i] = 0.0f; }
    }
    for (int64_t g = 0; g < groups; g++) {
        vf t[MT_MAX][ROWS];
        for (int i = 0; i < ROWS; i++)
            for (int j = 0; j < mt; j++) t[j][i] = vzero();
        for (int64_t b = g * per_group; b < (g + 1) * per_group; b++) {
            const int64_t byte = b * 16;
            if (fetch && (byte % LINE) == 0)
                for (int i = 0; i < ROWS; i++) prefetch(wr[i] + byte + ROWS * row_bytes);
            const float *xb = x + b * 32;
            for (int i = 0; i < ROWS; i++)
                for (int e = 0; e < 16; e += LANES) {
                    vf lo, hi;
                    vnibbles(wr[i] + byte + e, &lo, &hi);
                    for (int j = 0; j < mt; j++) {
                        t[j][i] = vfma(vload(xb + j * K + e), lo, t[j][i]);
                        t[j][i] = vfma(vload(xb + j * K + 16 + e), hi, t[j][i]);
                    }
                }
        }
        for (int i = 0; i < ROWS; i++) {
            const int64_t at = first[i] + g;
            const float s = bf ? bf16(((const uint16_t *)scale)[at]) : ((const float *)scale)[at];
            const float z = bf ? bf16(((const uint16_t *)zero)[at]) : ((const float *)zero)[at];
            for (int j = 0; j < mt; j++) {
                acc[j][i] = vfma(t[j][i], vset(s), acc[j][i]);
                zacc[j][i] += z * xsum[j * groups + g];
            }
        }
    }
    for (int j = 0; j < mt; j++)
        for (int i = 0; i < ROWS; i++) out[j][i] = vsum(acc[j][i]) + zacc[j][i];
}

/* x reordered per 32 inputs to (even, odd) and its sums per group: what int4_block reads */
static void int4_inputs(const float *x, float *xp, float *xsum, int64_t M, int64_t K, int64_t G)
{
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * K;
        float *pm = xp + m * K;
        for (int64_t b = 0; b < K; b += 32)
            for (int e = 0; e < 16; e++) { pm[b + e] = xm[b + 2 * e]; pm[b + 16 + e] = xm[b + 2 * e + 1]; }
        for (int64_t g = 0; g < K / G; g++) {
            float sum = 0.0f;
            for (int64_t e = 0; e < G; e++) sum += xm[g * G + e];
            xsum[m * (K / G) + g] = sum;
        }
    }
}

/* ``scratch``: M * K + M * K / G floats (the caller's, so that no call allocates) */
void int4_rows(const float *x, const uint8_t *w, const void *scale, const void *zero, int bf, int64_t G,
               float *scratch, const float *bias, float *y, int64_t M, int64_t N, int64_t K, int threads)
{
    float *xp = scratch, *xsum = scratch + M * K;
    int4_inputs(x, xp, xsum, M, K, G);
    const int64_t groups = K / G;
    threads = thread_count(threads);
    #pragma omp parallel for schedule(static) num_threads(threads) if(threads > 1)
    for (int64_t n = 0; n < N; n += ROWS) {
        int64_t rows = N - n < ROWS ? N - n : ROWS;
        float out[MT_MAX][ROWS];
        for (int64_t m = 0; m < M; m += MT_MAX) {
            int mt = M - m >= MT_MAX ? MT_MAX : 1;
            if (mt == MT_MAX)
                int4_block(xp + m * K, xsum + m * groups, w, scale, zero, bf, n, rows, K, G, MT_MAX, m == 0, out);
            else
                int4_block(xp + m * K, xsum + m * groups, w, scale, zero, bf, n, rows, K, G, 1, m == 0, out);
            for (int j = 0; j < mt; j++)
                for (int64_t i = 0; i < rows; i++)
                    y[(m + j) * N + n + i] = out[j][i] + (bias ? bias[n + i] : 0.0f);
        }
    }
}
