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
 *   q5_0_rows  as q4_0 plus each block's 32 fifth bits (4 bytes), standing for (q - 16) * d  (GGUF Q5_0)
 *   q5_1_rows  as q5_0, standing for q * d + m; a float16 (d, m) per 32 inputs        (GGUF Q5_1)
 *   q4_k_rows, q5_k_rows, q6_k_rows: GGUF's K-quants, super-blocks of 256 inputs (see each)
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
#include <stdlib.h>
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
/* LANES bytes of a Q5_0 block from byte e on, with the block's fifth bits qh: (q - 16 of inputs e.., of inputs
 * 16 + e..) as floats, each nibble looked up as -16..-1 and 16 added where its fifth bit is set (a masked add) */
static inline void vq5(const uint8_t *p, uint32_t qh, int e, vf *lo, vf *hi) {
    const __m512 values = _mm512_setr_ps(-16, -15, -14, -13, -12, -11, -10, -9, -8, -7, -6, -5, -4, -3, -2, -1);
    const __m512 sixteen = _mm512_set1_ps(16.0f);
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    __m512 l = _mm512_permutexvar_ps(b, values), h = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), values);
    *lo = _mm512_mask_add_ps(l, (__mmask16)(qh >> e), l, sixteen);
    *hi = _mm512_mask_add_ps(h, (__mmask16)(qh >> (16 + e)), h, sixteen);
}
/* LANES columns of a Q6_K half: from bytes a = ql[l..], b = ql[l + 32..], h = qh[l..], the four 6-bit values
 * (0..63) of inputs l, l + 32, l + 64 and l + 96: a's and b's low then high nibbles, each with 2 bits of h above
 * (bits 0-1, 2-3, 4-5, 6-7).  Each byte is widened once for the four. */
static inline void vq6(const uint8_t *a, const uint8_t *b, const uint8_t *h, vf q[4]) {
    const __m512i low = _mm512_set1_epi32(15), top = _mm512_set1_epi32(0x30);
    __m512i va = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)a));
    __m512i vb = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
    __m512i vh = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)h));
    q[0] = _mm512_cvtepi32_ps(_mm512_or_si512(_mm512_and_si512(va, low), _mm512_and_si512(_mm512_slli_epi32(vh, 4), top)));
    q[1] = _mm512_cvtepi32_ps(_mm512_or_si512(_mm512_and_si512(vb, low), _mm512_and_si512(_mm512_slli_epi32(vh, 2), top)));
    q[2] = _mm512_cvtepi32_ps(_mm512_or_si512(_mm512_srli_epi32(va, 4), _mm512_and_si512(vh, top)));
    q[3] = _mm512_cvtepi32_ps(_mm512_or_si512(_mm512_srli_epi32(vb, 4), _mm512_and_si512(_mm512_srli_epi32(vh, 2), top)));
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
/* the fifth bits from bit p of qh on: 8 where set, -8 where not (a nibble widened as q - 8, plus this, is
 * q + 16 * bit - 16) */
static inline vf vfifth(uint32_t qh, int p) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)(qh >> p)), bit), bit);
    return _mm256_blendv_ps(_mm256_set1_ps(-8.0f), _mm256_set1_ps(8.0f), _mm256_castsi256_ps(set));
}
static inline void vq5(const uint8_t *p, uint32_t qh, int e, vf *lo, vf *hi) {
    vnibbles(p, lo, hi);
    *lo = _mm256_add_ps(*lo, vfifth(qh, e));
    *hi = _mm256_add_ps(*hi, vfifth(qh, 16 + e));
}
static inline void vq6(const uint8_t *a, const uint8_t *b, const uint8_t *h, vf q[4]) {
    const __m256i low = _mm256_set1_epi32(15), top = _mm256_set1_epi32(0x30);
    __m256i va = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)a));
    __m256i vb = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)b));
    __m256i vh = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)h));
    q[0] = _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_and_si256(va, low), _mm256_and_si256(_mm256_slli_epi32(vh, 4), top)));
    q[1] = _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_and_si256(vb, low), _mm256_and_si256(_mm256_slli_epi32(vh, 2), top)));
    q[2] = _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_srli_epi32(va, 4), _mm256_and_si256(vh, top)));
    q[3] = _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_srli_epi32(vb, 4), _mm256_and_si256(_mm256_srli_epi32(vh, 2), top)));
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
static inline void vq5(const uint8_t *p, uint32_t qh, int e, vf *lo, vf *hi) {
    *lo = (float)((*p & 15) | (((qh >> e) & 1) << 4)) - 16;
    *hi = (float)((*p >> 4) | (((qh >> (16 + e)) & 1) << 4)) - 16;
}
static inline void vq6(const uint8_t *a, const uint8_t *b, const uint8_t *h, vf q[4]) {
    q[0] = (float)((*a & 15) | ((*h & 3) << 4));
    q[1] = (float)((*b & 15) | (((*h >> 2) & 3) << 4));
    q[2] = (float)((*a >> 4) | (((*h >> 4) & 3) << 4));
    q[3] = (float)((*b >> 4) | (((*h >> 6) & 3) << 4));
}
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
 * only the first pass prefetches the next block's bytes).  BLOCK_CALL(MT) reads input rows m.. */
#define ROW_LOOP(BLOCK_CALL)                                                                  \
    threads = thread_count(threads);                                                          \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1)")        \
    for (int64_t n = 0; n < N; n += ROWS) {                                                   \
        int64_t rows = N - n < ROWS ? N - n : ROWS;                                           \
        float out[MT_MAX][ROWS];                                                              \
        for (int64_t m = 0; m < M; m += MT_MAX) {                                             \
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
#define INT8_CALL(MT) int8_block(x + m * K, w, scale, n, rows, K, MT, m == 0, out)
    ROW_LOOP(INT8_CALL)
}

void q8_0_rows(const float *x, const uint8_t *w, const uint16_t *d, const float *bias, float *y,
               int64_t M, int64_t N, int64_t K, int threads)
{
#define Q8_0_CALL(MT) gguf_block(x + m * K, NULL, w, d, n, rows, K, MT, m == 0, 0, out)
    ROW_LOOP(Q8_0_CALL)
}

void q4_0_rows(const float *x, const uint8_t *w, const uint16_t *d, const float *bias, float *y,
               int64_t M, int64_t N, int64_t K, int threads)
{
#define Q4_0_CALL(MT) gguf_block(x + m * K, NULL, w, d, n, rows, K, MT, m == 0, 1, out)
    ROW_LOOP(Q4_0_CALL)
}

/* ``scratch``: M * K / 2 floats (the caller's): per block of 32 inputs, x[e] + x[e + 16] for e < 16 */
void q4_1_rows(const float *x, const uint8_t *w, const uint16_t *d, float *scratch, const float *bias, float *y,
               int64_t M, int64_t N, int64_t K, int threads)
{
    for (int64_t b = 0; b < M * K / 32; b++)
        for (int e = 0; e < 16; e++) scratch[b * 16 + e] = x[b * 32 + e] + x[b * 32 + 16 + e];
#define Q4_1_CALL(MT) gguf_block(x + m * K, scratch + m * (K / 2), w, d, n, rows, K, MT, m == 0, 2, out)
    ROW_LOOP(Q4_1_CALL)
}

