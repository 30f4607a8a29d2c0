"""Decode attention on CPU as one small C kernel (AVX2), compiled once with the system C compiler.

A decode step's attention is one query per row against that row's cache. PyTorch runs it as two batched
matmuls of ``rows x kv_heads`` tiny GEMMs (``[group x dim] @ [dim x length]``), whose per-matrix packing
costs more than the arithmetic: on the default job's model at batch 64 that was about half of the whole
step. This kernel walks each (row, K/V head) once: each block of eight keys is read once for all query
heads of the group (one horizontal-add tree per head and block), a softmax in fp32 per head, then each
value row is read once for all of them, reading the KV pool in place (``[slots, kv_heads, max_seq_len, dim]``, rows are slots ``0..rows-1``, row
``r`` attends its first ``lengths[r]`` positions). fp32 only; the sums run in another order than the
matmuls', so results agree with them to rounding (~1e-7), not bit for bit.

The source below is compiled into ``native_step.py``'s library (``native_build.py``: once with the system C
compiler, per instruction set, cached, loaded with ctypes, which releases the GIL for the call), where the
whole decode step calls :c:func:`head` and the PyTorch-ops step calls ``tidal_decode_attention``. Where it
cannot be built (no AVX2, no compiler, not x86-64, a failed build) :func:`load` says why and the engine
keeps PyTorch's matmuls.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <float.h>

/* eight partial-sum vectors -> one vector of their eight sums */
static inline __attribute__((always_inline)) __m256 reduce8(__m256 a0, __m256 a1, __m256 a2, __m256 a3,
                                                             __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
  __m256 t2 = _mm256_hadd_ps(a4, a5), t3 = _mm256_hadd_ps(a6, a7);
  t0 = _mm256_hadd_ps(t0, t1);
  t2 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t2, 0x20), _mm256_permute2f128_ps(t0, t2, 0x31));
}

static inline __attribute__((always_inline)) __m256 dot8(const float *q, const float *k, int D) {
  __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
  for (int c = 8; c < D; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(k + c), acc);
  return acc;
}

#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4), may_alias));
#define VLD(p) (*(const vfu *)(p))
#define VST(p, v) (*(vfu *)(p) = (v))
/* accumulator vectors one pass of the probabilities-times-values loop keeps (of the 16 or 32 registers) */
#define PV_ACC (VW == 16 ? 16 : 8)

/* The G query heads of one K/V head over its first L keys, in one pass over the keys: each block of eight
   keys is read once for all G heads (scores: one horizontal-add tree per head and block), an fp32 softmax
   per head, then each value row is read once for all G heads, summed into G x D/VW accumulators (passes
   over column blocks when that exceeds PV_ACC). G and D are constants after inlining.
   s: G * (L + 8) floats of scratch; o: [G, D]. */
static inline __attribute__((always_inline)) void head_group(const float *restrict q, const float *restrict k,
                                                              const float *restrict v, int L, const int G,
                                                              const int D, float scale, float *restrict s,
                                                              float *restrict o, const float *next_k) {
  const __m256 vscale = _mm256_set1_ps(scale);
  const int SL = L + 8;
  int l = 0;
  for (; l + 8 <= L; l += 8) {
    const float *kb = k + (int64_t)l * D;
    if (next_k) {
      /* these keys' values and the next head's keys, fetched while the scores are computed: the hardware
         prefetcher does not run far enough ahead at each new (row, head) block of the pool */
      for (int b = 0; b < 8 * D; b += 16) {
        _mm_prefetch((const char *)(v + (int64_t)l * D + b), _MM_HINT_T0);
        _mm_prefetch((const char *)(next_k + (int64_t)l * D + b), _MM_HINT_T1);
      }
    }
    _Pragma("GCC unroll 8") for (int g = 0; g < G; g++) {
      const float *qg = q + g * D;
      __m256 r = reduce8(dot8(qg, kb, D), dot8(qg, kb + D, D), dot8(qg, kb + 2 * D, D),
                         dot8(qg, kb + 3 * D, D), dot8(qg, kb + 4 * D, D), dot8(qg, kb + 5 * D, D),
                         dot8(qg, kb + 6 * D, D), dot8(qg, kb + 7 * D, D));
      _mm256_storeu_ps(s + g * SL + l, _mm256_mul_ps(r, vscale));
    }
  }
  for (; l < L; l++) {
    for (int g = 0; g < G; g++) {
      __m256 a = dot8(q + g * D, k + (int64_t)l * D, D);
      __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
      h = _mm_hadd_ps(h, h);
      h = _mm_hadd_ps(h, h);
      s[g * SL + l] = _mm_cvtss_f32(h) * scale;
    }
  }
  float inv[8];
  for (int g = 0; g < G; g++) {
    float *sg = s + g * SL, mx = -FLT_MAX, sum = 0.f;
    for (l = 0; l < L; l++) mx = sg[l] > mx ? sg[l] : mx;
    for (l = 0; l < L; l++) {
      const float e = expf(sg[l] - mx);
      sg[l] = e;
      sum += e;
    }
    inv[g] = 1.f / sum;
  }
  const int CB = G * (D / VW) <= PV_ACC ? D / VW : (PV_ACC / G > 0 ? PV_ACC / G : 1);
  /* two keys per iteration into two accumulator sets when they fit: an FMA's latency is four cycles, so
     G x CB < 8 chains alone would wait on it */
  const int TWO = 2 * G * CB <= PV_ACC;
  for (int c0 = 0; c0 < D / VW; c0 += CB) {
    vf acc[8][PV_ACC], acc2[8][PV_ACC];
    _Pragma("GCC unroll 8") for (int g = 0; g < G; g++)
      _Pragma("GCC unroll 16") for (int c = 0; c < CB; c++) acc[g][c] = acc2[g][c] = (vf){};
    l = 0;
    if (TWO)
      for (; l + 2 <= L; l += 2) {
        const float *vl = v + (int64_t)l * D + c0 * VW;
        _Pragma("GCC unroll 8") for (int g = 0; g < G; g++) {
          const vf p = (vf){} + s[g * SL + l], p2 = (vf){} + s[g * SL + l + 1];
          _Pragma("GCC unroll 16") for (int c = 0; c < CB; c++) {
            acc[g][c] += p * VLD(vl + c * VW);
            acc2[g][c] += p2 * VLD(vl + D + c * VW);
          }
        }
      }
    for (; l < L; l++) {
      const float *vl = v + (int64_t)l * D + c0 * VW;
      _Pragma("GCC unroll 8") for (int g = 0; g < G; g++) {
        const vf p = (vf){} + s[g * SL + l];
        _Pragma("GCC unroll 16") for (int c = 0; c < CB; c++) acc[g][c] += p * VLD(vl + c * VW);
      }
    }
    _Pragma("GCC unroll 8") for (int g = 0; g < G; g++)
      _Pragma("GCC unroll 16") for (int c = 0; c < CB; c++)
        VST(o + g * D + (c0 + c) * VW, (acc[g][c] + acc2[g][c]) * inv[g]);
  }
}

/* the G (<= 8) query heads of a K/V head; constant head dims and group sizes get their own code; next_k
   (NULL: none) the keys the caller reads next, prefetched meanwhile with this head's values */
static void head(const float *q, const float *k, const float *v, int L, int G, int D, float scale, float *s,
                 float *o, const float *next_k) {
#define GROUP(DIM, GS) head_group(q, k, v, L, GS, DIM, scale, s, o, next_k)
#define DIMS(GS)                                     \
  switch (D) {                                       \
    case 16: GROUP(16, GS); break;                   \
    case 32: GROUP(32, GS); break;                   \
    case 64: GROUP(64, GS); break;                   \
    case 128: GROUP(128, GS); break;                 \
    case 256: GROUP(256, GS); break;                 \
  }
  switch (G) {
    case 1: DIMS(1) break;
    case 2: DIMS(2) break;
    case 4: DIMS(4) break;
    case 8: DIMS(8) break;
    default:
      for (int g = 0; g < G; g++) {
        DIMS(1)
        q += D;
        o += D;
      }
  }
#undef DIMS
#undef GROUP
}

/* q: row r, query head j at q + r * q_row_stride + j * D (heads of a K/V head consecutive);
   K, V: [slots, KVH, maxlen, D] contiguous; lengths[r] keys for row r; out: [R, KVH * G * D];
   scratch: 8 * (maxlen + 8) floats. Returns 0, or -1 for a head dim it was not built for. */
int tidal_decode_attention(const float *q, int64_t q_row_stride, const float *K, const float *V,
                           const int64_t *lengths, float *out, int R, int KVH, int G, int D, int maxlen,
                           float scale, float *scratch) {
  if (D != 16 && D != 32 && D != 64 && D != 128 && D != 256) return -1;
  for (int r = 0; r < R; r++) {
    const int L = (int)lengths[r];
    for (int h = 0; h < KVH; h++) {
      const int64_t cache = ((int64_t)r * KVH + h) * maxlen * D;
      const float *k = K + cache, *v = V + cache;
      const float *qr = q + r * q_row_stride + (int64_t)h * G * D;
      float *o = out + ((int64_t)r * KVH + h) * G * D;
      for (int g0 = 0; g0 < G; g0 += 8)
        head(qr + g0 * D, k, v, L, G - g0 < 8 ? G - g0 : 8, D, scale, scratch, o + g0 * D,
             h + 1 < KVH || r + 1 < R ? k + (int64_t)maxlen * D : 0);
    }
  }
  return 0;
}
"""


