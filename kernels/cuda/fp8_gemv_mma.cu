// The FP8 GEMV of batch-1..8 decode on tensor cores: y[m] = sx[m] * sw * (Wq @ xq[m]) (+ b),
// x quantized per row (kernels/fp8_gemv_mma.py launches it; NVRTC builds it once per variant). No headers: NVRTC compiles it as it is. Launched with PDL where the GPU
// has it (kernels/pdl.py's rules).
//
// Compile-time variant (-D): WARPS (warps a block, splitting K), UNROLL (128-column tiles a warp
// has in flight per row tile: loaded together, then multiplied; other warps hide the latency),
// RT (row tiles of 16 a block: 1 or 2), GATED (RT = 2: the gate rows r.. and the up rows
// N + r.., out = silu(gate) * up), QUANT_X (1: x in bf16, each block quantizes it into shared
// memory; 0: x already e4m3 with its scales, the B fragments read from global memory, L1-cached:
// at 2-8 rows a block would spend longer quantizing all of x than multiplying its rows).
//
// The product: mma.sync m16n8k32 on e4m3, the weights as A (16 rows x 32 k), x as B (32 k x 8
// columns: the batch rows, columns past M zero), float32 sums. A lane (g = lane / 4, t = lane % 4)
// reads W's rows g and g + 8 at columns 16t.. and 64 + 16t.. of a 128-column tile: four 16-byte
// loads, each instruction covering 64 contiguous bytes of 8 rows (whole sectors), straight from
// the row-major weight (the same tensor torch._scaled_mm reads: no second copy). Those bytes
// fill the A fragments of four MMAs; the MMA's k order is free as long as A and B agree, so B's
// fragments are x's bytes at the same columns: lane (g, t) takes x[g][16t..) and x[g][64 + 16t..).
// On Hopper ptxas runs the e4m3 MMA as f16 HMMAs behind F2FP conversions (two values each):
// about one instruction a weight byte (the Triton GEMV: six).

#ifndef WARPS
#define WARPS 8
#endif
#ifndef UNROLL
#define UNROLL 1
#endif
#ifndef RT
#define RT 1
#endif
#ifndef GATED
#define GATED 0
#endif
#ifndef QUANT_X
#define QUANT_X 1
#endif

#define THREADS (WARPS * 32)
#define MAX_M 8
#define FP8_MAX 448.0f
#define MIN_AMAX 1e-12f

typedef unsigned short bf16_t;

__device__ __forceinline__ float bf16_to_f32(unsigned int h) { return __uint_as_float(h << 16); }

__device__ __forceinline__ unsigned int f32_to_bf16(float f) {  // round to nearest even
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7f800000u) == 0x7f800000u) return (u >> 16) | ((u & 0xffffu) ? 0x40u : 0u);
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

__device__ __forceinline__ float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

// two floats to two e4m3 bytes, lo in the low byte (round to nearest even, saturating)
__device__ __forceinline__ unsigned int e4m3x2(float lo, float hi) {
    unsigned short d;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
    return d;
}

