"""The native step's GEMMs: ``C[N, cols] (+)= W[N, K] @ X[K, cols]`` over weights in their own layout (C).

Activations are feature-major (``native_step.py``): the rows of a step are the columns of ``X``, padded to
the vector width with zeros. The weight matrix is read where the model keeps it (row-major ``[N, K]``, K
contiguous), so nothing is packed and a weight update is seen at the next call.

- Many columns: register tiles of R weight rows x T vectors of columns (AVX-512: 6 x 4 vectors = 64
  columns, 12 x 32, 14 x 16; AVX2: 6 x 16, 12 x 8): per k, T vector loads of ``X``'s row k and one
  broadcast of each weight ``W[n, k]``, R x T FMAs; no horizontal sums. Weight rows are taken in chunks of
  about 128 KiB so that a chunk stays in L2 while every column block passes over it.
- Up to half a vector of columns (batch 1-8): dot products along k (4 weight rows x up to 4 gathered
  columns), since the tiles would multiply mostly zero padding.

With ``accumulate`` the product is summed from zero and added to ``C`` once (``h + W x``, as the model's
residual adds). Sums run in another order than MKL's (agreement to fp32 rounding). The source needs the
``VW``, ``vf``, ``VLD``, ``VST`` definitions of ``native_attention.py``'s source, which comes first.
"""

from __future__ import annotations

