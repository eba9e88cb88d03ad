// Paged decode attention for CPU (fp32): one query token per sequence against its context,
// read straight from the paged KV cache in one pass (no gathered copy).
//
//   q            [B, H, D]          query of each decoding sequence
//   k/v_cache    [KVH, S, D]        S = num_blocks * block_size slots, heads outermost
//   block_tables [B, max_blocks]    int64, block ids of each sequence in order
//   context_lens [B]                int64, tokens to attend to (including the new one)
//   out          [B, H, D]
//
// Work is split over (sequence, kv head); the G = H / KVH query heads that share a kv head
// reuse each K/V row while it is in cache (GQA).
//
// Two paths. With AVX-512, head_dim 64 and G <= 4 (SmolLM2: 9 heads over 3): one pass per
// (sequence, kv head) with an online softmax, 16 positions' scores reduced together and a
// vector exp; short batches cut each context in parts (flash-decoding) so both cores work.
// 1.2-1.6x the two-pass path on the 2-core AVX-512 dev host (benchmarks/NOTES.md, "CPU decode
// attention in one pass"). Otherwise: two passes, scores in a per-task buffer, an exact
// max-subtracted softmax. Both in fp32.
#include <torch/extension.h>
#include <omp.h>
#include <cmath>
#include <algorithm>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "vec_exp.h"

namespace {

// Blocks are scattered in the pool and a block of one head is only block_size * D floats (4 KiB
// for 16 x 64), so the hardware prefetcher restarts at every block: ask for the next one early.
inline void prefetch_next_block(const float* base, const int64_t* table, int64_t t, int64_t L,
                                int64_t block_size, int64_t D) {
#ifdef __AVX512F__
  if (t % block_size != 0) return;
  const int64_t next = t / block_size + 1;
  if (next * block_size >= L) return;
  const char* p = reinterpret_cast<const char*>(base + table[next] * block_size * D);
  for (int64_t off = 0; off < block_size * D * 4; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
#endif
}

// scores[g * L + t] = scale * q_g . K_t for the G query heads of one kv head, t in [0, L).
void qk_scores(const float* q, const float* kbase, const int64_t* table, int64_t block_size,
               int64_t L, int64_t G, int64_t D, float scale, float* scores) {
#ifdef __AVX512F__
  if (D == 64 && G <= 8) {  // q in registers, each K row loaded once for all G heads
    __m512 qv[8][4];
    for (int64_t g = 0; g < G; ++g)
      for (int c = 0; c < 4; ++c) qv[g][c] = _mm512_loadu_ps(q + g * 64 + c * 16);
    for (int64_t t = 0; t < L; ++t) {
      prefetch_next_block(kbase, table, t, L, block_size, 64);
      const float* k = kbase + (table[t / block_size] * block_size + t % block_size) * 64;
      const __m512 k0 = _mm512_loadu_ps(k), k1 = _mm512_loadu_ps(k + 16);
      const __m512 k2 = _mm512_loadu_ps(k + 32), k3 = _mm512_loadu_ps(k + 48);
      for (int64_t g = 0; g < G; ++g) {
        __m512 a = _mm512_mul_ps(qv[g][0], k0);
        __m512 b = _mm512_mul_ps(qv[g][1], k1);
        a = _mm512_fmadd_ps(qv[g][2], k2, a);
        b = _mm512_fmadd_ps(qv[g][3], k3, b);
        scores[g * L + t] = _mm512_reduce_add_ps(_mm512_add_ps(a, b)) * scale;
      }
    }
    return;
  }
#endif
  for (int64_t t = 0; t < L; ++t) {
    const float* k = kbase + (table[t / block_size] * block_size + t % block_size) * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qg[d] * k[d];
      scores[g * L + t] = dot * scale;
    }
  }
}

// out_g = sum_t probs[g * L + t] * V_t for the G query heads of one kv head.
void pv_accumulate(const float* probs, const float* vbase, const int64_t* table,
                   int64_t block_size, int64_t L, int64_t G, int64_t D, float* out) {
#ifdef __AVX512F__
  if (D == 64 && G <= 6) {  // G x 4 accumulators stay in registers over the whole context
    __m512 acc[6][4];
    for (int64_t g = 0; g < G; ++g)
      for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < L; ++t) {
      prefetch_next_block(vbase, table, t, L, block_size, 64);
      const float* v = vbase + (table[t / block_size] * block_size + t % block_size) * 64;
      const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
      const __m512 v2 = _mm512_loadu_ps(v + 32), v3 = _mm512_loadu_ps(v + 48);
      for (int64_t g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(probs[g * L + t]);
        acc[g][0] = _mm512_fmadd_ps(p, v0, acc[g][0]);
        acc[g][1] = _mm512_fmadd_ps(p, v1, acc[g][1]);
        acc[g][2] = _mm512_fmadd_ps(p, v2, acc[g][2]);
        acc[g][3] = _mm512_fmadd_ps(p, v3, acc[g][3]);
      }
    }
    for (int64_t g = 0; g < G; ++g)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out + g * 64 + c * 16, acc[g][c]);
    return;
  }