/* GGUF Q4_K: super-blocks of 256 inputs, 8 sub-blocks of 32 standing for d1 * q - m1 (q 0..15), with
 * d1 = d * sc and m1 = dmin * m in float32 as ggml's dequantize_row_q4_K computes them (sc, m: 6 bits each,
 * packed in 12 bytes per super-block; d, dmin float16).  A super-block's 128 bytes are 4 chunks of 32:
 * byte j of chunk c holds sub-block 2c's q[j] in its low nibble and 2c + 1's in its high one.  As for Q4_0,
 * the nibbles are widened as q - 8, so per sub-block
 *
 *     sum_k x_k (d1 q_k - m1) = d1 * sum_k (q_k - 8) x_k  +  (8 d1 - m1) * sum_k x_k
 *
 * the first a vector sum per sub-block times d1, the second a vector product of the sub-blocks' offsets
 * with the input's sums per 32 (``xs``), both accumulated in vector lanes. */
#define SUPERS 8  /* super-blocks whose scales are unpacked to float32 at a time (8 rows: 4 KB on the stack) */

/* One super-block's 8 multipliers d1 = d * sc and offsets 8 d1 - m1 (m1 = dmin * m) from its 12 packed bytes:
 * ggml's get_scale_min_k4, four 6-bit fields a 32-bit word (sc 0..3 = q[0..3] & 63, sc 4..7 = q[8..11] & 15
 * with q[0..3]'s top two bits above; m alike from q[4..7] and q[8..11] >> 4).  d1 and m1 are float32
 * products, as ggml's dequantize_row_q4_K computes them. */
static inline void q4_k_unpack(const uint8_t *q, float d, float dmin, float *scale, float *offset)
{
    uint32_t a, b, c;
    memcpy(&a, q, 4);
    memcpy(&b, q + 4, 4);
    memcpy(&c, q + 8, 4);
    const uint64_t sc = (uint64_t)(a & 0x3f3f3f3fu) | (uint64_t)((c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u)) << 32;
    const uint64_t m = (uint64_t)(b & 0x3f3f3f3fu) | (uint64_t)(((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u)) << 32;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 d1 = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)sc))));
    const __m256 m1 = _mm256_mul_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)m))));
    _mm256_storeu_ps(scale, d1);
    _mm256_storeu_ps(offset, _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(8.0f), d1), m1));
#else
    for (int k = 0; k < 8; k++) {
        const float d1 = d * (float)((sc >> (8 * k)) & 0xff), m1 = dmin * (float)((m >> (8 * k)) & 0xff);
        scale[k] = d1;
        offset[k] = 8.0f * d1 - m1;
    }
#endif
}

/* Q5_K's fifth bits (from qh: bit ``bit`` of LANES bytes from h on) added to LANES values widened as q - 8: 16
 * where set.  Q5_K's values are 0..31, d1 * q - m1 = d1 * (q - 8) + (8 d1 - m1): Q4_K's offsets unchanged. */
static inline vf vfifth_k(const uint8_t *h, int bit, vf v) {
#if defined(__AVX512F__)
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)h));
    return _mm512_mask_add_ps(v, _mm512_test_epi32_mask(b, _mm512_set1_epi32(1 << bit)), v, _mm512_set1_ps(16.0f));
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)h)), m = _mm256_set1_epi32(1 << bit);
    const __m256 set = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(b, m), m));
    return _mm256_add_ps(v, _mm256_and_ps(set, _mm256_set1_ps(16.0f)));
#else
    return v + (float)(((*h >> bit) & 1) << 4);
#endif
}

/* ``qh``: NULL for Q4_K; Q5_K's fifth bits (32 bytes per super-block, bit s of byte l for input 32 s + l) */
INLINE void q4_k_block(const float *x, const float *xs, const uint8_t *w, const uint16_t *dm, const uint8_t *sub,
                       const uint8_t *qh, int64_t n, int64_t rows, int64_t K, const int mt, int fetch,
                       float out[MT_MAX][ROWS])
{
    const int64_t supers = K / 256, row_bytes = K / 2;
    const uint8_t *wr[ROWS];
    int64_t first[ROWS];
    vf acc[MT_MAX][ROWS];
    float scale[ROWS][SUPERS * 8], offset[ROWS][SUPERS * 8], rest[MT_MAX][ROWS];
    for (int i = 0; i < ROWS; i++) {
        first[i] = n + (i < rows ? i : 0);
        wr[i] = w + first[i] * row_bytes;
        for (int j = 0; j < mt; j++) { acc[j][i] = vzero(); rest[j][i] = 0.0f; }
    }
    for (int64_t s0 = 0; s0 < supers; s0 += SUPERS) {
        const int64_t count = supers - s0 < SUPERS ? supers - s0 : SUPERS;
        for (int i = 0; i < ROWS; i++)
            for (int64_t c = 0; c < count; c++) {
                const int64_t at = first[i] * supers + s0 + c;
                q4_k_unpack(sub + at * 12, half(dm[at * 2]), half(dm[at * 2 + 1]), &scale[i][c * 8], &offset[i][c * 8]);
            }
        for (int64_t c = 0; c < count; c++) {
            const int64_t S = s0 + c;
            const float *xb = x + S * 256;
            for (int i = 0; i < ROWS; i++) {
                const uint8_t *q = wr[i] + S * 128;
                const uint8_t *h = qh ? qh + (first[i] * supers + S) * 32 : NULL;
                if (fetch) {
                    for (int l = 0; l < 128; l += LINE) prefetch(q + l + ROWS * row_bytes);
                    if (qh) prefetch(h + ROWS * supers * 32);
                }
                for (int half_ = 0; half_ < 4; half_++) {  /* chunk: sub-blocks 2 half_ (low) and 2 half_ + 1 */
                    vf lo_t[MT_MAX], hi_t[MT_MAX];
                    for (int j = 0; j < mt; j++) { lo_t[j] = vzero(); hi_t[j] = vzero(); }
                    for (int e = 0; e < 32; e += LANES) {
                        vf lo, hi;
                        vnibbles(q + half_ * 32 + e, &lo, &hi);
                        if (qh) {
                            lo = vfifth_k(h + e, 2 * half_, lo);
                            hi = vfifth_k(h + e, 2 * half_ + 1, hi);
                        }
                        for (int j = 0; j < mt; j++) {
                            lo_t[j] = vfma(vload(xb + j * K + half_ * 64 + e), lo, lo_t[j]);
                            hi_t[j] = vfma(vload(xb + j * K + half_ * 64 + 32 + e), hi, hi_t[j]);
                        }
                    }
                    for (int j = 0; j < mt; j++) {
                        acc[j][i] = vfma(lo_t[j], vset(scale[i][c * 8 + 2 * half_]), acc[j][i]);
                        acc[j][i] = vfma(hi_t[j], vset(scale[i][c * 8 + 2 * half_ + 1]), acc[j][i]);
                    }
                }
            }
        }
        for (int i = 0; i < ROWS; i++) {  /* the offsets times the sums per 32 inputs, LANES sub-blocks a step */
            int64_t b = 0;
            for (; b + LANES <= count * 8; b += LANES)
                for (int j = 0; j < mt; j++)
                    acc[j][i] = vfma(vload(xs + j * (K / 32) + s0 * 8 + b), vload(&offset[i][b]), acc[j][i]);
            for (; b < count * 8; b++)
                for (int j = 0; j < mt; j++) rest[j][i] += xs[j * (K / 32) + s0 * 8 + b] * offset[i][b];
        }
    }
    for (int j = 0; j < mt; j++)
        for (int i = 0; i < ROWS; i++) out[j][i] = vsum(acc[j][i]) + rest[j][i];
}