@cache
def load() -> tuple[ctypes._CFuncPtr | None, str]:
    """The compiled kernel, or None and why not (the reason is shown in the engine's /server_info).

    The native step's library holds this source too, so one build serves both."""
    from tidal.rollout.embedded import native_step  # it imports this module for SOURCE

    lib, how = native_step.load()
    if lib is None:
        return None, how
    fn = lib.tidal_decode_attention
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i32, i32, i32, i32, i32, ctypes.c_float, ptr]
    fn.restype = ctypes.c_int
    return fn, f"native ({how})"


class NativeDecodeAttention:
    """Calls the kernel for one layer's decode attention over the pool's buffers of that layer."""

    def __init__(self, fn, heads: int, kv_heads: int, head_dim: int, max_seq_len: int, scaling: float):
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(
                f"head_dim {head_dim} (the native decode attention covers {SUPPORTED_HEAD_DIMS})"
            )
        self.fn = fn
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.scaling = scaling
        self.scratch = torch.empty(8 * (max_seq_len + 8), dtype=torch.float32)

    def __call__(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """``q`` ``[rows, heads, dim]`` (heads contiguous, any row stride); ``keys``/``values`` a layer's whole
        pool buffers; ``lengths`` int64 ``[rows]``, each <= the buffers' length -> ``[rows, heads * dim]``."""
        rows = q.shape[0]
        if not (q.stride(2) == 1 and q.stride(1) == self.head_dim and keys.is_contiguous()):
            raise ValueError("native decode attention: unexpected tensor layout")
        if rows > keys.shape[0] or 8 * (keys.shape[2] + 8) > self.scratch.numel():
            raise ValueError(
                f"native decode attention: {rows} rows or length {keys.shape[2]} exceed the pool"
            )
        out = torch.empty(rows, self.heads * self.head_dim, dtype=torch.float32)
        status = self.fn(
            q.data_ptr(),
            q.stride(0),
            keys.data_ptr(),
            values.data_ptr(),
            lengths.data_ptr(),
            out.data_ptr(),
            rows,
            self.kv_heads,
            self.heads // self.kv_heads,
            self.head_dim,
            keys.shape[2],
            self.scaling,
            self.scratch.data_ptr(),
        )
        if status != 0:
            raise ValueError(f"native decode attention: head_dim {self.head_dim} not built")
        return out