SOURCE = r"""
#define ROUND_UP(n, k) (((n) + (k) - 1) / (k) * (k))

/* one register tile: C[R rows, T vectors] (+)= A[R, :K] @ B[:K, T vectors]; the product is summed from zero
   and added to C once at the end (h + W x, as the model's residual adds) */
#define DEF_TILE(NAME, R, T)                                                                          \
  static void NAME(const float *A, int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc,   \
                   int K, int accumulate) {                                                           \
    vf acc[R][T];                                                                                     \
    _Pragma("GCC unroll 16") for (int i = 0; i < R; i++)                                               \
      _Pragma("GCC unroll 4") for (int t = 0; t < T; t++) acc[i][t] = (vf){};                          \
    for (int k = 0; k < K; k++) {                                                                     \
      vf b[T];                                                                                        \
      _Pragma("GCC unroll 4") for (int t = 0; t < T; t++) b[t] = VLD(B + (int64_t)k * ldb + t * VW);   \
      _Pragma("GCC unroll 16") for (int i = 0; i < R; i++) {                                           \
        const vf a = (vf){} + A[(int64_t)i * lda + k];                                                \
        _Pragma("GCC unroll 4") for (int t = 0; t < T; t++) acc[i][t] += a * b[t];                     \
      }                                                                                               \
    }                                                                                                 \
    _Pragma("GCC unroll 16") for (int i = 0; i < R; i++)                                               \
      _Pragma("GCC unroll 4") for (int t = 0; t < T; t++) {                                            \
        float *c = C + (int64_t)i * ldc + t * VW;                                                     \
        vf r = acc[i][t];                                                                             \
        if (accumulate) r = VLD(c) + r;                                                               \
        VST(c, r);                                                                                    \
      }                                                                                               \
  }

/* tile heights that fill the vector registers: R*T accumulators + T loads + 1 broadcast */
#if VW == 16
#define RT4 6
#define RT2 12
#define RT1 14
DEF_TILE(tile_r4, RT4, 4)
DEF_TILE(tile_14, 1, 4)
#else
#define RT2 6
#define RT1 12
#endif
DEF_TILE(tile_r2, RT2, 2)
DEF_TILE(tile_12, 1, 2)
DEF_TILE(tile_r1, RT1, 1)
DEF_TILE(tile_11, 1, 1)

/* C[N, cols] (+)= A[N, K] @ B[K, cols]; cols a multiple of VW; ld*: row strides in floats. Rows of A are
   taken in chunks of about 128 KiB so that a chunk stays in L2 while every column block passes over it. */
static void gemm_tiled(const float *A, int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc, int N,
                 int cols, int K, int accumulate) {
  int chunk = (int)(32768 / (K > 0 ? K : 1));
  chunk = chunk < 16 ? 16 : chunk;
  for (int n0 = 0; n0 < N; n0 += chunk) {
    const int n1 = n0 + chunk < N ? n0 + chunk : N;
    int m = 0;
#define COLUMN_BLOCK(TN, TR, T)                                                                        \
    for (int n = n0; n < n1;) {                                                                        \
      const float *a = A + (int64_t)n * lda;                                                           \
      float *c = C + (int64_t)n * ldc + m;                                                             \
      if (n + TR <= n1) { TN##r##T(a, lda, B + m, ldb, c, ldc, K, accumulate); n += TR; }              \
      else { TN##1##T(a, lda, B + m, ldb, c, ldc, K, accumulate); n += 1; }                            \
    }
#if VW == 16
    for (; m + 4 * VW <= cols; m += 4 * VW) { COLUMN_BLOCK(tile_, RT4, 4) }
#endif
    for (; m + 2 * VW <= cols; m += 2 * VW) { COLUMN_BLOCK(tile_, RT2, 2) }
    for (; m + VW <= cols; m += VW) { COLUMN_BLOCK(tile_, RT1, 1) }
#undef COLUMN_BLOCK
  }
}

static inline float hsum(vf v) {
  float s = 0.f;
  _Pragma("GCC unroll 16") for (int j = 0; j < VW; j++) s += v[j];
  return s;
}

/* NB rows of A against R (<= 4) gathered columns (xs: R rows of K): dot products along k */
#define DEF_FEW(NAME, NB, R)                                                                           \
  static void NAME(const float *A, int64_t lda, const float *xs, float *C, int64_t ldc, int K,          \
                   int accumulate) {                                                                   \
    vf acc[NB][R];                                                                                     \
    float tail[NB][R];                                                                                 \
    _Pragma("GCC unroll 4") for (int i = 0; i < NB; i++)                                                \
      _Pragma("GCC unroll 4") for (int c = 0; c < R; c++) acc[i][c] = (vf){}, tail[i][c] = 0.f;         \
    int k = 0;                                                                                         \
    for (; k + VW <= K; k += VW) {                                                                     \
      vf x[R];                                                                                         \
      _Pragma("GCC unroll 4") for (int c = 0; c < R; c++) x[c] = VLD(xs + (int64_t)c * K + k);          \
      _Pragma("GCC unroll 4") for (int i = 0; i < NB; i++) {                                            \
        const vf w = VLD(A + (int64_t)i * lda + k);                                                    \
        _Pragma("GCC unroll 4") for (int c = 0; c < R; c++) acc[i][c] += w * x[c];                      \
      }                                                                                                \
    }                                                                                                  \
    for (; k < K; k++)                                                                                 \
      for (int i = 0; i < NB; i++)                                                                     \
        for (int c = 0; c < R; c++) tail[i][c] += A[(int64_t)i * lda + k] * xs[(int64_t)c * K + k];    \
    _Pragma("GCC unroll 4") for (int i = 0; i < NB; i++)                                                \
      _Pragma("GCC unroll 4") for (int c = 0; c < R; c++) {                                             \
        const float y = hsum(acc[i][c]) + tail[i][c];                                                  \
        float *out = C + (int64_t)i * ldc + c;                                                         \
        *out = accumulate ? *out + y : y;                                                              \
      }                                                                                                \
  }
DEF_FEW(few_4_1, 4, 1)
DEF_FEW(few_4_2, 4, 2)
DEF_FEW(few_4_3, 4, 3)
DEF_FEW(few_4_4, 4, 4)
DEF_FEW(few_1_1, 1, 1)
DEF_FEW(few_1_2, 1, 2)
DEF_FEW(few_1_3, 1, 3)
DEF_FEW(few_1_4, 1, 4)

/* columns up to which the dot-product kernel runs instead of the padded tiles (which would multiply mostly
   zero columns) */
#define FEW_COLUMNS (VW / 2)

/* C (+)= A @ B over the first `rows` of `cols` columns (the rest are padding: left alone when accumulating,
   zeros otherwise). xs: 4 * K floats of scratch. */
static void gemm(const float *A, int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc, int N,
                 int rows, int cols, int K, int accumulate, float *xs) {
  if (rows > FEW_COLUMNS) {
    gemm_tiled(A, lda, B, ldb, C, ldc, N, cols, K, accumulate);
    return;
  }
  for (int c0 = 0; c0 < rows; c0 += 4) {
    const int R = rows - c0 < 4 ? rows - c0 : 4;
    for (int c = 0; c < R; c++)
      for (int k = 0; k < K; k++) xs[(int64_t)c * K + k] = B[(int64_t)k * ldb + c0 + c];
    for (int n = 0; n < N;) {
      const float *a = A + (int64_t)n * lda;
      float *out = C + (int64_t)n * ldc + c0;
      if (n + 4 <= N) {
        switch (R) {
          case 1: few_4_1(a, lda, xs, out, ldc, K, accumulate); break;
          case 2: few_4_2(a, lda, xs, out, ldc, K, accumulate); break;
          case 3: few_4_3(a, lda, xs, out, ldc, K, accumulate); break;
          default: few_4_4(a, lda, xs, out, ldc, K, accumulate);
        }
        n += 4;
      } else {
        switch (R) {
          case 1: few_1_1(a, lda, xs, out, ldc, K, accumulate); break;
          case 2: few_1_2(a, lda, xs, out, ldc, K, accumulate); break;
          case 3: few_1_3(a, lda, xs, out, ldc, K, accumulate); break;
          default: few_1_4(a, lda, xs, out, ldc, K, accumulate);
        }
        n += 1;
      }
    }
  }
  if (!accumulate)
    for (int n = 0; n < N; n++)
      for (int c = rows; c < cols; c++) C[(int64_t)n * ldc + c] = 0.f;
}

/* C[N, cols] = A[N, K] @ B[K, cols] as the step runs its projections (the benchmarks' GEMM rate) */
void tidal_gemm(const float *A, const float *B, float *C, int N, int rows, int cols, int K, float *xs) {
  gemm(A, K, B, cols, C, cols, N, rows, cols, K, 0, xs);
}
"""