/* each 32 inputs' sum, in order: what the kernels with an offset per block or sub-block multiply it by */
static void block_sums(const float *x, float *sums, int64_t blocks)
{
    for (int64_t b = 0; b < blocks; b++) {
        float sum = 0.0f;
        for (int e = 0; e < 32; e++) sum += x[b * 32 + e];
        sums[b] = sum;
    }
}

/* ``scratch``: M * K / 32 floats (the caller's): each 32 inputs' sum */
void q4_k_rows(const float *x, const uint8_t *w, const uint16_t *dm, const uint8_t *sub, float *scratch,
               const float *bias, float *y, int64_t M, int64_t N, int64_t K, int threads)
{
    block_sums(x, scratch, M * K / 32);
#define Q4_K_CALL(MT) q4_k_block(x + m * K, scratch + m * (K / 32), w, dm, sub, NULL, n, rows, K, MT, m == 0, out)
    ROW_LOOP(Q4_K_CALL)
}

/* GGUF Q5_K: Q4_K's super-blocks plus a fifth bit per value (``qh``: 32 bytes per super-block, bit s of byte l for
 * input 32 s + l), standing for d1 * q - m1 with q 0..31 (ggml's dequantize_row_q5_K).  ``scratch`` as Q4_K's. */
void q5_k_rows(const float *x, const uint8_t *w, const uint16_t *dm, const uint8_t *sub, const uint8_t *qh,
               float *scratch, const float *bias, float *y, int64_t M, int64_t N, int64_t K, int threads)
{
    block_sums(x, scratch, M * K / 32);
#define Q5_K_CALL(MT) q4_k_block(x + m * K, scratch + m * (K / 32), w, dm, sub, qh, n, rows, K, MT, m == 0, out)
    ROW_LOOP(Q5_K_CALL)
}

/* GGUF Q5_0: Q4_0's nibbles plus a fifth bit each (the block's 4 ``qh`` bytes, a little-endian word whose bit
 * j belongs to input j), standing for (q - 16) * d.  Per block, as gguf_block's Q4_0: the vector sum of
 * x * (q - 16) times d (vq5 widens the values). */
/* ``xs`` NULL: Q5_0.  GGUF Q5_1 (``d`` holding (d, m) pairs, ``xs`` each 32 inputs' sum): q * d + m =
 * (q - 16) * d + (16 d + m), the second term the block's offset times its sum of x, a vector product per chunk
 * as Q4_K's offsets are. */
INLINE void q5_0_block(const float *x, const float *xs, const uint8_t *w, const uint8_t *qh, const uint16_t *d,
                       int64_t n, int64_t rows, int64_t K, const int mt, int fetch, float out[MT_MAX][ROWS])
{
    const int64_t blocks = K / 32, row_bytes = K / 2, pairs = xs ? 2 : 1;
    const uint8_t *wr[ROWS], *hr[ROWS];
    const uint16_t *dr[ROWS];
    vf acc[MT_MAX][ROWS];
    float scale[ROWS][CHUNK], offset[ROWS][CHUNK], rest[MT_MAX][ROWS];
    for (int i = 0; i < ROWS; i++) {
        int64_t r = n + (i < rows ? i : 0);
        wr[i] = w + r * row_bytes;
        hr[i] = qh + r * blocks * 4;
        dr[i] = d + r * blocks * pairs;
        for (int j = 0; j < mt; j++) { acc[j][i] = vzero(); rest[j][i] = 0.0f; }
    }
    for (int64_t b0 = 0; b0 < blocks; b0 += CHUNK) {
        const int64_t count = blocks - b0 < CHUNK ? blocks - b0 : CHUNK;
        for (int i = 0; i < ROWS; i++)
            for (int64_t c = 0; c < count; c++) {
                scale[i][c] = half(dr[i][(b0 + c) * pairs]);
                if (xs) offset[i][c] = 16.0f * scale[i][c] + half(dr[i][(b0 + c) * 2 + 1]);
            }
        for (int64_t c = 0; c < count; c++) {
            const int64_t b = b0 + c, at = b * 16;
            if (fetch && (at % LINE) == 0)
                for (int i = 0; i < ROWS; i++) {
                    prefetch(wr[i] + at + ROWS * row_bytes);
                    prefetch(hr[i] + at / 4 + ROWS * blocks * 4);
                }
            const float *xb = x + b * 32;
            for (int i = 0; i < ROWS; i++) {
                const uint8_t *q = wr[i] + at;
                uint32_t high;
                memcpy(&high, hr[i] + b * 4, 4);
                vf t[MT_MAX];
                for (int j = 0; j < mt; j++) t[j] = vzero();
                for (int e = 0; e < 16; e += LANES) {
                    vf lo, hi;
                    vq5(q + e, high, e, &lo, &hi);
                    for (int j = 0; j < mt; j++) {
                        t[j] = vfma(vload(xb + j * K + e), lo, t[j]);
                        t[j] = vfma(vload(xb + j * K + 16 + e), hi, t[j]);
                    }
                }
                for (int j = 0; j < mt; j++) acc[j][i] = vfma(t[j], vset(scale[i][c]), acc[j][i]);
            }
        }
        if (xs)
            for (int i = 0; i < ROWS; i++) {  /* the offsets times the blocks' sums of x, LANES blocks a step */
                int64_t c = 0;
                for (; c + LANES <= count; c += LANES)
                    for (int j = 0; j < mt; j++)
                        acc[j][i] = vfma(vload(xs + j * blocks + b0 + c), vload(&offset[i][c]), acc[j][i]);
                for (; c < count; c++)
                    for (int j = 0; j < mt; j++) rest[j][i] += xs[j * blocks + b0 + c] * offset[i][c];
            }
    }
    for (int j = 0; j < mt; j++)
        for (int i = 0; i < ROWS; i++) out[j][i] = vsum(acc[j][i]) + rest[j][i];
}

void q5_0_rows(const float *x, const uint8_t *w, const uint8_t *qh, const uint16_t *d, const float *bias, float *y,
               int64_t M, int64_t N, int64_t K, int threads)
{
#define Q5_0_CALL(MT) q5_0_block(x + m * K, NULL, w, qh, d, n, rows, K, MT, m == 0, out)
    ROW_LOOP(Q5_0_CALL)
}

/* GGUF Q5_1: Q5_0's nibbles and fifth bits standing for q * d + m, ``dm`` a float16 (d, m) per block.  ``scratch``:
 * M * K / 32 floats (the caller's): each 32 inputs' sum. */