#endif
  std::fill(out, out + G * D, 0.f);
  for (int64_t t = 0; t < L; ++t) {
    const float* v = vbase + (table[t / block_size] * block_size + t % block_size) * D;
    for (int64_t g = 0; g < G; ++g) {
      const float p = probs[g * L + t];
      float* a = out + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
    }
  }
}

void softmax_rows(float* scores, int64_t G, int64_t L) {
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * L;
    float mx = s[0];
    for (int64_t t = 1; t < L; ++t) mx = s[t] > mx ? s[t] : mx;
    float sum = 0.f;
    for (int64_t t = 0; t < L; ++t) {
      s[t] = std::exp(s[t] - mx);
      sum += s[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < L; ++t) s[t] *= inv;
  }
}


#ifdef __AVX512F__
// Sixteen 16-lane vectors in, one vector of their sixteen lane sums out (lane t = sum of v[t]):
// a transpose-and-add tree, 15 adds where sixteen horizontal reductions would take ~64 steps.
inline __m512 sum16(__m512 v[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // pairs: lanes of 2i and 2i+1 interleaved by 32-bit words
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // 64-bit words: four tokens per 128-bit lane
    b[i] = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1]))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1]))));
  for (int i = 0; i < 2; ++i)  // 128-bit lanes: eight tokens per 256 bits
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  // c[0] holds tokens {0,1,2,3 | 4,5,6,7 | 0,1,2,3 | 4,5,6,7} partials, c[1] the same for 8-15
  const __m512 lo = _mm512_shuffle_f32x4(c[0], c[1], 0x88);
  const __m512 hi = _mm512_shuffle_f32x4(c[0], c[1], 0xDD);
  return _mm512_add_ps(lo, hi);
}

// The D = 64, G <= 4 path: one pass over context positions [begin, end) of one kv head, each
// 16 positions' scores at once (``sum16``), an online softmax (a running max ``m`` and sum ``l``
// per query head, rescaled as the max grows: flash-decoding's), and the weighted V rows.
// Writes the G unnormalised rows to ``acc_out`` [G, 64] and each head's max and sum to
// ``m_out`` and ``l_out``: ``merge_splits`` combines the parts of a split context.
void attend_d64(const float* q, const float* kbase, const float* vbase, const int64_t* table,
                int64_t block_size, int64_t begin, int64_t end, int64_t G, float scale,
                float* acc_out, float* m_out, float* l_out) {
  __m512 qv[4][4], acc[4][4];
  float m[4], l[4];
  alignas(64) float probs[4][16];
  for (int64_t g = 0; g < G; ++g) {
    for (int c = 0; c < 4; ++c) {
      qv[g][c] = _mm512_loadu_ps(q + g * 64 + c * 16);
      acc[g][c] = _mm512_setzero_ps();
    }
    m[g] = -INFINITY;
    l[g] = 0.f;
  }
  for (int64_t t0 = begin; t0 < end;) {
    // up to 16 positions, all in one block
    const int64_t in_block = t0 % block_size;
    const int64_t n = std::min<int64_t>({16, end - t0, block_size - in_block});
    const __mmask16 live = static_cast<__mmask16>((1u << n) - 1u);
    const int64_t slot = table[t0 / block_size] * block_size + in_block;
    const float* kb = kbase + slot * 64;
    const float* vb = vbase + slot * 64;
    for (int64_t g = 0; g < G; ++g) {
      __m512 dots[16];
      for (int64_t t = 0; t < 16; ++t) {
        if (t >= n) {
          dots[t] = _mm512_setzero_ps();
          continue;
        }
        const float* k = kb + t * 64;
        __m512 x = _mm512_mul_ps(qv[g][0], _mm512_loadu_ps(k));
        __m512 y = _mm512_mul_ps(qv[g][1], _mm512_loadu_ps(k + 16));
        x = _mm512_fmadd_ps(qv[g][2], _mm512_loadu_ps(k + 32), x);
        y = _mm512_fmadd_ps(qv[g][3], _mm512_loadu_ps(k + 48), y);
        dots[t] = _mm512_add_ps(x, y);
      }
      const __m512 sc = _mm512_mul_ps(sum16(dots), _mm512_set1_ps(scale));
      const float m_new = std::max(m[g], _mm512_mask_reduce_max_ps(live, sc));
      const float alpha = std::exp(m[g] - m_new);  // 0 on the first positions (m = -inf)
      const __m512 pr =
          _mm512_maskz_mov_ps(live, exp_ps(_mm512_sub_ps(sc, _mm512_set1_ps(m_new)), -87.f));
      l[g] = l[g] * alpha + _mm512_reduce_add_ps(pr);
      m[g] = m_new;
      if (alpha != 1.f) {
        const __m512 av = _mm512_set1_ps(alpha);
        for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_mul_ps(acc[g][c], av);
      }
      _mm512_store_ps(probs[g], pr);
    }
    for (int64_t t = 0; t < n; ++t) {
      const float* v = vb + t * 64;
      const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
      const __m512 v2 = _mm512_loadu_ps(v + 32), v3 = _mm512_loadu_ps(v + 48);
      for (int64_t g = 0; g < G; ++g) {
        const __m512 pt = _mm512_set1_ps(probs[g][t]);
        acc[g][0] = _mm512_fmadd_ps(pt, v0, acc[g][0]);
        acc[g][1] = _mm512_fmadd_ps(pt, v1, acc[g][1]);
        acc[g][2] = _mm512_fmadd_ps(pt, v2, acc[g][2]);
        acc[g][3] = _mm512_fmadd_ps(pt, v3, acc[g][3]);
      }
    }
    t0 += n;
  }
  for (int64_t g = 0; g < G; ++g) {
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc_out + g * 64 + c * 16, acc[g][c]);
    m_out[g] = m[g];
    l_out[g] = l[g];
  }
}

