"""The native step's C source (the layer loop around ``native_attention.py``'s and ``native_gemm.py``'s
sources) and the ctypes mirror of its structs: what ``native_step.py`` compiles and binds a model to.

``Layer`` and ``Model`` must list the C structs' fields in their order and types; ``TIMED_PARTS`` names
the C enum of timed parts in its order.
"""

from __future__ import annotations

import ctypes

from tidal.rollout.embedded import native_attention, native_gemm

SOURCE = (
    native_attention.SOURCE
    + native_gemm.SOURCE
    + r"""
#include <string.h>
#include <time.h>

/* ---- the whole decode (or prefill) step of a Qwen3 / Qwen3-MoE model, fp32, one call ----

Activations are kept feature-major ([features, columns], a column per row, columns padded to a multiple
of the vector width with zeros), so every projection is C[N, cols] = W[N, K] @ X[K, cols] with the
weights read in their own row-major layout (no packed copy that a weight update could leave stale) and
the rows' values side by side in one vector register. */

/* ROUND_UP, gemm: native_gemm's source, which comes before this one */

typedef struct {
  const float *input_norm, *post_norm, *qkv, *q_norm, *k_norm, *o_proj;
  const float *gate_up, *down;                          /* dense MLP [2I, H], [H, I]; NULL in a MoE layer */
  const float *router, *experts_gate_up, *experts_down; /* MoE [E, H], [E, 2I, H], [E, H, I]; else NULL */
  float *keys, *values;                                 /* the KV pool's [slots, kv_heads, max_seq_len, D] */
  int64_t intermediate;                                 /* I of this layer's MLP or of each expert */
} Layer;

typedef struct {
  int64_t layers, hidden, heads, kv_heads, head_dim, experts, top_k, norm_topk, vocab, max_seq_len, slots;
  float eps, scaling;
  const float *embed, *final_norm, *lm_head, *cos, *sin_signed; /* rotary tables [max_seq_len, D] */
  const Layer *layer;
  double *timings; /* NULL; or CPU nanoseconds per part of the step, added up (the step profiler's split) */
} Model;

enum { T_GEMM, T_ATTENTION, T_QK_ROTARY_KV, T_ROUTING, T_ELEMENTWISE, T_GREEDY, T_PARTS };

static inline double now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); /* CPU time, as the profiler's step (a loaded host preempts) */
  return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

#define TIMED(part, stmt)                              \
  do {                                                 \
    if (m->timings) {                                  \
      const double t0_ = now_ns();                     \
      stmt;                                            \
      m->timings[part] += now_ns() - t0_;              \
    } else {                                           \
      stmt;                                            \
    }                                                  \
  } while (0)

/* Where each buffer of one step lives in the caller's scratch memory (floats; 64-byte aligned pieces). */
typedef struct {
  float *h, *x, *qkv, *cos, *sin, *q, *attn, *attn_rows, *inv, *attn_scratch;
  float *mlp, *act, *router, *moe, *gathered, *expert_out, *head_in, *logits_t, *few;
  int32_t *pair_row, *chosen;
  float *pair_weight, *chosen_weight;
  int64_t cols, pair_cols, out_cols, total;
} Plan;

#define VOCAB_CHUNK 1024

static int64_t max_intermediate(const Model *m) {
  int64_t i = 0;
  for (int l = 0; l < m->layers; l++) i = m->layer[l].intermediate > i ? m->layer[l].intermediate : i;
  return i;
}

static Plan plan(const Model *m, int rows, int out_rows, float *base) {
  Plan p;
  const int64_t H = m->hidden, D = m->head_dim, I = max_intermediate(m);
  const int64_t qkv = (m->heads + 2 * m->kv_heads) * D, qw = m->heads * D;
  p.cols = ROUND_UP(rows, VW);
  p.out_cols = ROUND_UP(out_rows, VW);
  /* each expert's pairs start at a vector boundary */
  p.pair_cols = m->experts ? ROUND_UP((int64_t)rows * m->top_k + m->experts * (VW - 1), VW) : 0;
  const int64_t mlp_cols = p.pair_cols > p.cols ? p.pair_cols : p.cols;
  int64_t at = 0;
#define TAKE(field, type, n)                                   \
  p.field = (type *)(base ? base + at : NULL);                 \
  at += ROUND_UP((int64_t)(n), 16);
  TAKE(h, float, H * p.cols)
  TAKE(x, float, H * p.cols)
  TAKE(qkv, float, qkv * p.cols)
  TAKE(cos, float, D * p.cols)
  TAKE(sin, float, D * p.cols)
  TAKE(q, float, (int64_t)rows * qw)
  TAKE(attn, float, qw * p.cols)
  TAKE(attn_rows, float, qw * VW)
  TAKE(inv, float, p.cols)
  TAKE(attn_scratch, float, 8 * (m->max_seq_len + 8))
  TAKE(mlp, float, 2 * I * mlp_cols)
  TAKE(act, float, I * mlp_cols)
  TAKE(router, float, m->experts * p.cols)
  TAKE(moe, float, m->experts ? H * p.cols : 0)
  TAKE(gathered, float, H * p.pair_cols)
  TAKE(expert_out, float, H * p.pair_cols)
  TAKE(head_in, float, H * p.out_cols)
  TAKE(logits_t, float, VOCAB_CHUNK * p.out_cols)
  TAKE(few, float, 4 * (H > I ? (H > qw ? H : qw) : (I > qw ? I : qw)))
  TAKE(pair_row, int32_t, p.pair_cols)
  TAKE(pair_weight, float, p.pair_cols)
  TAKE(chosen, int32_t, (int64_t)rows * m->top_k)
  TAKE(chosen_weight, float, (int64_t)rows * m->top_k)
#undef TAKE
  p.total = at;
  return p;
}

/* out[f, c] = x[f, c] / sqrt(mean_f x[f, c]^2 + eps) * w[f], column by column, VW columns at a time */
static void rms_norm_columns(const float *x, const float *w, float *out, int64_t F, int64_t cols, float eps,
                             float *inv) {
  for (int64_t c = 0; c < cols; c += VW) {
    vf ss = (vf){};
    for (int64_t f = 0; f < F; f++) {
      const vf v = VLD(x + f * cols + c);
      ss += v * v;
    }
    for (int j = 0; j < VW; j++) inv[c + j] = 1.f / sqrtf(ss[j] / (float)F + eps);
  }
  for (int64_t f = 0; f < F; f++) {
    const vf wf = (vf){} + w[f];
    for (int64_t c = 0; c < cols; c += VW) VST(out + f * cols + c, VLD(x + f * cols + c) * VLD(inv + c) * wf);
  }
}

static inline float silu(float v) { return v / (1.f + expf(-v)); }

/* act[i, c] = silu(gate[i, c]) * up[i, c] with gate = mlp[:I], up = mlp[I:2I] */
static void swiglu(const float *mlp, float *act, int64_t I, int64_t ld, int64_t c0, int64_t c1) {
  for (int64_t i = 0; i < I; i++) {
    const float *g = mlp + i * ld, *u = mlp + (I + i) * ld;
    float *a = act + i * ld;
    for (int64_t c = c0; c < c1; c++) a[c] = silu(g[c]) * u[c];
  }
}

/* dst[f, c0 + j] = src[j][f] for j < n <= VW: rows into columns a vector-width block of rows at a time, so
   that each feature's row of dst is written one cache line per block (a prefill's columns are thousands of
   floats apart: a column at a time would touch a page per feature and per row) */
static void rows_to_columns(float *dst, int64_t ld, int64_t c0, int n, const float *const *src, int64_t F) {
  for (int64_t f = 0; f < F; f++) {
    float *d = dst + f * ld + c0;
    for (int j = 0; j < n; j++) d[j] = src[j][f];
  }
}

/* the rows' embeddings and rotary tables, transposed into columns; padding columns are zeros */
static void embed_columns(const Model *m, const Plan *p, int rows, const int64_t *ids, const int64_t *positions) {
  const int64_t H = m->hidden, D = m->head_dim, cols = p->cols;
  memset(p->h, 0, sizeof(float) * H * cols);
  memset(p->cos, 0, sizeof(float) * D * cols);
  memset(p->sin, 0, sizeof(float) * D * cols);
  const float *e[VW], *cs[VW], *sn[VW];
  for (int64_t c0 = 0; c0 < rows; c0 += VW) {
    const int n = rows - c0 < VW ? (int)(rows - c0) : VW;
    for (int j = 0; j < n; j++) {
      e[j] = m->embed + ids[c0 + j] * H;
      cs[j] = m->cos + positions[c0 + j] * D;
      sn[j] = m->sin_signed + positions[c0 + j] * D;
    }
    rows_to_columns(p->h, cols, c0, n, e, H);
    rows_to_columns(p->cos, cols, c0, n, cs, D);
    rows_to_columns(p->sin, cols, c0, n, sn, D);
  }
}

/* where head `head` (q heads, then k heads, then v heads) lies among the fused Q/K/V's output features, in
   head_dim blocks: the fused matrix's rows are in megatron's grouped order (fused.py), per KV group its
   query heads, its key head, its value head */
static inline int64_t grouped_block(const Model *m, int64_t head) {
  const int64_t per_group = m->heads / m->kv_heads;
  if (head < m->heads) return head / per_group * (per_group + 2) + head % per_group;
  if (head < m->heads + m->kv_heads) return (head - m->heads) * (per_group + 2) + per_group;
  return (head - m->heads - m->kv_heads) * (per_group + 2) + per_group + 1;
}

/* Q and K heads: RMSNorm over each head (scaled by q_norm / k_norm), rotated by the rows' positions'
   tables; queries to p->q ([rows, heads * D]), keys and values into each row's slot at its position. */
static void qk_norm_rotary_store(const Model *m, const Layer *L, const Plan *p, int rows,
                                 const int64_t *positions, const int64_t *slots) {
  const int64_t D = m->head_dim, half = D / 2, cols = p->cols, S = m->max_seq_len;
  vf block[256];
  float lanes[256 * VW] __attribute__((aligned(64)));
  for (int64_t head = 0; head < m->heads + 2 * m->kv_heads; head++) {
    const int is_q = head < m->heads, is_v = head >= m->heads + m->kv_heads;
    const float *src = p->qkv + grouped_block(m, head) * D * cols;
    const float *w = is_q ? L->q_norm : L->k_norm;
    for (int64_t c = 0; c < cols && c < rows; c += VW) {
      if (is_v) {
        for (int64_t d = 0; d < D; d++) block[d] = VLD(src + d * cols + c);
      } else {
        vf ss = (vf){}, n[256];
        for (int64_t d = 0; d < D; d++) {
          n[d] = VLD(src + d * cols + c);
          ss += n[d] * n[d];
        }
        vf inv;
        for (int j = 0; j < VW; j++) inv[j] = 1.f / sqrtf(ss[j] / (float)D + m->eps);
        for (int64_t d = 0; d < D; d++) n[d] = n[d] * inv * ((vf){} + w[d]);
        for (int64_t d = 0; d < D; d++)
          block[d] = n[d] * VLD(p->cos + d * cols + c) + n[(d + half) % D] * VLD(p->sin + d * cols + c);
      }
      for (int64_t d = 0; d < D; d++) VST(lanes + d * VW, block[d]);
      const int n_rows = rows - c < VW ? (int)(rows - c) : VW;
      for (int j = 0; j < n_rows; j++) {
        const int64_t r = c + j;
        float *dst;
        if (is_q) {
          dst = p->q + r * m->heads * D + head * D;
        } else {
          const int64_t kvh = is_v ? head - m->heads - m->kv_heads : head - m->heads;
          const int64_t slot = slots ? slots[r] : r;
          float *buf = is_v ? L->values : L->keys;
          dst = buf + ((slot * m->kv_heads + kvh) * S + positions[r]) * D;
        }
        for (int64_t d = 0; d < D; d++) dst[d] = lanes[d * VW + j];
      }
    }
  }
}

/* each row's attention per K/V head (row layout, a vector-width block of rows at a time), then the block's
   outputs transposed into the columns of p->attn. Each head prefetches the keys of the next (measured in
   the step: 3-5% on the default job's model, 9% on a 4-layer hidden-256 qwen3 whose cache is in DRAM). */
static void attention(const Model *m, const Layer *L, const Plan *p, int rows, const int64_t *positions,
                      const int64_t *slots) {
  const int64_t D = m->head_dim, G = m->heads / m->kv_heads, S = m->max_seq_len, qw = m->heads * D;
  const float *out_rows[VW];
  for (int64_t c0 = 0; c0 < rows; c0 += VW) {
    const int n = rows - c0 < VW ? (int)(rows - c0) : VW;
    for (int j = 0; j < n; j++) {
      const int64_t r = c0 + j, slot = slots ? slots[r] : r;
      const int len = (int)positions[r] + 1;
      float *o = p->attn_rows + j * qw;
      for (int64_t h = 0; h < m->kv_heads; h++) {
        const int64_t cache = (slot * m->kv_heads + h) * S * D;
        const float *next_k = L->keys + cache + S * D; /* the next head's, or row r + 1's first head's */
        if (h + 1 == m->kv_heads) next_k = r + 1 < rows ? L->keys + (slots ? slots[r + 1] : r + 1) * m->kv_heads * S * D : NULL;
        const float *qr = p->q + r * qw + h * G * D;
        for (int64_t g0 = 0; g0 < G; g0 += 8)
          head(qr + g0 * D, L->keys + cache, L->values + cache, len, G - g0 < 8 ? (int)(G - g0) : 8, (int)D,
               m->scaling, p->attn_scratch, o + (h * G + g0) * D, next_k);
      }
      out_rows[j] = o;
    }
    rows_to_columns(p->attn, p->cols, c0, n, out_rows, qw);
  }
}

/* router softmax (fp32), top-k (ties: the lower expert first), renormalised when asked, as transformers */
static void route(const Model *m, const Plan *p, int rows) {
  const int64_t E = m->experts, K = m->top_k;
  float prob[1024];
  for (int64_t r = 0; r < rows; r++) {
    float mx = -FLT_MAX, sum = 0.f;
    for (int64_t e = 0; e < E; e++) mx = p->router[e * p->cols + r] > mx ? p->router[e * p->cols + r] : mx;
    for (int64_t e = 0; e < E; e++) {
      prob[e] = expf(p->router[e * p->cols + r] - mx);
      sum += prob[e];
    }
    for (int64_t e = 0; e < E; e++) prob[e] = prob[e] / sum;
    float picked = 0.f;
    for (int64_t k = 0; k < K; k++) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; e++)
        if (prob[e] >= 0.f && (best < 0 || prob[e] > prob[best])) best = e;
      p->chosen[r * K + k] = (int32_t)best;
      p->chosen_weight[r * K + k] = prob[best];
      picked += prob[best];
      prob[best] = -1.f;
    }
    if (m->norm_topk)
      for (int64_t k = 0; k < K; k++) p->chosen_weight[r * K + k] = p->chosen_weight[r * K + k] / picked;
  }
}

/* the sparse MoE block of transformers' Qwen3-MoE: each expert's rows gathered into one column block, its
   two projections as GEMMs, then the weighted outputs summed per row expert by expert into p->moe */
static void moe(const Model *m, const Layer *L, const Plan *p, int rows) {
  const int64_t E = m->experts, K = m->top_k, H = m->hidden, I = L->intermediate, cols = p->cols;
  const int64_t PC = p->pair_cols;
  TIMED(T_GEMM, gemm(L->router, H, p->x, cols, p->router, cols, (int)E, rows, (int)cols, (int)H, 0, p->few));
  TIMED(T_ROUTING, route(m, p, rows));
  const double t0 = m->timings ? now_ns() : 0;
  int64_t count[1024], start[1025], fill[1024];
  for (int64_t e = 0; e < E; e++) count[e] = 0;
  for (int64_t i = 0; i < rows * K; i++) count[p->chosen[i]]++;
  start[0] = 0;
  for (int64_t e = 0; e < E; e++) start[e + 1] = start[e] + ROUND_UP(count[e], VW);
  for (int64_t e = 0; e < E; e++) fill[e] = start[e];
  for (int64_t c = 0; c < start[E]; c++) p->pair_row[c] = -1;
  for (int64_t r = 0; r < rows; r++)
    for (int64_t k = 0; k < K; k++) {
      const int32_t e = p->chosen[r * K + k];
      p->pair_row[fill[e]] = (int32_t)r;
      p->pair_weight[fill[e]++] = p->chosen_weight[r * K + k];
    }
  for (int64_t f = 0; f < H; f++) {
    const float *src = p->x + f * cols;
    float *dst = p->gathered + f * PC;
    for (int64_t c = 0; c < start[E]; c++) dst[c] = p->pair_row[c] >= 0 ? src[p->pair_row[c]] : 0.f;
  }
  if (m->timings) m->timings[T_ROUTING] += now_ns() - t0;
  for (int64_t e = 0; e < E; e++) {
    if (!count[e]) continue;
    const int64_t c0 = start[e], n = start[e + 1] - c0;
    TIMED(T_GEMM, gemm(L->experts_gate_up + e * 2 * I * H, H, p->gathered + c0, PC, p->mlp + c0, PC,
                       (int)(2 * I), (int)count[e], (int)n, (int)H, 0, p->few));
    TIMED(T_ELEMENTWISE, swiglu(p->mlp, p->act, I, PC, c0, c0 + n));
    TIMED(T_GEMM, gemm(L->experts_down + e * H * I, I, p->act + c0, PC, p->expert_out + c0, PC, (int)H,
                       (int)count[e], (int)n, (int)I, 0, p->few));
  }
  const double t1 = m->timings ? now_ns() : 0;
  /* feature by feature (rows of the column-major buffers stay in cache; a prefill's columns are thousands
     apart), each row's experts added in expert order as transformers' index_add_ does */
  memset(p->moe, 0, sizeof(float) * H * cols);
  for (int64_t f = 0; f < H; f++) {
    float *out = p->moe + f * cols;
    const float *y = p->expert_out + f * PC;
    for (int64_t e = 0; e < E; e++)
      for (int64_t c = start[e]; c < start[e] + count[e]; c++) out[p->pair_row[c]] += y[c] * p->pair_weight[c];
  }
  if (m->timings) m->timings[T_ROUTING] += now_ns() - t1;
  TIMED(T_ELEMENTWISE, for (int64_t i = 0; i < H * cols; i += VW) VST(p->h + i, VLD(p->h + i) + VLD(p->moe + i)));
}

/* each row's greedy token (the first of its largest logits, as torch.argmax) and its log-softmax, which is
   -log(sum(exp(logits - max))): what sampling.py computes for greedy rows, without a pass per op */
static void greedy(const Model *m, const float *logits, int rows, int64_t *tokens, float *logprobs) {
  const int64_t V = m->vocab;
  for (int64_t r = 0; r < rows; r++) {
    const float *x = logits + r * V;
    float mx = x[0], sum = 0.f;
    for (int64_t v = 1; v < V; v++) mx = x[v] > mx ? x[v] : mx;
    int64_t arg = 0;
    while (arg < V - 1 && x[arg] != mx) arg++; /* bounded: NaN logits compare unequal to anything */
    for (int64_t v = 0; v < V; v++) sum += expf(x[v] - mx);
    tokens[r] = arg;
    logprobs[r] = -logf(sum);
  }
}

/* Floats of scratch memory a step of `rows` rows (logits for `out_rows` of them) needs. */
int64_t tidal_step_scratch_floats(const Model *m, int rows, int out_rows) { return plan(m, rows, out_rows, NULL).total; }

/* One forward step: rows r = 0..rows-1 hold token ids[r] at positions[r] of KV slot slots[r] (slots NULL:
   slot r). Every row's key and value are written first, then each row attends its slot's keys
   0..positions[r] (a prefill passes a prompt's tokens as rows of one slot). Logits of rows out[i]
   (out NULL: every row) go to logits[i, :vocab]. Returns 0; or -1 for a shape it does not handle, -2 for
   too little scratch, -3..-6 for a token id, position, slot or output row out of range. */
int tidal_forward_step(const Model *m, int rows, const int64_t *ids, const int64_t *positions,
                       const int64_t *slots, int out_rows, const int64_t *out, float *logits,
                       int64_t *greedy_tokens, float *greedy_logprobs, float *scratch,
                       int64_t scratch_floats) {
  const int64_t D = m->head_dim, H = m->hidden;
  if (D != 16 && D != 32 && D != 64 && D != 128 && D != 256) return -1;
  if (m->experts > 1024 || m->heads % m->kv_heads) return -1;
  Plan p = plan(m, rows, out_rows, scratch);
  if (p.total > scratch_floats) return -2;
  for (int r = 0; r < rows; r++) {
    if (ids[r] < 0 || ids[r] >= m->vocab) return -3;
    if (positions[r] < 0 || positions[r] >= m->max_seq_len) return -4;
    if (slots ? slots[r] < 0 || slots[r] >= m->slots : r >= m->slots) return -5;
  }
  for (int i = 0; out && i < out_rows; i++)
    if (out[i] < 0 || out[i] >= rows) return -6;
  const int64_t cols = p.cols;
  TIMED(T_ELEMENTWISE, embed_columns(m, &p, rows, ids, positions));
  const int64_t qkv = (m->heads + 2 * m->kv_heads) * D, qw = m->heads * D;
  for (int64_t l = 0; l < m->layers; l++) {
    const Layer *L = &m->layer[l];
    TIMED(T_ELEMENTWISE, rms_norm_columns(p.h, L->input_norm, p.x, H, cols, m->eps, p.inv));
    TIMED(T_GEMM, gemm(L->qkv, H, p.x, cols, p.qkv, cols, (int)qkv, rows, (int)cols, (int)H, 0, p.few));
    TIMED(T_QK_ROTARY_KV, qk_norm_rotary_store(m, L, &p, rows, positions, slots));
    TIMED(T_ATTENTION, memset(p.attn, 0, sizeof(float) * qw * cols); attention(m, L, &p, rows, positions, slots));
    TIMED(T_GEMM, gemm(L->o_proj, qw, p.attn, cols, p.h, cols, (int)H, rows, (int)cols, (int)qw, 1, p.few));
    TIMED(T_ELEMENTWISE, rms_norm_columns(p.h, L->post_norm, p.x, H, cols, m->eps, p.inv));
    if (L->router) {
      moe(m, L, &p, rows);
    } else {
      const int64_t I = L->intermediate;
      TIMED(T_GEMM, gemm(L->gate_up, H, p.x, cols, p.mlp, cols, (int)(2 * I), rows, (int)cols, (int)H, 0, p.few));
      TIMED(T_ELEMENTWISE, swiglu(p.mlp, p.act, I, cols, 0, cols));
      TIMED(T_GEMM, gemm(L->down, I, p.act, cols, p.h, cols, (int)H, rows, (int)cols, (int)I, 1, p.few));
    }
  }
  /* the final norm and the LM head, for the rows asked */
  const int64_t oc = p.out_cols;
  TIMED(T_ELEMENTWISE, memset(p.head_in, 0, sizeof(float) * H * oc);
        for (int64_t f = 0; f < H; f++) for (int64_t i = 0; i < out_rows; i++)
            p.head_in[f * oc + i] = p.h[f * cols + (out ? out[i] : i)];
        rms_norm_columns(p.head_in, m->final_norm, p.head_in, H, oc, m->eps, p.inv));
  for (int64_t v0 = 0; v0 < m->vocab; v0 += VOCAB_CHUNK) {
    const int64_t n = m->vocab - v0 < VOCAB_CHUNK ? m->vocab - v0 : VOCAB_CHUNK;
    TIMED(T_GEMM, gemm(m->lm_head + v0 * H, H, p.head_in, oc, p.logits_t, oc, (int)n, out_rows, (int)oc, (int)H, 0, p.few));
    TIMED(T_ELEMENTWISE, for (int64_t i = 0; i < out_rows; i++) for (int64_t v = 0; v < n; v++)
                             logits[i * m->vocab + v0 + v] = p.logits_t[v * oc + i]);
  }
  if (greedy_tokens) TIMED(T_GREEDY, greedy(m, logits, out_rows, greedy_tokens, greedy_logprobs));
  return 0;
}
"""
)


