// Causal prefill attention for CPU (fp32), flash style: one sequence's new tokens against its
// keys, the scores of a tile never leaving the cache.
//
//   q    [n, H, D]          the chunk's queries, at positions start .. start + n - 1
//   k/v  [KVH, L, D]        L >= start + n keys (the cached prefix, then the chunk's own)
//   out  [n, H, D]          written in place
//
// Any strides, the last dimension contiguous. A task is (kv head, up to 4 of its query heads,
// 16 query positions): its queries are held transposed, 16 positions to a vector, so the scores
// of a key against all of them are one vector (keys along rows, queries along lanes) and the
// online softmax's max, sum and rescale are lane-wise. Keys come in blocks of 64:
//   S^T = K_blk Q^T   (a key's element broadcast against the queries' vectors)
//   P^T = exp(S^T - m), masked causally on the diagonal blocks, m and l updated per lane
//   O  += P V_blk     (a probability broadcast against a V row's vectors)
// Torch's own CPU flash kernel runs SmolLM2's prefill attention (head_dim 64, 9 heads over 3) at
// 76-140 GFLOP/s on the 2-core AVX-512 dev host, against ~460 for its linears; see
// benchmarks/NOTES.md ("prefill attention"). AVX-512 with head_dim 16, 32, 64 or 128 only:
// ``prefill_attention_supported`` says whether this build and shape can run it, and callers use
// torch's SDPA otherwise.
#include <torch/extension.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "vec_exp.h"

