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
// reuse each K/V row while it is in cache (GQA). Scores are kept in a small per-task buffer,
// softmax is exact (max-subtracted, fp32).
#include <torch/extension.h>
#include <omp.h>
#include <cmath>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "paged decode attention over a [KVH, slots, D] cache (CPU, fp32)");
}