void q5_1_rows(const float *x, const uint8_t *w, const uint8_t *qh, const uint16_t *dm, float *scratch,
               const float *bias, float *y, int64_t M, int64_t N, int64_t K, int threads)
{
    block_sums(x, scratch, M * K / 32);
#define Q5_1_CALL(MT) q5_0_block(x + m * K, scratch + m * (K / 32), w, qh, dm, n, rows, K, MT, m == 0, out)
    ROW_LOOP(Q5_1_CALL)
}

/* GGUF Q6_K: super-blocks of 256 inputs in 16 groups of 16, each group's values (q - 32) * (d * sc) with q 6 bits
 * (0..63), sc an int8 per group and d a float16 per super-block; d * sc in float32 as ggml's dequantize_row_q6_K
 * computes it.  A super-block's 128 ``ql`` bytes hold the low 4 bits and its 64 ``qh`` bytes the high 2, in two
 * halves of 128 inputs: for l < 32, ql[l] holds inputs l (low nibble) and l + 64 (high), ql[l + 32] inputs l + 32
 * and l + 96, and qh[l] the high bits of l, l + 32, l + 64 and l + 96 (2 bits each, from the lowest).  Each
 * vector of values becomes its weights in one fused step, q * s + (-32 s) (s = d * sc, -32 s exact), which the
 * input rows then share. */
INLINE void q6_k_block(const float *x, const uint8_t *w, const uint8_t *qh, const int8_t *sc, const uint16_t *d,
                       int64_t n, int64_t rows, int64_t K, const int mt, int fetch, float out[MT_MAX][ROWS])
{
    const int64_t supers = K / 256;
    const uint8_t *wr[ROWS], *hr[ROWS];
    int64_t first[ROWS];
    vf acc[MT_MAX][ROWS];
    float scale[ROWS][16], shift[ROWS][16];
    for (int i = 0; i < ROWS; i++) {
        first[i] = n + (i < rows ? i : 0);
        wr[i] = w + first[i] * (K / 2);
        hr[i] = qh + first[i] * (K / 4);
        for (int j = 0; j < mt; j++) acc[j][i] = vzero();
    }
    for (int64_t S = 0; S < supers; S++) {
        const float *xb = x + S * 256;
        for (int i = 0; i < ROWS; i++) {
            const int64_t at = first[i] * supers + S;
            const float dd = half(d[at]);
            for (int g = 0; g < 16; g++) {
                scale[i][g] = dd * (float)sc[at * 16 + g];
                shift[i][g] = -32.0f * scale[i][g];
            }
        }
        for (int i = 0; i < ROWS; i++) {
            const uint8_t *ql = wr[i] + S * 128, *qhs = hr[i] + S * 64;
            if (fetch) {
                for (int l = 0; l < 128; l += LINE) prefetch(ql + l + ROWS * (K / 2));
                prefetch(qhs + ROWS * (K / 4));
            }
            for (int h = 0; h < 2; h++) {  /* the two halves of 128 inputs */
                const uint8_t *L = ql + h * 64, *H = qhs + h * 32;
                const float *xh = xb + h * 128;
                const float *g = &scale[i][h * 8], *z = &shift[i][h * 8];
                for (int l = 0; l < 32; l += LANES) {
                    const int is = l / 16;
                    vf q[4];
                    vq6(L + l, L + 32 + l, H + l, q);
                    for (int k = 0; k < 4; k++) {  /* inputs l + 32 k.., group is + 2 k */
                        const vf wv = vfma(q[k], vset(g[is + 2 * k]), vset(z[is + 2 * k]));
                        for (int j = 0; j < mt; j++) acc[j][i] = vfma(vload(xh + j * K + 32 * k + l), wv, acc[j][i]);
                    }
                }
            }
        }
    }
    for (int j = 0; j < mt; j++)
        for (int i = 0; i < ROWS; i++) out[j][i] = vsum(acc[j][i]);
}

void q6_k_rows(const float *x, const uint8_t *w, const uint8_t *qh, const int8_t *sc, const uint16_t *d,
               const float *bias, float *y, int64_t M, int64_t N, int64_t K, int threads)
{
#define Q6_K_CALL(MT) q6_k_block(x + m * K, w, qh, sc, d, n, rows, K, MT, m == 0, out)
    ROW_LOOP(Q6_K_CALL)
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
#define INT4_CALL(MT) int4_block(xp + m * K, xsum + m * groups, w, scale, zero, bf, n, rows, K, G, MT, m == 0, out)
    ROW_LOOP(INT4_CALL)
}

/* ---------------------------------------------------------------------------------------------------
 * int8 activations (``quantize q4_0 activations=int8``): llama.cpp's CPU arithmetic for Q8_0, Q4_0
 * and Q4_1 weights.  The activations are rounded to Q8_0 blocks first (quantize_q8_rows: per 32 inputs
 * d = max|x| / 127, q = roundf(x / d), as ggml's quantize_row_q8_0_ref), each block's dot product with
 * the weight's block is an exact integer sum, and the float result is
 *
 *     y[m, n] = sum over blocks b of  (d_w[n, b] * d_x[m, b]) * sum_k q_w[n, k] * q_x[m, k]
 *               (+ for Q4_1, sum over b of m_w[n, b] * s_x[m, b], s_x = d_x * sum_k q_x: ggml's Q8_1)
 *
 * as ggml_vec_dot_q4_0_q8_0 computes it, up to float32 summation order.  d_x and s_x are kept as float32
 * arrays (M x K/32) holding values rounded to float16, as llama.cpp stores them (block_q8_0/q8_1's
 * ggml_half): the logits follow llama.cpp's rounding, and the kernels convert nothing per block.
 * (llama.cpp's x86 build quantizes x with its SIMD quantize_row_q8_0, not the reference: 127 / max and
 * round-half-even; about 2 in a million q_x differ by one from the reference's on Gaussian inputs.)
 * Vector paths: AVX512-VNNI (vpdpbusd: Q8_0 two blocks a step, Q4_0/Q4_1 four), AVX2 (vpmaddubsw +
 * vpmaddwd, one block a step), plain C.
 *   Q8_0 x Q8_0 (VNNI): the weight made unsigned (w ^ 0x80 = w + 128), minus 128 * sum(q_x) per lane;
 *   Q4_0 (VNNI): nibbles 0..15 times q_x, minus 8 * sum(q_x);  Q4_1: nibbles times q_x, no correction;
 *   Q5_0: the nibbles plus 16 where the fifth bit is set (a masked byte add), minus 16 * sum(q_x).
 *   AVX2 Q8_0: llama.cpp's sign trick (|w| times sign(w) * q_x, |q_x| <= 127 so nothing saturates).
 * Measured against the float32-activation kernels above: benchmarks/bench_int8_activations.py. */
#include <math.h>