namespace {

#ifdef __AVX512F__
constexpr int BQ = 16;  // query positions of a task: one vector's lanes
constexpr int BK = 64;  // keys per block

struct Strides {
  int64_t q_pos, q_head, k_pos, v_pos, o_pos, o_head;
};

// s[j * M + lane] = sum_d k[j][d] * qT[d][lane] for JB keys (M = NV * 16 lanes).
template <int NV, int JB>
inline void qk_tile(const float* qT, const float* k, int64_t k_pos, int D, float* s) {
  constexpr int M = NV * BQ;
  __m512 acc[JB][NV];
#pragma GCC unroll 16
  for (int j = 0; j < JB; ++j)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[j][v] = _mm512_setzero_ps();
  for (int d = 0; d < D; ++d) {
    __m512 qv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) qv[v] = _mm512_load_ps(qT + d * M + v * BQ);
#pragma GCC unroll 16
    for (int j = 0; j < JB; ++j) {
      const __m512 kb = _mm512_set1_ps(k[j * k_pos + d]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[j][v] = _mm512_fmadd_ps(kb, qv[v], acc[j][v]);
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < JB; ++j)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) _mm512_store_ps(s + j * M + v * BQ, acc[j][v]);
}

// o[r][:] += sum_j s[j * M + r] * v[j][:] for R rows from r0 (D = DV * 16).
template <int DV, int R>
inline void pv_tile(const float* s, int M, int r0, const float* v, int64_t v_pos, int nk,
                    float* o) {
  constexpr int D = DV * 16;
  __m512 acc[R][DV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_load_ps(o + (r0 + r) * D + c * 16);
  for (int j = 0; j < nk; ++j) {
    __m512 vv[DV];
#pragma GCC unroll 8
    for (int c = 0; c < DV; ++c) vv[c] = _mm512_loadu_ps(v + j * v_pos + c * 16);
    const float* pj = s + j * M + r0;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 p = _mm512_set1_ps(pj[r]);
#pragma GCC unroll 8
      for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_fmadd_ps(p, vv[c], acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < DV; ++c) _mm512_store_ps(o + (r0 + r) * D + c * 16, acc[r][c]);
}

// One task: NV query heads (of one kv head) x nt <= 16 positions starting at absolute position
// qpos0, against keys [0, qpos0 + nt). q and out point at the task's first head and position.
template <int NV, int DV>
void attend_tile(const float* q, const float* k, const float* v, float* out, const Strides& st,
                 int nt, int64_t qpos0, float scale) {
  constexpr int D = DV * 16, M = NV * BQ;
  constexpr int JB = NV == 1 ? 16 : NV == 2 ? 12 : NV == 3 ? 8 : 6;
  constexpr int R = DV == 1 ? 8 : DV == 2 ? 8 : DV == 4 ? 4 : 2;  // divides 16: no remainder
  alignas(64) float qT[D * M];
  alignas(64) float s[BK * M];
  alignas(64) float o[M * D];
  alignas(64) float alpha[M];
  for (int d = 0; d < D; ++d)
    for (int h = 0; h < NV; ++h)
      for (int i = 0; i < BQ; ++i)
        qT[d * M + h * BQ + i] = i < nt ? q[i * st.q_pos + h * st.q_head + d] * scale : 0.0f;
  std::fill(o, o + M * D, 0.0f);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __m512 m[NV], l[NV];
  for (int h = 0; h < NV; ++h) m[h] = neg_inf, l[h] = _mm512_setzero_ps();
  const int64_t kend = qpos0 + nt;
  for (int64_t j0 = 0; j0 < kend; j0 += BK) {
    const int nk = static_cast<int>(std::min<int64_t>(BK, kend - j0));
    const float* kb = k + j0 * st.k_pos;
    int j = 0;
    for (; j + JB <= nk; j += JB) qk_tile<NV, JB>(qT, kb + j * st.k_pos, st.k_pos, D, s + j * M);
    for (; j < nk; ++j) qk_tile<NV, 1>(qT, kb + j * st.k_pos, st.k_pos, D, s + j * M);
    // key j0 + j is seen by lane i iff j0 + j <= qpos0 + i: only blocks past qpos0 mask
    const bool diagonal = j0 + nk - 1 > qpos0;
    __m512 bm[NV];
    for (int h = 0; h < NV; ++h) bm[h] = neg_inf;
    for (j = 0; j < nk; ++j) {
      const __mmask16 seen =
          diagonal ? _mm512_cmp_epi32_mask(lane, _mm512_set1_epi32(static_cast<int>(j0 + j - qpos0)),
                                           _MM_CMPINT_NLT)
                   : static_cast<__mmask16>(0xFFFF);
      for (int h = 0; h < NV; ++h) {
        float* row = s + j * M + h * BQ;
        const __m512 x = _mm512_mask_blend_ps(seen, neg_inf, _mm512_load_ps(row));
        _mm512_store_ps(row, x);
        bm[h] = _mm512_max_ps(bm[h], x);
      }
    }
    __m512 rs[NV];
    for (int h = 0; h < NV; ++h) {
      const __m512 mnew = _mm512_max_ps(m[h], bm[h]);  // finite: key 0 is seen by every lane
      _mm512_store_ps(alpha + h * BQ, exp_ps(_mm512_sub_ps(m[h], mnew), -87.0f));
      m[h] = mnew;
      rs[h] = _mm512_setzero_ps();
    }
    for (j = 0; j < nk; ++j) {
      for (int h = 0; h < NV; ++h) {
        float* row = s + j * M + h * BQ;
        const __m512 x = _mm512_load_ps(row);
        // a masked score is -inf: its probability is exactly 0, not the clamp's e^-87
        const __mmask16 seen = _mm512_cmp_ps_mask(x, neg_inf, _CMP_NEQ_OQ);
        const __m512 p = _mm512_maskz_mov_ps(seen, exp_ps(_mm512_sub_ps(x, m[h]), -87.0f));
        _mm512_store_ps(row, p);
        rs[h] = _mm512_add_ps(rs[h], p);
      }
    }
    for (int h = 0; h < NV; ++h)
      l[h] = _mm512_fmadd_ps(l[h], _mm512_load_ps(alpha + h * BQ), rs[h]);
    if (j0 > 0) {
      for (int r = 0; r < M; ++r) {
        if (alpha[r] == 1.0f) continue;
        const __m512 a = _mm512_set1_ps(alpha[r]);
        for (int c = 0; c < DV; ++c)
          _mm512_store_ps(o + r * D + c * 16, _mm512_mul_ps(a, _mm512_load_ps(o + r * D + c * 16)));
      }
    }
    const float* vb = v + j0 * st.v_pos;
    for (int r0 = 0; r0 < M; r0 += R) pv_tile<DV, R>(s, M, r0, vb, st.v_pos, nk, o);
  }
  alignas(64) float inv[M];
  for (int h = 0; h < NV; ++h)
    _mm512_store_ps(inv + h * BQ, _mm512_div_ps(_mm512_set1_ps(1.0f), l[h]));
  for (int h = 0; h < NV; ++h)
    for (int i = 0; i < nt; ++i) {
      const int r = h * BQ + i;
      const __m512 a = _mm512_set1_ps(inv[r]);
      float* dst = out + i * st.o_pos + h * st.o_head;
      for (int c = 0; c < DV; ++c)
        _mm512_storeu_ps(dst + c * 16, _mm512_mul_ps(a, _mm512_load_ps(o + r * D + c * 16)));
    }
}

using TileFn = void (*)(const float*, const float*, const float*, float*, const Strides&, int,
                        int64_t, float);

template <int NV>
TileFn tile_for_dv(int64_t dv) {
  switch (dv) {
    case 1: return attend_tile<NV, 1>;
    case 2: return attend_tile<NV, 2>;
    case 4: return attend_tile<NV, 4>;
    case 8: return attend_tile<NV, 8>;
    default: return nullptr;
  }
}

TileFn tile_for(int64_t nv, int64_t dv) {
  switch (nv) {
    case 1: return tile_for_dv<1>(dv);
    case 2: return tile_for_dv<2>(dv);
    case 3: return tile_for_dv<3>(dv);
    case 4: return tile_for_dv<4>(dv);
    default: return nullptr;
  }
}
#endif

}  // namespace

bool prefill_attention_supported(int64_t head_dim) {
#ifdef __AVX512F__
  return head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128;
#else
  (void)head_dim;
  return false;
#endif
}

void prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t start,
                       double scale, torch::Tensor out) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k.dtype() == torch::kFloat32 &&
              v.dtype() == torch::kFloat32 && out.dtype() == torch::kFloat32,
              "prefill_attention: fp32 only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.dim() == 3,
              "prefill_attention: q, out [n, H, D]; k, v [KVH, L, D]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && out.stride(2) == 1,
              "prefill_attention: the last dimension must be contiguous");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(0);
  TORCH_CHECK(out.sizes() == q.sizes() && v.sizes() == k.sizes() && k.size(2) == D &&
              H % KVH == 0 && start >= 0 && k.size(1) >= start + n,
              "prefill_attention: bad shapes");
  TORCH_CHECK(prefill_attention_supported(D), "prefill_attention: unsupported head_dim ", D);
#ifdef __AVX512F__
  if (n == 0) return;
  const int64_t G = H / KVH, groups = (G + 3) / 4, blocks = (n + BQ - 1) / BQ;
  const Strides st{q.stride(0), q.stride(1), k.stride(1), v.stride(1), out.stride(0),
                   out.stride(1)};
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t tasks = KVH * groups * blocks;
  // the last query blocks see the most keys: handed out first
#pragma omp parallel for schedule(dynamic, 1) if (tasks > 1)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t qb = blocks - 1 - t / (KVH * groups), rest = t % (KVH * groups);
    const int64_t kvh = rest / groups, grp = rest % groups;
    const int64_t g0 = grp * 4, nv = std::min<int64_t>(4, G - g0);
    const int64_t t0 = qb * BQ, head = kvh * G + g0;
    const int nt = static_cast<int>(std::min<int64_t>(BQ, n - t0));
    tile_for(nv, D / 16)(qp + t0 * st.q_pos + head * st.q_head, kp + kvh * k.stride(0),
                         vp + kvh * v.stride(0), op + t0 * st.o_pos + head * st.o_head, st, nt,
                         start + t0, sc);
  }
#endif
}