// fp32 division as Triton's `/` compiles (div.full.f32): kernels/fp8_quant.py's scales and e4m3
// values bit for bit, so a row quantized here equals the same row quantized there
__device__ __forceinline__ float div_full(float a, float b) {
    float r;
    asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

__device__ __forceinline__ uint4 load_stream(const unsigned char* p) {  // read once: no L1
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ void mma_e4m3(float* c, unsigned a0, unsigned a1, unsigned a2,
                                         unsigned a3, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// the first weight row of this block's row tile j
__device__ __forceinline__ int tile_row(int j, int n_out) {
#if GATED
    return blockIdx.x * 16 + j * n_out;
#else
    return (blockIdx.x * RT + j) * 16;
#endif
}

// four 16-byte pieces of each row tile at 128-column tile kt: rows g and g + 8, columns 16t..
// and 64 + 16t..
__device__ __forceinline__ void load_tiles(uint4 (&a)[UNROLL][RT][4], const unsigned char* w,
                                           long long stride_wn, int n_out, int kt0, int kts,
                                           int g, int t) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int kt = kt0 + u * WARPS;
#pragma unroll
        for (int j = 0; j < RT; ++j) {
            if (kt < kts) {
                const unsigned char* p =
                    w + (long long)(tile_row(j, n_out) + g) * stride_wn + kt * 128 + 16 * t;
                a[u][j][0] = load_stream(p);
                a[u][j][1] = load_stream(p + 64);
                a[u][j][2] = load_stream(p + 8 * stride_wn);
                a[u][j][3] = load_stream(p + 8 * stride_wn + 64);
            } else {
                a[u][j][0] = a[u][j][1] = a[u][j][2] = a[u][j][3] = make_uint4(0, 0, 0, 0);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
fp8_gemv_mma(const unsigned char* __restrict__ w,  // [N, K] e4m3 (GATED: [2 n_out, K])
             const float* __restrict__ ws,         // [N] per-row scales
             const void* __restrict__ x_in,        // [M, K] bf16 (QUANT_X) or e4m3
             const float* __restrict__ x_scale_in, // [M] (not QUANT_X)
             const bf16_t* __restrict__ bias,      // [N] bf16 or null
             bf16_t* __restrict__ y,               // [M, n_out] bf16
             int m_rows, int n_out, int k, long long stride_xm, long long stride_wn,
             long long stride_ym, long long prefetch_bytes) {
    extern __shared__ __align__(16) unsigned char smem[];
    float* red = reinterpret_cast<float*>(smem);   // [WARPS][RT][128] partial sums
    float* part = red + WARPS * RT * 128;          // [MAX_M][WARPS] partial amax
    float* xscale = part + MAX_M * WARPS;          // [MAX_M]
    unsigned char* xs = reinterpret_cast<unsigned char*>(xscale + MAX_M);  // [M][K + 16] e4m3
    const int xs_stride = k + 16;                  // 16 bytes of pad: conflict-free B reads

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int kts = k >> 7;  // 128-column tiles

    // the first tiles' loads go out first, before the PDL wait (kernels/pdl.py): the weights
    // are no kernel's output; x and y are touched only after it
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    uint4 a[UNROLL][RT][4];
    load_tiles(a, w, stride_wn, n_out, warp, kts, g, t);
    // An experiment, off unless the launcher asks (kernels/fp8_gemv_mma.py L2_PREFETCH_BYTES):
    // the first prefetch_bytes of each of this block's row tiles into L2 while the kernels in
    // front of this one (launched early by PDL) leave HBM idle
    if (prefetch_bytes > 0) {
#pragma unroll
        for (int j = 0; j < RT; ++j) {
            const unsigned char* base = w + (long long)tile_row(j, n_out) * stride_wn;
            for (long long off = 128LL * threadIdx.x; off < prefetch_bytes; off += 128LL * THREADS)
                asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(base + off));
        }
    }
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif

#if QUANT_X
    const bf16_t* x = reinterpret_cast<const bf16_t*>(x_in);
    // x's scale per row: max(amax, MIN_AMAX) / 448, the warps' partial maxima then one pass
    for (int m = 0; m < m_rows; ++m) {
        float amax = 0.0f;
        const bf16_t* row = x + m * stride_xm;
        for (int c = threadIdx.x * 8; c < k; c += THREADS * 8) {
            const uint4 v = *reinterpret_cast<const uint4*>(row + c);
            const unsigned int words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                amax = fmaxf(amax, fabsf(bf16_to_f32(words[i] & 0xffffu)));
                amax = fmaxf(amax, fabsf(bf16_to_f32(words[i] >> 16)));
            }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1)
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
        if (lane == 0) part[m * WARPS + warp] = amax;
    }
    __syncthreads();
    // x / scale in e4m3, eight elements a thread at a time, into shared memory
    const int per_row = k >> 3;
    int m_now = -1;
    float scale = 1.0f;
    for (int i = threadIdx.x; i < m_rows * per_row; i += THREADS) {
        const int m = i / per_row, c = (i - m * per_row) * 8;
        if (m != m_now) {
            float amax = 0.0f;
#pragma unroll
            for (int v = 0; v < WARPS; ++v) amax = fmaxf(amax, part[m * WARPS + v]);
            scale = div_full(fmaxf(amax, MIN_AMAX), FP8_MAX);
            m_now = m;
        }
        const uint4 v = *reinterpret_cast<const uint4*>(x + m * stride_xm + c);
        const unsigned int words[4] = {v.x, v.y, v.z, v.w};
        unsigned int q[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const unsigned int w0 = words[2 * h], w1 = words[2 * h + 1];
            const unsigned int lo = e4m3x2(div_full(bf16_to_f32(w0 & 0xffffu), scale),
                                           div_full(bf16_to_f32(w0 >> 16), scale));
            const unsigned int hi = e4m3x2(div_full(bf16_to_f32(w1 & 0xffffu), scale),
                                           div_full(bf16_to_f32(w1 >> 16), scale));
            q[h] = lo | (hi << 16);
        }
        *reinterpret_cast<uint2*>(xs + m * xs_stride + c) = make_uint2(q[0], q[1]);
    }
    if (threadIdx.x < m_rows) {
        float amax = 0.0f;
        for (int v = 0; v < WARPS; ++v) amax = fmaxf(amax, part[threadIdx.x * WARPS + v]);
        xscale[threadIdx.x] = div_full(fmaxf(amax, MIN_AMAX), FP8_MAX);
    }
    __syncthreads();
    const unsigned char* xrow = xs + g * xs_stride + 16 * t;
#else
    if (threadIdx.x < m_rows) xscale[threadIdx.x] = x_scale_in[threadIdx.x];  // (read after
    // the barrier before the epilogue)
    const unsigned char* xrow =
        reinterpret_cast<const unsigned char*>(x_in) + (long long)g * stride_xm + 16 * t;
#endif

    float acc[RT][4];
#pragma unroll
    for (int j = 0; j < RT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    const bool has_x = g < m_rows;  // B's columns past M stay zero

    for (int kt0 = warp; kt0 < kts; kt0 += WARPS * UNROLL) {
        if (kt0 != warp) load_tiles(a, w, stride_wn, n_out, kt0, kts, g, t);  // (1st: above)
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int kt = kt0 + u * WARPS;
            if (kt >= kts) break;
            uint4 b0 = make_uint4(0, 0, 0, 0), b1 = b0;
            if (has_x) {
                b0 = *reinterpret_cast<const uint4*>(xrow + kt * 128);
                b1 = *reinterpret_cast<const uint4*>(xrow + kt * 128 + 64);
            }
#pragma unroll
            for (int j = 0; j < RT; ++j) {
                const uint4 r0 = a[u][j][0], r1 = a[u][j][1];  // row g
                const uint4 s0 = a[u][j][2], s1 = a[u][j][3];  // row g + 8
                mma_e4m3(acc[j], r0.x, s0.x, r0.y, s0.y, b0.x, b0.y);
                mma_e4m3(acc[j], r0.z, s0.z, r0.w, s0.w, b0.z, b0.w);
                mma_e4m3(acc[j], r1.x, s1.x, r1.y, s1.y, b1.x, b1.y);
                mma_e4m3(acc[j], r1.z, s1.z, r1.w, s1.w, b1.z, b1.w);
            }
        }
    }

    // the warps' partial sums, added in warp order (the same sum every call)
#pragma unroll
    for (int j = 0; j < RT; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) red[(warp * RT + j) * 128 + lane * 4 + i] = acc[j][i];
    __syncthreads();
    const int outs = (GATED ? 1 : RT) * 16 * m_rows;
    for (int e = threadIdx.x; e < outs; e += THREADS) {
        const int j = e / (16 * m_rows), r = (e / m_rows) % 16, n = e % m_rows;
        // C fragment: lane (r % 8) * 4 + n / 2 holds (r, n) at (r / 8) * 2 + n % 2
        const int at = ((r & 7) * 4 + (n >> 1)) * 4 + (r >> 3) * 2 + (n & 1);
        float out[GATED ? 2 : 1];
#pragma unroll
        for (int h = 0; h < (GATED ? 2 : 1); ++h) {
            const int jj = GATED ? h : j;
            float sum = 0.0f;
#pragma unroll
            for (int v = 0; v < WARPS; ++v) sum += red[(v * RT + jj) * 128 + at];
            const int row = tile_row(jj, n_out) + r;
            float val = round_bf16(sum * (xscale[n] * ws[row]));
            if (bias != nullptr) val += bf16_to_f32(bias[row]);
            out[h] = val;
        }
#if GATED
        const float gate = round_bf16(out[0]), up = round_bf16(out[1]);
        const float val = gate / (1.0f + __expf(-gate)) * up;
        y[n * stride_ym + blockIdx.x * 16 + r] = (bf16_t)f32_to_bf16(val);
#else
        y[n * stride_ym + tile_row(j, n_out) + r] = (bf16_t)f32_to_bf16(out[0]);
#endif
    }
}