#if defined(__F16C__)
static inline float round_half(float f) { return _cvtsh_ss(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT)); }
#else
static inline uint32_t fbits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bitsf(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
/* float -> nearest float16 (ties to even) -> float: ggml's portable GGML_FP32_TO_FP16 */
static inline float round_half(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = fbits(f), shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = bitsf((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = fbits(base), nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return half((uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign)));
}
#endif

/* x (M x K float32, K a multiple of 32) -> q (M x K int8), d (M x K/32: d rounded to float16, as float32)
 * and, where s is not NULL, s (M x K/32: d * sum(q) rounded to float16, ggml's Q8_1 s).  As
 * quantize_row_q8_0_ref: q from the unrounded d's inverse, roundf (half away from zero). */
void quantize_q8_rows(const float *x, int8_t *q, float *d, float *s, int64_t M, int64_t K)
{
    const int64_t blocks = M * (K / 32);
    for (int64_t b = 0; b < blocks; b++) {
        const float *xb = x + b * 32;
        int8_t *qb = q + b * 32;
        float amax = 0.0f;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
        __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
        amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
#else
        for (int e = 0; e < 32; e++) amax = fmaxf(amax, fabsf(xb[e]));
#endif
        const float dv = amax / 127, id = dv != 0.0f ? 1.0f / dv : 0.0f;
        int sum = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
        const __m512 vid = _mm512_set1_ps(id), halfv = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
        __m512 v[2] = {_mm512_mul_ps(v0, vid), _mm512_mul_ps(v1, vid)};
        for (int h = 0; h < 2; h++) {  /* roundf: trunc, then one away from zero where |frac| >= 0.5 (exact) */
            __m512 t = _mm512_roundscale_ps(v[h], _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(v[h], t)), halfv, _CMP_GE_OQ);
            t = _mm512_mask_add_ps(t, up, t, _mm512_or_ps(one, _mm512_and_ps(v[h], _mm512_set1_ps(-0.0f))));
            __m512i qi = _mm512_cvttps_epi32(t);
            _mm_storeu_si128((__m128i *)(qb + 16 * h), _mm512_cvtepi32_epi8(qi));
            if (s) sum += _mm512_reduce_add_epi32(qi);
        }
#else
        for (int e = 0; e < 32; e++) { qb[e] = (int8_t)roundf(xb[e] * id); sum += qb[e]; }
#endif
        d[b] = round_half(dv);
        if (s) s[b] = round_half((float)sum * dv);
    }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define Q8_STEP 2  /* blocks per integer vector (Q4: two vectors, 4 blocks a step) */
typedef __m512 qf;
static inline qf qzero(void) { return _mm512_setzero_ps(); }
static inline float qsum(qf v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#define Q8_STEP 1
typedef __m256 qf;
static inline qf qzero(void) { return _mm256_setzero_ps(); }
static inline float qsum(qf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
#define Q8_STEP 1
typedef float qf;
static inline qf qzero(void) { return 0.0f; }
static inline float qsum(qf v) { return v; }
#endif

int q8_kernel_step(void) { return Q8_STEP; }
#if Q8_STEP == 2
/* n bytes (0..64) from p, the rest zero (a masked load: nothing past p + n is read) */
static inline __m512i load_first(const void *p, int64_t n) {
    return n >= 64 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(n <= 0 ? 0 : (~0ULL >> (64 - n)), p);
}
#endif

/* ``quantize int4 activations=int8`` (q8x_block's kind 3): the layer's (s, z) per group of G inputs,
 * bfloat16 (bf) or float32, rows of K / G */
typedef struct { const void *scale, *zero; int bf; int64_t G; } int4_groups;

static inline float group_value(const void *p, int bf, int64_t at) {
    return bf ? bf16(((const uint16_t *)p)[at]) : ((const float *)p)[at];
}

#if Q8_STEP == 2
/* the first n (1..16) of 16 group values from p (bfloat16 or float32) as float32, the rest 0 */
static inline __m512 group_values(const void *p, int bf, int64_t at, int64_t n) {
    const __mmask16 take = (__mmask16)(n >= 16 ? 0xFFFF : (1u << n) - 1);
    return bf ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                    _mm256_maskz_loadu_epi16(take, (const uint16_t *)p + at)), 16))
              : _mm512_maskz_loadu_ps(take, (const float *)p + at);
}

/* row r's zeros times zx (zx: each group's sum of the rounded x), as a vector to add to the row's sums
 * (one reduction at the end for both: a scalar loop here was a dependent chain as long as a small row) */
static inline __m512 int4_zero_term(const int4_groups *grp, int64_t r, int64_t groups, const float *zx)
{
    __m512 acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g += 16) {
        const int64_t n = groups - g;
        acc = _mm512_fmadd_ps(group_values(grp->zero, grp->bf, r * groups + g, n),
                              _mm512_maskz_loadu_ps((__mmask16)(n >= 16 ? 0xFFFF : (1u << n) - 1), zx + g), acc);
    }
    return acc;
}
#else
static inline float int4_zero_term(const int4_groups *grp, int64_t r, int64_t groups, const float *zx)
{
    float sum = 0.0f;
    for (int64_t g = 0; g < groups; g++) sum += group_value(grp->zero, grp->bf, r * groups + g) * zx[g];
    return sum;
}
#endif

/* kind 0: Q8_0 weights, 1: Q4_0, 2: Q4_1 (then ``sx``: the activation blocks' s_x), 3: quantize int4's groups
 * (``grp``; x's blocks reordered to (even inputs, odd inputs) as int4_rows reads them, so that the nibbles pair
 * with them as Q4_0's do; ``sx``: per group, the sum of its rounded x, which the zeros multiply) */
