// The decoder's elementwise layers for CPU (fp32), each one pass over its rows instead of the
// four to six torch ops (and as many temporaries) of engine/ops.py's TorchOps:
//
//   rms_norm(x, w, eps)                     w * (x * rsqrt(mean(x^2) + eps))
//   add_rms_norm(x, residual, w, eps)       residual += x (in place), then rms_norm(residual)
//   rotary(q, k, positions, cos, sin)       in place, HF Llama's rotate-half convention
//   silu_and_mul(x)                         silu(x[:, :I]) * x[:, I:]
//
// Rows (tokens) are spread over OpenMP threads when there are enough of them to pay for it.
// The rotary is bit-identical to TorchOps (each product and the sum rounded as torch rounds
// them: built with -ffp-contract=off); the norm's sum of squares is in double and SiLU's e^x is
// a polynomial, so those two agree with torch to a few ulps, not bit for bit.
#include <torch/extension.h>
#include <omp.h>
#include <cmath>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "vec_exp.h"

namespace {

constexpr int64_t kParallelRows = 16;  // fewer rows than this run on the calling thread

inline void check_rows(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.dtype() == torch::kFloat32, what, ": fp32 only");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, what, ": a 2-D tensor with contiguous rows");
}

// One row: out = w * (x * r), r = 1 / sqrt(sum(x^2) / n + eps), the sum in double.
inline void norm_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  double ss = 0.0;
  int64_t i = 0;
#ifdef __AVX512F__
  __m512d acc0 = _mm512_setzero_pd(), acc1 = _mm512_setzero_pd();
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m512 sq = _mm512_mul_ps(v, v);  // each square rounded to fp32, as x.pow(2) does
    acc0 = _mm512_add_pd(acc0, _mm512_cvtps_pd(_mm512_castps512_ps256(sq)));
    acc1 = _mm512_add_pd(acc1, _mm512_cvtps_pd(_mm512_extractf32x8_ps(sq, 1)));
  }
  ss = _mm512_reduce_add_pd(_mm512_add_pd(acc0, acc1));
#endif
  for (; i < n; ++i) {
    const float sq = x[i] * x[i];
    ss += sq;
  }
  const float mean = static_cast<float>(ss / static_cast<double>(n));
  const float r = 1.f / std::sqrt(mean + eps);
  i = 0;
#ifdef __AVX512F__
  const __m512 rv = _mm512_set1_ps(r);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i,
                     _mm512_mul_ps(_mm512_loadu_ps(w + i), _mm512_mul_ps(_mm512_loadu_ps(x + i), rv)));
#endif
  for (; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "rms_norm: weight shape");
  const int64_t rows = x.size(0), n = x.size(1), ld = x.stride(0);
  auto out = torch::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
#pragma omp parallel for schedule(static) if (rows >= kParallelRows)
  for (int64_t r = 0; r < rows; ++r) norm_row(xp + r * ld, wp, op + r * n, n, static_cast<float>(eps));
  return out;
}

// residual += x (each sum rounded to fp32, as ``x + residual``); returns rms_norm(residual).
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                           double eps) {
  check_rows(x, "add_rms_norm");
  check_rows(residual, "add_rms_norm");
  TORCH_CHECK(x.sizes() == residual.sizes(), "add_rms_norm: x and residual differ in shape");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "add_rms_norm: weight shape");
  const int64_t rows = x.size(0), n = x.size(1), ldx = x.stride(0), ldr = residual.stride(0);
  auto out = torch::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
#pragma omp parallel for schedule(static) if (rows >= kParallelRows)
  for (int64_t r = 0; r < rows; ++r) {
    float* res = rp + r * ldr;
    const float* xr = xp + r * ldx;
    for (int64_t i = 0; i < n; ++i) res[i] = xr[i] + res[i];
    norm_row(res, wp, op + r * n, n, static_cast<float>(eps));
  }
  return out;
}

// q [T, H, D], k [T, KVH, D] (views of the fused projection: rows strided, heads and elements
// contiguous), rotated in place by position: x * cos + rotate_half(x) * sin, with cos and sin
// [max_positions, D] (both halves equal, as HF builds them).
void rotary(torch::Tensor q, torch::Tensor k, torch::Tensor positions, torch::Tensor cos,
            torch::Tensor sin) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k.dtype() == torch::kFloat32 &&
                  cos.dtype() == torch::kFloat32 && sin.dtype() == torch::kFloat32,
              "rotary: fp32 only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(2) == k.size(2) && q.size(0) == k.size(0),
              "rotary: q [T, H, D] and k [T, KVH, D]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && q.stride(1) == q.size(2) &&
                  k.stride(1) == k.size(2),
              "rotary: heads and elements must be contiguous");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == q.size(2),
              "rotary: cos and sin [positions, D]");
  TORCH_CHECK(positions.dtype() == torch::kInt64 && positions.numel() == q.size(0),
              "rotary: one int64 position per token");
  auto pos = positions.contiguous();
  const int64_t T = q.size(0), H = q.size(1), KVH = k.size(1), D = q.size(2), half = D / 2;
  const int64_t max_pos = cos.size(0);
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < max_pos, "rotary: position out of range");
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t ldq = q.stride(0), ldk = k.stride(0);
#pragma omp parallel for schedule(static) if (T >= kParallelRows)
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cp + pp[t] * D;
    const float* s = sp + pp[t] * D;
    for (int64_t h = 0; h < H + KVH; ++h) {
      float* x = h < H ? qp + t * ldq + h * D : kp + t * ldk + (h - H) * D;
      for (int64_t i = 0; i < half; ++i) {
        const float lo = x[i], hi = x[i + half];
        x[i] = lo * c[i] + (-hi) * s[i];
        x[i + half] = hi * c[i + half] + lo * s[i + half];
      }
    }
  }
}

// x [T, 2I] = [gate | up] -> silu(gate) * up [T, I]; silu(g) = g / (1 + e^-g).
torch::Tensor silu_and_mul(torch::Tensor x) {
  check_rows(x, "silu_and_mul");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: an even last dimension");
  const int64_t rows = x.size(0), inter = x.size(1) / 2, ld = x.stride(0);
  auto out = torch::empty({rows, inter}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
#pragma omp parallel for schedule(static) if (rows >= kParallelRows)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = xp + r * ld;
    const float* u = g + inter;
    float* o = op + r * inter;
    int64_t i = 0;
#ifdef __AVX512F__
    const __m512 one = _mm512_set1_ps(1.f);
    for (; i + 16 <= inter; i += 16) {
      const __m512 gv = _mm512_loadu_ps(g + i);
      const __m512 den = _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv), -103.f));
      _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_div_ps(gv, den), _mm512_loadu_ps(u + i)));
    }
#endif
    for (; i < inter; ++i) o[i] = (g[i] / (1.f + std::exp(-g[i]))) * u[i];
  }
  return out;
}