class Layer(ctypes.Structure):
    _fields_ = [
        *[
            (name, ctypes.c_void_p)
            for name in (
                "input_norm",
                "post_norm",
                "qkv",
                "q_norm",
                "k_norm",
                "o_proj",
                "gate_up",
                "down",
                "router",
                "experts_gate_up",
                "experts_down",
                "keys",
                "values",
            )
        ],
        ("intermediate", ctypes.c_int64),
    ]


class Model(ctypes.Structure):
    _fields_ = [
        *[
            (name, ctypes.c_int64)
            for name in (
                "layers",
                "hidden",
                "heads",
                "kv_heads",
                "head_dim",
                "experts",
                "top_k",
                "norm_topk",
                "vocab",
                "max_seq_len",
                "slots",
            )
        ],
        ("eps", ctypes.c_float),
        ("scaling", ctypes.c_float),
        *[(name, ctypes.c_void_p) for name in ("embed", "final_norm", "lm_head", "cos", "sin_signed")],
        ("layer", ctypes.POINTER(Layer)),
        ("timings", ctypes.POINTER(ctypes.c_double)),
    ]


# the parts of a step that ``NativeStep.timings`` adds up (the C enum's order)
TIMED_PARTS = ("gemm", "attention", "qk_norm_rotary_kv_write", "moe_routing", "elementwise", "greedy_pick")