INLINE void q8x_block(const int8_t *x, const float *dx, const float *sx, const uint8_t *w, const uint16_t *d,
                      const int4_groups *grp, const uint8_t *qh, int64_t n, int64_t rows, int64_t K, const int mt,
                      int fetch, const int kind, float out[MT_MAX][ROWS])
{
    /* centre: what the stored unsigned values stand above zero (Q4_0 and int4: 8, Q5_0 with its fifth bits: 16) */
    const int q4 = kind != 0, pairs = kind == 2 ? 2 : 1, centre = kind == 4 ? 16 : (kind == 1 || kind == 3) ? 8 : 0;
    const int64_t blocks = K / 32, row_bytes = q4 ? K / 2 : K, block_bytes = q4 ? 16 : 32;
    const int64_t groups = kind == 3 ? K / grp->G : 0, per_group = kind == 3 ? grp->G / 32 : 1;
    const int group_shift = __builtin_ctzll((unsigned long long)per_group);  /* (G / 32 is a power of 2: no division) */
    const uint8_t *wr[ROWS], *hr[ROWS];
    const uint16_t *dr[ROWS];
    qf acc[MT_MAX][ROWS];
    float macc[MT_MAX][ROWS];  /* Q4_1: sum of m_w * s_x */
#if defined(__AVX512F__)
    __m512 mvacc[MT_MAX][ROWS];  /* its vector part */
#endif
    /* the chunk's d_w * d_x as float32 (zeros past the last block: a short step's empty lanes read them) */
    float ds[MT_MAX][ROWS][CHUNK + 4];
    for (int i = 0; i < ROWS; i++) {
        int64_t r = n + (i < rows ? i : 0);
        wr[i] = w + r * row_bytes;
        hr[i] = kind == 4 ? qh + r * blocks * 4 : NULL;  /* Q5_0: each block's fifth bits, a 32-bit word */
        dr[i] = kind == 3 ? NULL : d + r * blocks * pairs;
        if (kind == 3 && fetch) {  /* the next rows' scales and zeros (q4's d are prefetched in the loop) */
            const int64_t size = grp->bf ? 2 : 4, next = (r + ROWS) * groups * size;
            for (int64_t at = 0; at < groups * size; at += LINE) {
                prefetch((const uint8_t *)grp->scale + next + at);
                prefetch((const uint8_t *)grp->zero + next + at);
            }
        }
        for (int j = 0; j < mt; j++) {
            acc[j][i] = qzero();
            macc[j][i] = 0.0f;
            if (kind == 3) {
#if Q8_STEP == 2
                acc[j][i] = int4_zero_term(grp, r, groups, sx + j * groups);
#else
                macc[j][i] = int4_zero_term(grp, r, groups, sx + j * groups);
#endif
            }
#if defined(__AVX512F__)
            mvacc[j][i] = _mm512_setzero_ps();
#endif
        }
    }
    for (int64_t b0 = 0; b0 < blocks; b0 += CHUNK) {
        const int64_t count = blocks - b0 < CHUNK ? blocks - b0 : CHUNK;
        for (int i = 0; i < ROWS; i++) {
            int64_t c = 0;
            if (kind == 3) {  /* d_w * d_x: the group's scale times each block's d_x */
                const int64_t r = n + (i < rows ? i : 0);
#if Q8_STEP == 2
                const __m512i lane_group = _mm512_srlv_epi32(
                    _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                    _mm512_set1_epi32(group_shift));
                for (; c < count; c += 16) {  /* 16 blocks (fewer at the end): their groups' scales, spread */
                    const int64_t left = count - c, n = (left < 16 ? left : 16);
                    const __mmask16 these = (__mmask16)(n == 16 ? 0xFFFF : (1u << n) - 1);
                    const __m512 s = _mm512_permutexvar_ps(lane_group, group_values(
                        grp->scale, grp->bf, r * groups + ((b0 + c) >> group_shift), (n + per_group - 1) >> group_shift));
                    for (int j = 0; j < mt; j++)
                        _mm512_mask_storeu_ps(&ds[j][i][c], these,
                                              _mm512_mul_ps(s, _mm512_maskz_loadu_ps(these, dx + j * blocks + b0 + c)));
                }
#endif
                for (; c < count; c++) {
                    const float s = group_value(grp->scale, grp->bf, r * groups + ((b0 + c) >> group_shift));
                    for (int j = 0; j < mt; j++) ds[j][i][c] = s * dx[j * blocks + b0 + c];
                }
                for (int j = 0; j < mt; j++)
                    for (int e = 0; e < 4; e++) ds[j][i][count + e] = 0.0f;
                continue;
            }
#if defined(__AVX512F__)
            if (pairs == 1)
                for (; c + 16 <= count; c += 16) {
                    __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dr[i] + b0 + c)));
                    for (int j = 0; j < mt; j++)
                        _mm512_storeu_ps(&ds[j][i][c], _mm512_mul_ps(dw, _mm512_loadu_ps(dx + j * blocks + b0 + c)));
                }
            else  /* Q4_1: 16 blocks' (d, m) pairs, split */
                for (; c + 16 <= count; c += 16) {
                    const __m256i *h = (const __m256i *)(dr[i] + (b0 + c) * 2);
                    __m512 lo = _mm512_cvtph_ps(_mm256_loadu_si256(h)), hi = _mm512_cvtph_ps(_mm256_loadu_si256(h + 1));
                    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
                    __m512 dw = _mm512_permutex2var_ps(lo, even, hi);
                    __m512 mw = _mm512_permutex2var_ps(lo, _mm512_add_epi32(even, _mm512_set1_epi32(1)), hi);
                    for (int j = 0; j < mt; j++) {
                        _mm512_storeu_ps(&ds[j][i][c], _mm512_mul_ps(dw, _mm512_loadu_ps(dx + j * blocks + b0 + c)));
                        mvacc[j][i] = _mm512_fmadd_ps(mw, _mm512_loadu_ps(sx + j * blocks + b0 + c), mvacc[j][i]);
                    }
                }
#elif defined(__AVX2__) && defined(__F16C__)
            if (pairs == 1)
                for (; c + 8 <= count; c += 8) {
                    __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dr[i] + b0 + c)));
                    for (int j = 0; j < mt; j++)
                        _mm256_storeu_ps(&ds[j][i][c], _mm256_mul_ps(dw, _mm256_loadu_ps(dx + j * blocks + b0 + c)));
                }