// out[g] = sum over parts of e^(m_p - M) acc_p[g] / sum over parts of e^(m_p - M) l_p, M the
// parts' largest max: the parts of one kv head's context put back together.
void merge_splits(const float* acc, const float* m, const float* l, int64_t parts, int64_t G,
                  float* out) {
  for (int64_t g = 0; g < G; ++g) {
    float mx = -INFINITY;
    for (int64_t p = 0; p < parts; ++p) mx = std::max(mx, m[p * G + g]);
    __m512 o[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
    float denom = 0.f;
    for (int64_t p = 0; p < parts; ++p) {
      if (l[p * G + g] == 0.f) continue;  // an empty part
      const float w = std::exp(m[p * G + g] - mx);
      denom += w * l[p * G + g];
      const __m512 wv = _mm512_set1_ps(w);
      const float* a = acc + (p * G + g) * 64;
      for (int c = 0; c < 4; ++c) o[c] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(a + c * 16), o[c]);
    }
    const __m512 inv = _mm512_set1_ps(1.f / denom);
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out + g * 64 + c * 16, _mm512_mul_ps(o[c], inv));
  }
}
#endif

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     int64_t block_size, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32 &&
              v_cache.dtype() == torch::kFloat32, "paged_decode_attention: fp32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              block_tables.is_contiguous() && context_lens.is_contiguous(),
              "paged_decode_attention: inputs must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(0), S = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D && H % KVH == 0, "paged_decode_attention: bad shapes");
  const int64_t G = H / KVH, max_blocks = block_tables.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && (lens[b] + block_size - 1) / block_size <= max_blocks,
                "paged_decode_attention: context length exceeds the block table");
  }

#ifdef __AVX512F__
  if (D == 64 && G <= 4) {
    // Fewer (sequence, kv head) pairs than twice the threads (decode at batch 1-2): each
    // context is cut in ``parts`` of at least 256 positions, computed apart and merged, so
    // every thread has work.
    const int64_t threads = omp_get_max_threads();
    int64_t parts = 1;
    int64_t longest = 0;
    for (int64_t b = 0; b < B; ++b) longest = std::max(longest, lens[b]);
    if (B * KVH < 2 * threads)
      parts = std::max<int64_t>(1, std::min((2 * threads + B * KVH - 1) / (B * KVH), longest / 256));
    std::vector<float> acc(B * KVH * parts * G * 64), mx(B * KVH * parts * G), sm(B * KVH * parts * G);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < B * KVH * parts; ++task) {
      const int64_t pair = task / parts, part = task % parts;
      const int64_t b = pair / KVH, kvh = pair % KVH;
      const int64_t L = lens[b], chunk = (L + parts - 1) / parts;
      const int64_t begin = std::min(L, part * chunk), end = std::min(L, begin + chunk);
      attend_d64(qp + (b * H + kvh * G) * D, kp + kvh * S * D, vp + kvh * S * D,
                 tables + b * max_blocks, block_size, begin, end, G, sc,
                 acc.data() + task * G * 64, mx.data() + task * G, sm.data() + task * G);
    }
#pragma omp parallel for schedule(static) if (B * KVH > 64)
    for (int64_t pair = 0; pair < B * KVH; ++pair) {
      const int64_t b = pair / KVH, kvh = pair % KVH;
      merge_splits(acc.data() + pair * parts * G * 64, mx.data() + pair * parts * G,
                   sm.data() + pair * parts * G, parts, G, op + (b * H + kvh * G) * D);
    }
    return out;
  }
#endif
  // Contexts differ in length (the engine even sorts decodes by it), so tasks are handed out
  // dynamically (guided): a static split gave one thread all the long ones (mixed workload:
  // 70 -> 42 ms of attention per decode step).
  std::vector<float> scratch;
#pragma omp parallel private(scratch)
  {
#pragma omp for schedule(guided)
    for (int64_t task = 0; task < B * KVH; ++task) {
      const int64_t b = task / KVH, kvh = task % KVH;
      const int64_t L = lens[b];
      scratch.resize(G * L);
      const int64_t* table = tables + b * max_blocks;
      const int64_t head = b * H + kvh * G;
      qk_scores(qp + head * D, kp + kvh * S * D, table, block_size, L, G, D, sc, scratch.data());
      softmax_rows(scratch.data(), G, L);
      pv_accumulate(scratch.data(), vp + kvh * S * D, table, block_size, L, G, D, op + head * D);
    }
  }
  return out;
}
