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
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

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

  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, kvh = task % KVH;
      const int64_t L = lens[b];
      TORCH_CHECK(L >= 1 && (L + block_size - 1) / block_size <= max_blocks,
                  "paged_decode_attention: context length exceeds the block table");
      scores.assign(G * L, 0.f);
      const float* qrow = qp + (b * H + kvh * G) * D;
      const float* kbase = kp + kvh * S * D;
      const float* vbase = vp + kvh * S * D;
      const int64_t* table = tables + b * max_blocks;
      for (int64_t t = 0; t < L; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const float* krow = kbase + slot * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qrow + g * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * krow[d];
          scores[g * L + t] = dot * sc;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * L;
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
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const float* vrow = vbase + slot * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + t];
          float* a = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += p * vrow[d];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* o = op + (b * H + kvh * G + g) * D;
        std::copy(acc.begin() + g * D, acc.begin() + (g + 1) * D, o);
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "paged decode attention over a [KVH, slots, D] cache (CPU, fp32)");
}