#endif
            for (; c < count; c++) {
                const float dw = half(dr[i][(b0 + c) * pairs]);
                for (int j = 0; j < mt; j++) ds[j][i][c] = dw * dx[j * blocks + b0 + c];
                if (kind == 2) {
                    const float mw = half(dr[i][(b0 + c) * 2 + 1]);
                    for (int j = 0; j < mt; j++) macc[j][i] += mw * sx[j * blocks + b0 + c];
                }
            }
            for (int j = 0; j < mt; j++)
                for (int e = 0; e < 4; e++) ds[j][i][count + e] = 0.0f;
        }
        const int step = Q8_STEP == 2 && q4 ? 4 : Q8_STEP;
        for (int64_t c = 0; c < count; c += step) {
            const int64_t b = b0 + c, at = b * block_bytes;
            if (fetch && (at % LINE) == 0)  /* (a step is 16, 32 or 64 bytes: every line is met) */
                for (int i = 0; i < ROWS; i++) prefetch(wr[i] + at + ROWS * row_bytes);
            if (kind != 3 && fetch && (b * pairs % (LINE / 2)) == 0)
                for (int i = 0; i < ROWS; i++) prefetch(dr[i] + b * pairs + ROWS * blocks * pairs);
            const int8_t *xb = x + b * 32;
#if Q8_STEP == 2
          if (q4) {  /* (Q4_1: no correction) */
            /* 4 blocks: weight bytes (b0, b1, b2, b3) -> low nibbles (q[0..15] of each) and high ones
             * (q[16..31]), x's 128-bit lanes regrouped to match: (b0 lo, b1 lo, b2 lo, b3 lo), (.. hi ..) */
            const int64_t left = count - c;  /* 4 except at a chunk's end: masked loads, zero lanes */
            __m512i XL[MT_MAX], XH[MT_MAX], negc[MT_MAX];
            for (int j = 0; j < mt; j++) {
                __m512i X0 = load_first(xb + j * K, left * 32), X1 = load_first(xb + j * K + 64, left * 32 - 64);
                XL[j] = _mm512_shuffle_i64x2(X0, X1, _MM_SHUFFLE(2, 0, 2, 0));
                XH[j] = _mm512_shuffle_i64x2(X0, X1, _MM_SHUFFLE(3, 1, 3, 1));
                negc[j] = _mm512_setzero_si512();
                if (centre) {  /* minus 8 (16) times the lane's sum of q_x */
                    __m512i eights = _mm512_set1_epi8((char)centre);
                    negc[j] = _mm512_sub_epi32(negc[j], _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(
                        _mm512_setzero_si512(), eights, XL[j]), eights, XH[j]));
                }
            }
            const __m512i lane = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
            const __m512i low = _mm512_set1_epi8(15);
            for (int i = 0; i < ROWS; i++) {
                __m512i W = load_first(wr[i] + at, left * 16);
                __m512i L = _mm512_and_si512(W, low), H = _mm512_and_si512(_mm512_srli_epi16(W, 4), low);
                if (kind == 4) {  /* Q5_0: 16 added where the fifth bit is set (bits 0-15: L's lanes, 16-31: H's) */
                    /* the 4 blocks' words (zeros past the chunk), their low halves gathered into one 64-bit mask
                     * and their high halves into another (a byte shuffle: no scalar loop per step) */
                    const __m128i words = _mm_maskz_loadu_epi32((__mmask8)((1u << (left < 4 ? left : 4)) - 1),
                                                                hr[i] + b * 4);
                    const __m128i halves = _mm_shuffle_epi8(words, _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13,
                                                                                 2, 3, 6, 7, 10, 11, 14, 15));
                    const uint64_t lo_bits = (uint64_t)_mm_cvtsi128_si64(halves);
                    const uint64_t hi_bits = (uint64_t)_mm_extract_epi64(halves, 1);
                    const __m512i sixteen = _mm512_set1_epi8(16);
                    L = _mm512_mask_add_epi8(L, (__mmask64)lo_bits, L, sixteen);
                    H = _mm512_mask_add_epi8(H, (__mmask64)hi_bits, H, sixteen);
                }
                for (int j = 0; j < mt; j++) {
                    __m512i t = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(negc[j], L, XL[j]), H, XH[j]);
                    __m512 scale = _mm512_permutexvar_ps(lane, _mm512_castps128_ps512(_mm_loadu_ps(&ds[j][i][c])));
                    acc[j][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), scale, acc[j][i]);
                }
            }
            continue;
          }
            /* Q8_0, 2 blocks: the weight as unsigned (w ^ 0x80 = w + 128), minus 128 times the lane's sum of q_x */
            const int64_t left = count - c;  /* 2, or 1 at an odd count's end: the upper half zero */
            __m512i X[MT_MAX], negc[MT_MAX];
            for (int j = 0; j < mt; j++) {
                X[j] = load_first(xb + j * K, left * 32);
                negc[j] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(
                    _mm512_setzero_si512(), _mm512_set1_epi8((char)0x80), X[j]));
            }
            const __m512i lane = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
            for (int i = 0; i < ROWS; i++) {
                __m512i W = _mm512_xor_si512(load_first(wr[i] + at, left * 32), _mm512_set1_epi8((char)0x80));
                for (int j = 0; j < mt; j++) {
                    __m512i t = _mm512_dpbusd_epi32(negc[j], W, X[j]);
                    __m512 scale = _mm512_permutexvar_ps(lane, _mm512_castps128_ps512(
                        _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)&ds[j][i][c]))));
                    acc[j][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), scale, acc[j][i]);
                }
            }
#elif defined(__AVX2__) && defined(__FMA__)
            const __m256i ones = _mm256_set1_epi16(1);
            __m256i X[MT_MAX], negc[MT_MAX];
            for (int j = 0; j < mt; j++) {
                X[j] = _mm256_loadu_si256((const __m256i *)(xb + j * K));
                negc[j] = _mm256_setzero_si256();
                if (centre)  /* minus 8 (16) times the block's sum of q_x */
                    negc[j] = _mm256_sub_epi32(negc[j], _mm256_madd_epi16(
                        _mm256_maddubs_epi16(_mm256_set1_epi8((char)centre), X[j]), ones));
            }
            for (int i = 0; i < ROWS; i++) {
                const uint8_t *q = wr[i] + at;
                if (q4) {
                    __m128i raw = _mm_loadu_si128((const __m128i *)q);
                    __m256i W = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(15));
                    if (kind == 4) {  /* Q5_0: lane k is input k; its fifth bit is bit k of the block's word */
                        uint32_t word;
                        memcpy(&word, hr[i] + b * 4, 4);
                        const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)word), _mm256_setr_epi8(
                            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
                        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
                        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
                        W = _mm256_or_si256(W, _mm256_and_si256(set, _mm256_set1_epi8(16)));
                    }
                    for (int j = 0; j < mt; j++) {
                        __m256i t = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(W, X[j]), ones), negc[j]);
                        acc[j][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(ds[j][i][c]), acc[j][i]);
                    }
                } else {
                    __m256i W = _mm256_loadu_si256((const __m256i *)q), aw = _mm256_sign_epi8(W, W);
                    for (int j = 0; j < mt; j++) {  /* |w| * (sign(w) q_x): |q_x| <= 127, no saturation */
                        __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(X[j], W)), ones);
                        acc[j][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(ds[j][i][c]), acc[j][i]);
                    }
                }
            }
#else
            for (int i = 0; i < ROWS; i++) {
                const uint8_t *q = wr[i] + at;
                for (int j = 0; j < mt; j++) {
                    const int8_t *xj = xb + j * K;
                    int32_t t = 0;
                    uint32_t word = 0;
                    if (kind == 4) memcpy(&word, hr[i] + b * 4, 4);
                    if (q4)
                        for (int e = 0; e < 16; e++)
                            t += ((int)((q[e] & 15) | (((word >> e) & 1) << 4)) - centre) * xj[e]
                                 + ((int)((q[e] >> 4) | (((word >> (16 + e)) & 1) << 4)) - centre) * xj[e + 16];
                    else
                        for (int e = 0; e < 32; e++) t += (int8_t)q[e] * xj[e];
                    acc[j][i] += (float)t * ds[j][i][c];
                }
            }
#endif
        }
    }
    for (int j = 0; j < mt; j++)
        for (int i = 0; i < ROWS; i++) {
#if defined(__AVX512F__)
            if (kind == 2) macc[j][i] += _mm512_reduce_add_ps(mvacc[j][i]);
#endif
            out[j][i] = qsum(acc[j][i]) + macc[j][i];
        }
}

/* x: M x K int8 (quantize_q8_rows' q), dx (and Q4_1's sx): M x K/32 float32; w, d as q8_0_rows/q4_0_rows/
 * q4_1_rows take them; K a multiple of 32 */
