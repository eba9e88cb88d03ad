// e^x on 16 fp32 lanes for the native CPU kernels (AVX-512), ~1 ulp: x = n ln2 + r with
// |r| <= ln2 / 2, a degree-6 polynomial for e^r (Cephes' expf coefficients), scaled by 2^n.
// Inputs are clamped to [lowest, 88.7]: the softmax's (x <= 0) at -87, where e^x is ~0 and
// stays a normal float; SiLU's at -103, where it reaches fp32's smallest subnormals.
#pragma once
#ifdef __AVX512F__
#include <immintrin.h>

inline __m512 exp_ps(__m512 x, float lowest) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(lowest)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
#endif