#define Q8X_LOOP(KIND)                                                                        \
    const int64_t nb = K / 32;                                                              \
    ROW_LOOP(Q8X_CALL_##KIND)
#define Q8X_CALL_0(MT) q8x_block(x + m * K, dx + m * nb, NULL, w, d, NULL, NULL, n, rows, K, MT, m == 0, 0, out)
#define Q8X_CALL_1(MT) q8x_block(x + m * K, dx + m * nb, NULL, w, d, NULL, NULL, n, rows, K, MT, m == 0, 1, out)
#define Q8X_CALL_2(MT) q8x_block(x + m * K, dx + m * nb, sx + m * nb, w, d, NULL, NULL, n, rows, K, MT, m == 0, 2, out)

void q8_0_q8_rows(const int8_t *x, const float *dx, const uint8_t *w, const uint16_t *d, const float *bias,
                  float *y, int64_t M, int64_t N, int64_t K, int threads)
{
    Q8X_LOOP(0)
}

void q4_0_q8_rows(const int8_t *x, const float *dx, const uint8_t *w, const uint16_t *d, const float *bias,
                  float *y, int64_t M, int64_t N, int64_t K, int threads)
{
    Q8X_LOOP(1)
}

/* sx: quantize_q8_rows' s (d_x * sum of the block's q_x, rounded to float16) */
void q4_1_q8_rows(const int8_t *x, const float *dx, const float *sx, const uint8_t *w, const uint16_t *d,
                  const float *bias, float *y, int64_t M, int64_t N, int64_t K, int threads)
{
    Q8X_LOOP(2)
}

/* x as float32: rounded to Q8_0 blocks in a buffer of this call's (quantize_q8_rows), then the integer
 * products above: what an activations=int8 layer calls, one call per layer and token as the float
 * kernels are (the Python side of two calls cost as much as the integer products saved on a small model).
 * Returns 0, or -1 (nothing written) when the few bytes of the buffer cannot be allocated. */
static int q8x_rows(const float *x, const uint8_t *w, const uint16_t *d, const float *bias, float *y,
                    int64_t M, int64_t N, int64_t K, int threads, int kind)
{
    const int64_t nb = K / 32;
    float *dx = malloc((size_t)(M * nb * (kind == 2 ? 2 : 1)) * sizeof(float) + (size_t)(M * K) + 1);
    if (!dx) return -1;
    float *sx = kind == 2 ? dx + M * nb : NULL;
    int8_t *q = (int8_t *)(dx + M * nb * (kind == 2 ? 2 : 1));
    quantize_q8_rows(x, q, dx, sx, M, K);
    if (kind == 0) q8_0_q8_rows(q, dx, w, d, bias, y, M, N, K, threads);
    else if (kind == 1) q4_0_q8_rows(q, dx, w, d, bias, y, M, N, K, threads);
    else q4_1_q8_rows(q, dx, sx, w, d, bias, y, M, N, K, threads);
    free(dx);
    return 0;
}

int q8_0_q8x_rows(const float *x, const uint8_t *w, const uint16_t *d, const float *bias, float *y,
                  int64_t M, int64_t N, int64_t K, int threads)
{
    return q8x_rows(x, w, d, bias, y, M, N, K, threads, 0);
}

int q4_0_q8x_rows(const float *x, const uint8_t *w, const uint16_t *d, const float *bias, float *y,
                  int64_t M, int64_t N, int64_t K, int threads)
{
    return q8x_rows(x, w, d, bias, y, M, N, K, threads, 1);
}

int q4_1_q8x_rows(const float *x, const uint8_t *w, const uint16_t *d, const float *bias, float *y,
                  int64_t M, int64_t N, int64_t K, int threads)
{
    return q8x_rows(x, w, d, bias, y, M, N, K, threads, 2);
}

/* ``quantize int4 activations=int8``: x (M x K float32) rounded to Q8_0 blocks as above (each block's inputs
 * first reordered to (even, odd), which changes no block's d_x or q_x, only their order), then per group of G
 *
 *     y[m, n] += s * sum over its blocks b of d_x[b] * sum_k (q_w[k] - 8) * q_x[k]  +  z * sum_b d_x[b] * sum_k q_x[k]
 *
 * the exact product of the stored weights ((q - 8) * s + z) with the rounded x, up to float32 summation order.
 * scale/zero: M x K/G, bfloat16 (bf) or float32; G a multiple of 32 (32..256).  Returns 0, or -1 (nothing
 * written) when the buffer for the rounded x cannot be allocated. */
int int4_q8x_rows(const float *x, const uint8_t *w, const void *scale, const void *zero, int bf, int64_t G,
                  const float *bias, float *y, int64_t M, int64_t N, int64_t K, int threads)
{
    const int64_t nb = K / 32, groups = K / G;
    float *xp = malloc((size_t)(M * K + M * nb + M * groups) * sizeof(float) + (size_t)(M * K) + 1);
    if (!xp) return -1;
    float *dx = xp + M * K, *zx = dx + M * nb;
    int8_t *x8 = (int8_t *)(zx + M * groups);
    for (int64_t b = 0; b < M * nb; b++) {
#if defined(__AVX512F__)
        const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        const __m512 lo = _mm512_loadu_ps(x + b * 32), hi = _mm512_loadu_ps(x + b * 32 + 16);
        _mm512_storeu_ps(xp + b * 32, _mm512_permutex2var_ps(lo, even, hi));
        _mm512_storeu_ps(xp + b * 32 + 16, _mm512_permutex2var_ps(lo, _mm512_add_epi32(even, _mm512_set1_epi32(1)), hi));
#else
        for (int e = 0; e < 16; e++) { xp[b * 32 + e] = x[b * 32 + 2 * e]; xp[b * 32 + 16 + e] = x[b * 32 + 2 * e + 1]; }
#endif
    }
    quantize_q8_rows(xp, x8, dx, NULL, M, K);
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            float sum = 0.0f;
            for (int64_t b = g * (G / 32); b < (g + 1) * (G / 32); b++) {
                const int8_t *q = x8 + m * K + b * 32;
#if defined(__AVX512F__)
                const int32_t t = _mm512_reduce_add_epi32(_mm512_add_epi32(
                    _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)),
                    _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))));
#else
                int32_t t = 0;
                for (int e = 0; e < 32; e++) t += q[e];
#endif
                sum += dx[m * nb + b] * (float)t;
            }
            zx[m * groups + g] = sum;
        }
    const int4_groups grp = {scale, zero, bf, G};
#define INT4X_CALL(MT) q8x_block(x8 + m * K, dx + m * nb, zx + m * groups, w, NULL, &grp, NULL, n, rows, K, MT, m == 0, 3, \
                                 out)
    ROW_LOOP(INT4X_CALL)
    free(xp);
    return 0;
}

/* ``quantize q5_0 activations=int8``: x rounded to Q8_0 blocks (quantize_q8_rows), then per block the integer dot
 * product of the 5-bit values (0..31, the fifth bits from ``qh`` as q5_0_rows takes them) with q_x, minus 16 times
 * the block's sum of q_x, times d_w * d_x: llama.cpp's ggml_vec_dot_q5_0_q8_0, up to float32 summation order.
 * Returns 0, or -1 (nothing written) when the buffer for the rounded x cannot be allocated. */
int q5_0_q8x_rows(const float *x, const uint8_t *w, const uint8_t *qh, const uint16_t *d, const float *bias,
                  float *y, int64_t M, int64_t N, int64_t K, int threads)
{
    const int64_t nb = K / 32;
    float *dx = malloc((size_t)(M * nb) * sizeof(float) + (size_t)(M * K) + 1);
    if (!dx) return -1;
    int8_t *q = (int8_t *)(dx + M * nb);
    quantize_q8_rows(x, q, dx, NULL, M, K);
#define Q5X_CALL(MT) q8x_block(q + m * K, dx + m * nb, NULL, w, d, NULL, qh, n, rows, K, MT, m == 0, 4, out)
    ROW_LOOP(Q5X_CALL)
    free(dx);
    return 0;
}
