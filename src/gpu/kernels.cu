// sluice CUDA kernels. Compiled to PTX (compute_90) by scripts/build-ptx.py; the PTX is committed
// as src/gpu/kernels.ptx and embedded in the binary, so nothing compiles CUDA at run time and the
// crate builds with no CUDA toolkit. The driver JIT-compiles the PTX once (and caches it).
//
// Conventions: activations are f32, row-major; weights stay in their file's quantized layout and
// are dequantized 32 values at a time in registers. Every matrix product is "one warp per output
// row": the warp's lanes take the row's 32-value chunks in turn, so a row is read once per tile of
// up to NT tokens. Tables (IQ2_XXS grid and signs, MXFP4 values) are filled by the host at load.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define INFINITY __int_as_float(0x7f800000)

// Programmatic dependent launch (sm_90): the kernels the driver launches with the PDL attribute
// (driver.rs `pdl_kernel`: the decode step's) may start while the kernel before them still runs.
// Each calls pdl_wait() before it reads anything an earlier kernel wrote and before it writes
// anything (only L2 prefetches of weights go before it; every thread waits, so a kernel never
// completes before the one it follows), then pdl_go(), which lets the next kernel's blocks start
// their own prologue. Both are no-ops in a launch without the attribute.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_go() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
// A hint: the warp sends `bytes` bytes from `p` on their way to L2 (a 128-byte line per lane).
__device__ __forceinline__ void prefetch_l2(const void* p, long long bytes) {
    const char* c = (const char*)p;
    for (long long o = 128 * (threadIdx.x & 31); o < bytes; o += 32 * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(c + o));
}
// 1 when the driver launches the pdl kernels with PDL (driver.rs sets it at load): the
// prefetches that only pay while the kernel before still runs are skipped otherwise, so the
// default path runs session 26's instructions.
__constant__ int pdl_on;
__device__ __forceinline__ void prefetch_l2_pdl(const void* p, long long bytes) {
    if (pdl_on) prefetch_l2(p, bytes);
}
#define NT 4      // tokens per pass of a matrix-product warp
#define WARPS 8   // warps (rows) per block of a matrix product

__device__ u64 iq2xxs_grid[256];
__device__ u8 ksigns_iq2xs[128];
__device__ i8 mxfp4_values[16];

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
// x rounded to the nearest f16 (ties to even) and widened back: an f16 KV cache's element
// (-ctk/-ctv f16), bit for bit as the CPU's cache stores it.
__device__ __forceinline__ float f16r(float x) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h2f(h);
}
__device__ __forceinline__ u16 f2h(float x) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
// Stores element i of a cache row: f32 (h16 0), f32 rounded to f16 (1) or f16 storage (2).
__device__ __forceinline__ void cache_put(void* row, int i, float v, int h16) {
    if (h16 == 2)
        ((u16*)row)[i] = f2h(v);
    else
        ((float*)row)[i] = h16 ? f16r(v) : v;
}
__device__ __forceinline__ u16 ld16(const u8* p) { return (u16)(p[0] | (p[1] << 8)); }
__device__ __forceinline__ u32 ld32(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}

// Each type: BE values and BB bytes per block; deq32 writes the `sub`-th 32 values of a block.
// `valid` < 32 only for the float types' last chunk of a row whose length is not a multiple of 32.
struct TF32 {
    enum { BE = 32, BB = 128 };
    static __device__ __forceinline__ void deq32(const u8* b, int, int valid, float* v) {
        const float* p = (const float*)b;
#pragma unroll
        for (int i = 0; i < 32; i++) v[i] = i < valid ? p[i] : 0.f;
    }
};
struct TF16 {
    enum { BE = 32, BB = 64 };
    static __device__ __forceinline__ void deq32(const u8* b, int, int valid, float* v) {
        const u16* p = (const u16*)b;
#pragma unroll
        for (int i = 0; i < 32; i++) v[i] = i < valid ? h2f(p[i]) : 0.f;
    }
};
struct TBF16 {
    enum { BE = 32, BB = 64 };
    static __device__ __forceinline__ void deq32(const u8* b, int, int valid, float* v) {
        const u16* p = (const u16*)b;
#pragma unroll
        for (int i = 0; i < 32; i++) v[i] = i < valid ? __uint_as_float(((u32)p[i]) << 16) : 0.f;
    }
};
struct TQ8_0 {
    enum { BE = 32, BB = 34 };
    static __device__ __forceinline__ void deq32(const u8* b, int, int, float* v) {
        float d = h2f(ld16(b));
#pragma unroll
        for (int i = 0; i < 32; i++) v[i] = (float)(i8)b[2 + i] * d;
    }
};
struct TQ4_0 {
    enum { BE = 32, BB = 18 };
    static __device__ __forceinline__ void deq32(const u8* b, int, int, float* v) {
        float d = h2f(ld16(b));
#pragma unroll
        for (int i = 0; i < 16; i++) {
            u8 q = b[2 + i];
            v[i] = d * (float)((int)(q & 15) - 8);
            v[i + 16] = d * (float)((int)(q >> 4) - 8);
        }
    }
};
// Q4_K / Q5_K 6-bit scale and min of sub-block j.
__device__ __forceinline__ void k_scale_min(const u8* s, int j, int& sc, int& m) {
    if (j < 4) {
        sc = s[j] & 63;
        m = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}
struct TQ4_K {
    enum { BE = 256, BB = 144 };
    static __device__ __forceinline__ void deq32(const u8* b, int j, int, float* v) {
        float d = h2f(ld16(b)), dmin = h2f(ld16(b + 2));
        int sc, m;
        k_scale_min(b + 4, j, sc, m);
        float dj = d * (float)sc, mj = dmin * (float)m;
        const u8* q = b + 16 + 32 * (j / 2);
        int shift = 4 * (j % 2);
#pragma unroll
        for (int l = 0; l < 32; l++) v[l] = dj * (float)((q[l] >> shift) & 15) - mj;
    }
};
struct TQ5_K {
    enum { BE = 256, BB = 176 };
    static __device__ __forceinline__ void deq32(const u8* b, int j, int, float* v) {
        float d = h2f(ld16(b)), dmin = h2f(ld16(b + 2));
        int sc, m;
        k_scale_min(b + 4, j, sc, m);
        float dj = d * (float)sc, mj = dmin * (float)m;
        const u8* qh = b + 16;
        const u8* q = b + 48 + 32 * (j / 2);
        int shift = 4 * (j % 2);
#pragma unroll
        for (int l = 0; l < 32; l++) {
            int c = ((q[l] >> shift) & 15) | (((qh[l] >> j) & 1) << 4);
            v[l] = dj * (float)c - mj;
        }
    }
};
struct TQ6_K {
    enum { BE = 256, BB = 210 };
    static __device__ __forceinline__ void deq32(const u8* b, int j, int, float* v) {
        float d = h2f(ld16(b + 208));
        int h = j / 4;          // which 128-value half
        int e0 = (j % 4) * 32;  // first value within the half
        const u8* ql = b + 64 * h;
        const u8* qh = b + 128 + 32 * h;
#pragma unroll
        for (int l = 0; l < 32; l++) {
            int e = e0 + l;
            int lo = e < 64 ? (ql[e] & 15) : (ql[e - 64] >> 4);
            int hi = (qh[e % 32] >> (2 * (e / 32))) & 3;
            float dg = d * (float)(i8)b[192 + (32 * j + l) / 16];
            v[l] = dg * (float)((lo | (hi << 4)) - 32);
        }
    }
};
struct TQ2_K {
    enum { BE = 256, BB = 84 };
    static __device__ __forceinline__ void deq32(const u8* b, int j, int, float* v) {
        float d = h2f(ld16(b + 80)), dmin = h2f(ld16(b + 82));
        int h = j / 4, jj = j % 4;
#pragma unroll
        for (int l = 0; l < 32; l++) {
            int e = 32 * j + l;
            float q = (float)((b[16 + 32 * h + l] >> (2 * jj)) & 3);
            u8 s = b[e / 16];
            v[l] = d * (float)(s & 15) * q - dmin * (float)(s >> 4);
        }
    }
};
struct TQ3_K {
    enum { BE = 256, BB = 110 };
    static __device__ __forceinline__ int scale(const u8* s, int idx) {
        u32 lo0 = ld32(s), lo1 = ld32(s + 4), hi = ld32(s + 8);
        const u32 LO = 0x0f0f0f0fu, HI = 0x03030303u;
        u32 p;
        switch (idx / 4) {
            case 0: p = (lo0 & LO) | ((hi & HI) << 4); break;
            case 1: p = (lo1 & LO) | (((hi >> 2) & HI) << 4); break;
            case 2: p = ((lo0 >> 4) & LO) | (((hi >> 4) & HI) << 4); break;
            default: p = ((lo1 >> 4) & LO) | (((hi >> 6) & HI) << 4); break;
        }
        return (int)((p >> (8 * (idx % 4))) & 0xff) - 32;
    }
    static __device__ __forceinline__ void deq32(const u8* b, int j, int, float* v) {
        float d = h2f(ld16(b + 108));
        int h = j / 4, jj = j % 4;
        float d0 = d * (float)scale(b + 96, 2 * j);
        float d1 = d * (float)scale(b + 96, 2 * j + 1);
#pragma unroll
        for (int l = 0; l < 32; l++) {
            int low = (b[32 + 32 * h + l] >> (2 * jj)) & 3;
            int high = (b[l] >> (4 * h + jj)) & 1;
            int q = high ? low : low - 4;
            v[l] = (l < 16 ? d0 : d1) * (float)q;
        }
    }
};
struct TIQ2_XXS {
    enum { BE = 256, BB = 66 };
    static __device__ __forceinline__ void deq32(const u8* b, int g, int, float* v) {
        float d = h2f(ld16(b));
        u32 aux0 = ld32(b + 2 + 8 * g), aux1 = ld32(b + 6 + 8 * g);
        float db = d * (0.5f + (float)(aux1 >> 28)) * 0.25f;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            u64 grid = iq2xxs_grid[(aux0 >> (8 * k)) & 0xff];
            u32 signs = ksigns_iq2xs[(aux1 >> (7 * k)) & 0x7f];
#pragma unroll
            for (int c = 0; c < 8; c++) {
                float gv = (float)((grid >> (8 * c)) & 0xff);
                v[8 * k + c] = db * gv * (((signs >> c) & 1) ? -1.f : 1.f);
            }
        }
    }
};
struct TMXFP4 {
    enum { BE = 32, BB = 17 };
    static __device__ __forceinline__ void deq32(const u8* b, int, int, float* v) {
        u32 e = b[0];
        u32 bits = e < 2 ? (0x00200000u << e) : ((e - 1) << 23);
        float d = __uint_as_float(bits);
#pragma unroll
        for (int i = 0; i < 16; i++) {
            u8 q = b[1 + i];
            v[i] = d * (float)mxfp4_values[q & 15];
            v[i + 16] = d * (float)mxfp4_values[q >> 4];
        }
    }
};

__device__ __forceinline__ float warp_sum(float s) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}

// acc[t] = <row, xs[t]> for t < nt (nt <= NT), summed over the warp (every lane gets the sum).
template <class T>
__device__ __forceinline__ void row_dot_chunks(const u8* row, int cols, const float* const* xs,
                                               int nt, float* acc) {
    const int lane = threadIdx.x & 31;
    const int sub = T::BE / 32;
    const int chunks = (cols + 31) / 32;
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.f;
    for (int c = lane; c < chunks; c += 32) {
        float v[32];
        int valid = min(32, cols - 32 * c);
        T::deq32(row + (size_t)(c / sub) * T::BB, c % sub, valid, v);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                const float* x = xs[t] + 32 * c;
                float s = 0.f;
                if (valid == 32) {
#pragma unroll
                    for (int i = 0; i < 32; i += 4) {
                        float4 xv = *(const float4*)(x + i);
                        s += v[i] * xv.x + v[i + 1] * xv.y + v[i + 2] * xv.z + v[i + 3] * xv.w;
                    }
                } else {
                    for (int i = 0; i < valid; i++) s += v[i] * x[i];
                }
                acc[t] += s;
            }
        }
    }
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = warp_sum(acc[t]);
}

template <class T>
__device__ __forceinline__ void row_dot(const u8* row, int cols, const float* const* xs, int nt,
                                        float* acc) {
    row_dot_chunks<T>(row, cols, xs, nt, acc);
}

// F32 rows (the routers, the f32 reference files): lane l reads float4 number l, l + 32, ...,
// so each step of the warp reads 512 contiguous bytes (32 lanes on 32 different 128-byte lines
// per load, as the chunked loop reads them, left the decode step's router product at ~25 us per
// layer). Rows or inputs not 16-byte aligned take the chunked loop.
template <>
__device__ __forceinline__ void row_dot<TF32>(const u8* row, int cols, const float* const* xs,
                                              int nt, float* acc) {
    bool vec = (cols & 3) == 0 && ((size_t)row & 15) == 0;
#pragma unroll
    for (int t = 0; t < NT; t++) vec = vec && ((size_t)xs[t] & 15) == 0;
    if (!vec) {
        row_dot_chunks<TF32>(row, cols, xs, nt, acc);
        return;
    }
    const int lane = threadIdx.x & 31;
    const float4* w4 = (const float4*)row;
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.f;
#pragma unroll 4
    for (int c = lane; c < (cols >> 2); c += 32) {
        float4 w = w4[c];
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                float4 x = ((const float4*)xs[t])[c];
                acc[t] += w.x * x.x + w.y * x.y + w.z * x.z + w.w * x.w;
            }
        }
    }
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = warp_sum(acc[t]);
}

// Y[t*ldy + r] = <W row r, X[t*ldx ..]> for t < n. Grid: x = ceil(rows / WARPS) blocks of
// 32*WARPS; y: blocks that share the token groups of NT (each token's sum is the same whatever y).
template <class T>
__device__ void mm(const u8* W, long long rb, int rows, int cols, const float* X, int ldx, int n,
                   float* Y, int ldy) {
    int r = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (r >= rows) return;
    const u8* row = W + (size_t)r * rb;
    for (int t0 = blockIdx.y * NT; t0 < n; t0 += NT * gridDim.y) {
        const float* xs[NT];
        int nt = min(NT, n - t0);
#pragma unroll
        for (int t = 0; t < NT; t++) xs[t] = X + (size_t)(t0 + min(t, nt - 1)) * ldx;
        float acc[NT];
        row_dot<T>(row, cols, xs, nt, acc);
        if ((threadIdx.x & 31) == 0)
            for (int t = 0; t < nt; t++) Y[(size_t)(t0 + t) * ldy + r] = acc[t];
    }
}

// One routed expert's work: weights in the VRAM pool, its tokens' assignments a0..a0+cnt.
struct Job {
    u64 gate, up, down;
    int a0, cnt;
};

__device__ __forceinline__ float silu(float g) { return g / (1.f + expf(-g)); }

// Hb[a*f + r] = silu(gate_r . x) * (up_r . x) for each assignment a of the block's job.
template <class T>
__device__ void moe_gate_up(const Job* jobs, const int* nj, int f, int h, long long rb,
                            const float* XN, int ldx, const int* tok, float* Hb) {
    if (nj && (int)blockIdx.y >= *nj) return;
    Job j = jobs[blockIdx.y];
    int r = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (r >= f) return;
    const u8* g = (const u8*)j.gate + (size_t)r * rb;
    const u8* u = (const u8*)j.up + (size_t)r * rb;
    for (int a0 = j.a0; a0 < j.a0 + j.cnt; a0 += NT) {
        int nt = min(NT, j.a0 + j.cnt - a0);
        const float* xs[NT];
#pragma unroll
        for (int t = 0; t < NT; t++) xs[t] = XN + (size_t)tok[a0 + min(t, nt - 1)] * ldx;
        float ag[NT], au[NT];
        row_dot<T>(g, h, xs, nt, ag);
        row_dot<T>(u, h, xs, nt, au);
        if ((threadIdx.x & 31) == 0)
            for (int t = 0; t < nt; t++) Hb[(size_t)(a0 + t) * f + r] = silu(ag[t]) * au[t];
    }
}

// SO[dst[a]*h + r] = down_r . Hb[a] for each assignment a of the block's job.
template <class T>
__device__ void moe_down(const Job* jobs, const int* nj, int h, int f, long long rb,
                         const float* Hb, const int* dst, float* SO) {
    if (nj && (int)blockIdx.y >= *nj) return;
    Job j = jobs[blockIdx.y];
    int r = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (r >= h) return;
    const u8* w = (const u8*)j.down + (size_t)r * rb;
    for (int a0 = j.a0; a0 < j.a0 + j.cnt; a0 += NT) {
        int nt = min(NT, j.a0 + j.cnt - a0);
        const float* xs[NT];
#pragma unroll
        for (int t = 0; t < NT; t++) xs[t] = Hb + (size_t)(a0 + min(t, nt - 1)) * f;
        float acc[NT];
        row_dot<T>(w, f, xs, nt, acc);
        if ((threadIdx.x & 31) == 0)
            for (int t = 0; t < nt; t++) SO[(size_t)dst[a0 + t] * h + r] = acc[t];
    }
}

// X[i*h ..] = row tokens[i] of the embedding matrix. Grid: n blocks.
template <class T>
__device__ void embed(const u8* W, long long rb, int h, const int* tokens, float* X) {
    const u8* row = W + (size_t)tokens[blockIdx.x] * rb;
    const int sub = T::BE / 32;
    for (int c = threadIdx.x; c < (h + 31) / 32; c += blockDim.x) {
        float v[32];
        int valid = min(32, h - 32 * c);
        T::deq32(row + (size_t)(c / sub) * T::BB, c % sub, valid, v);
        for (int i = 0; i < valid; i++) X[(size_t)blockIdx.x * h + 32 * c + i] = v[i];
    }
}

#define TYPE_KERNELS(NAME, T)                                                                     \
    extern "C" __global__ void mm_##NAME(const u8* W, long long rb, int rows, int cols,           \
                                         const float* X, int ldx, int n, float* Y, int ldy) {     \
        mm<T>(W, rb, rows, cols, X, ldx, n, Y, ldy);                                              \
    }                                                                                             \
    extern "C" __global__ void moe_gate_up_##NAME(const Job* jobs, const int* nj, int f, int h,   \
                                                  long long rb, const float* XN, int ldx,         \
                                                  const int* tok, float* Hb) {                    \
        moe_gate_up<T>(jobs, nj, f, h, rb, XN, ldx, tok, Hb);                                     \
    }                                                                                             \
    extern "C" __global__ void moe_down_##NAME(const Job* jobs, const int* nj, int h, int f,      \
                                               long long rb, const float* Hb, const int* dst,     \
                                               float* SO) {                                       \
        moe_down<T>(jobs, nj, h, f, rb, Hb, dst, SO);                                             \
    }                                                                                             \
    extern "C" __global__ void embed_##NAME(const u8* W, long long rb, int h, const int* tokens, \
                                            float* X) {                                           \
        embed<T>(W, rb, h, tokens, X);                                                            \
    }

TYPE_KERNELS(f32, TF32)
TYPE_KERNELS(f16, TF16)
TYPE_KERNELS(bf16, TBF16)
TYPE_KERNELS(q8_0, TQ8_0)
TYPE_KERNELS(q4_0, TQ4_0)
TYPE_KERNELS(q4_k, TQ4_K)
TYPE_KERNELS(q5_k, TQ5_K)
TYPE_KERNELS(q6_k, TQ6_K)
TYPE_KERNELS(q2_k, TQ2_K)
TYPE_KERNELS(q3_k, TQ3_K)
TYPE_KERNELS(iq2_xxs, TIQ2_XXS)
TYPE_KERNELS(mxfp4, TMXFP4)

// ---- Small kernels -----------------------------------------------------------------------------

__device__ __forceinline__ float block_sum(float s, float* red) {
    s = warp_sum(s);
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) red[w] = s;
    __syncthreads();
    float t = 0.f;
    for (int i = 0; i < nw; i++) t += red[i];
    return t;
}
__device__ __forceinline__ float block_max(float s, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s = fmaxf(s, __shfl_xor_sync(0xffffffffu, s, o));
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) red[w] = s;
    __syncthreads();
    float t = -INFINITY;
    for (int i = 0; i < nw; i++) t = fmaxf(t, red[i]);
    return t;
}

// Y[row*ldy + i] = X[row*ldx + i] / rms(X row) * w[i], i < dim. Grid: rows blocks. In place OK.
extern "C" __global__ void rmsnorm(const float* X, int ldx, const float* w, int dim, float eps,
                                   float* Y, int ldy) {
    __shared__ float red[32];
    const float* x = X + (size_t)blockIdx.x * ldx;
    float* y = Y + (size_t)blockIdx.x * ldy;
    float s = 0.f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) s += x[i] * x[i];
    s = block_sum(s, red);
    float inv = 1.f / sqrtf(s / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) y[i] = x[i] * inv * w[i];
}

// y[i] += x[i].
extern "C" __global__ void add(float* y, const float* x, int len) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) y[i] += x[i];
}

// Y[t*dim + i] += b[i].
extern "C" __global__ void add_bias(float* Y, const float* b, int dim, int len) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) Y[i] += b[i % dim];
}

// g[i] = silu(g[i]) * u[i].
extern "C" __global__ void silu_mul(float* g, const float* u, int len) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) g[i] = silu(g[i]) * u[i];
}

// Rotate `half` pairs of each head: head hh of token t starts at X + t*ld + hh*hs + off.
// Position of token t: *pp + padd + t (a row of the cos/sin tables; *pp lives on the device so a
// captured graph replays at the current position). layout 0: half-split (NeoX),
// 1: interleaved. Grid: (n tokens, heads); block: >= half threads.
extern "C" __global__ void rope(float* X, int ld, int hs, int off, int half, int layout,
                                const float* cosT, const float* sinT, const int* pp, int padd) {
    int t = blockIdx.x, hh = blockIdx.y;
    int pos0 = *pp + padd;
    float* x = X + (size_t)t * ld + (size_t)hh * hs + off;
    const float* c = cosT + (size_t)(pos0 + t) * half;
    const float* s = sinT + (size_t)(pos0 + t) * half;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        int ia = layout == 0 ? i : 2 * i;
        int ib = layout == 0 ? i + half : 2 * i + 1;
        float a = x[ia], b = x[ib];
        x[ia] = a * c[i] - b * s[i];
        x[ib] = b * c[i] + a * s[i];
    }
}

// Causal attention of token t (position pos0 + t), head hh. Keys/values of position j for kv head
// g live at K + j*ks + g*khs (dk values) and V + j*vs + g*vhs (dv values); kv head = hh / group.
// Scores go to S (scratch, n*heads*ctx). O[t*ots + hh*ohs + d] = sum_j p_j v_j[d].
// Scores: one warp per position, lanes over the key's values (coalesced); values: threads over
// d, four positions in flight. Grid: (heads, n); block 128.
extern "C" __global__ void attention(const float* Q, int qts, int qhs, const float* K, int ks,
                                     int khs, const float* V, int vs, int vhs, int dk, int dv,
                                     int group, const int* pp, int padd, float scale, float* S,
                                     int ctx, float* O, int ots, int ohs) {
    __shared__ float red[32];
    extern __shared__ float qsh[];
    int hh = blockIdx.x, t = blockIdx.y, heads = gridDim.x;
    int pos0 = *pp + padd;
    int len = pos0 + t + 1;
    int g = hh / group;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const float* q = Q + (size_t)t * qts + (size_t)hh * qhs;
    for (int i = threadIdx.x; i < dk; i += blockDim.x) qsh[i] = q[i];
    __syncthreads();
    float* sc = S + ((size_t)t * heads + hh) * ctx;
    float mx = -INFINITY;
    for (int j = warp; j < len; j += nw) {
        const float* k = K + (size_t)j * ks + (size_t)g * khs;
        float s = 0.f;
        for (int i = lane; i < dk; i += 32) s += qsh[i] * k[i];
        s = warp_sum(s) * scale;
        if (lane == 0) sc[j] = s;
        mx = fmaxf(mx, s);
    }
    mx = block_max(mx, red);  // its barriers also make every sc[j] visible to the block
    float sum = 0.f;
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
        float e = expf(sc[j] - mx);
        sc[j] = e;
        sum += e;
    }
    sum = block_sum(sum, red);
    float inv = 1.f / sum;
    float* o = O + (size_t)t * ots + (size_t)hh * ohs;
    const float* vb = V + (size_t)g * vhs;
    for (int d = threadIdx.x; d < dv; d += blockDim.x) {
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
        int j = 0;
        for (; j + 4 <= len; j += 4) {
            a0 += sc[j] * vb[(size_t)j * vs + d];
            a1 += sc[j + 1] * vb[(size_t)(j + 1) * vs + d];
            a2 += sc[j + 2] * vb[(size_t)(j + 2) * vs + d];
            a3 += sc[j + 3] * vb[(size_t)(j + 3) * vs + d];
        }
        for (; j < len; j++) a0 += sc[j] * vb[(size_t)j * vs + d];
        o[d] = ((a0 + a1) + (a2 + a3)) * inv;
    }
}

// Per-head f32 matrices: Y[t*yts + hh*yhs + r] = sum_c M[(hh*rows + r)*cols + c] X[t*xts + hh*xhs + c].
// Grid: (ceil(rows / WARPS), heads, n); block 32*WARPS.
extern "C" __global__ void head_mv(const float* M, int rows, int cols, const float* X, int xts,
                                   int xhs, float* Y, int yts, int yhs) {
    int r = blockIdx.x * WARPS + (threadIdx.x >> 5);
    int hh = blockIdx.y, t = blockIdx.z, lane = threadIdx.x & 31;
    if (r >= rows) return;
    const float* m = M + ((size_t)hh * rows + r) * cols;
    const float* x = X + (size_t)t * xts + (size_t)hh * xhs;
    float s = 0.f;
    for (int c = lane; c < cols; c += 32) s += m[c] * x[c];
    s = warp_sum(s);
    if (lane == 0) Y[(size_t)t * yts + (size_t)hh * yhs + r] = s;
}

// Dst[r*ds + c] = Src[r*ss + c], c < cols. Grid: rows blocks.
extern "C" __global__ void copy2d(const float* Src, int ss, float* Dst, int ds, int cols) {
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        Dst[(size_t)blockIdx.x * ds + c] = Src[(size_t)blockIdx.x * ss + c];
}

// out[t*h + i] = sum over slots s of w[t*k + s] * SO[(t*k + s)*h + i], in slot order.
extern "C" __global__ void moe_combine(const float* SO, const float* w, int k, int h, int n,
                                       float* out) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * h) return;
    int t = i / h, c = i % h;
    float acc = 0.f;
    for (int s = 0; s < k; s++) acc += w[t * k + s] * SO[((size_t)t * k + s) * h + c];
    out[i] = acc;
}

// ---- Integer dot products against 8-bit activations (decode at memory speed) -------------------
//
// Activations are quantized per 32 values (XQ: int8, XD: one f32 scale per 32, d = amax/127), as
// the CPU kernels do; a weight block is then dotted with __dp4a on its integer codes and the
// per-32 scales are applied once per sub-block. Each lane takes one "item" (16 bytes of a
// block's codes, read with one wide load) per step, so a warp reads a row's blocks contiguously.
// Types without a Q* struct keep the f32-activation kernels above (F32/F16/BF16 on purpose:
// those are the precision reference path).

// X (rows x cols, row stride ldx) -> XQ (rows x cols int8, stride cols), XD (rows x cols/32).
// One warp per 32 values; cols is a multiple of 32. Grid: ceil(rows*cols/32 / 8), block 256.
extern "C" __global__ void quantize_q8(const float* X, int ldx, int cols, int rows, i8* XQ,
                                       float* XD) {
    int g = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    int per = cols >> 5;
    if (g >= rows * per) return;
    int r = g / per, c = g % per;
    float v = X[(size_t)r * ldx + 32 * c + lane];
    float a = fabsf(v);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    float d = a / 127.f;
    float id = d > 0.f ? 1.f / d : 0.f;
    int q = (int)roundf(v * id);  // ties away from zero, as the CPU's quantizer
    XQ[(size_t)r * cols + 32 * c + lane] = (i8)max(-127, min(127, q));
    if (lane == 0) XD[(size_t)r * per + c] = d;
}

__device__ __forceinline__ int dp4(int a, int b, int c) { return __dp4a(a, b, c); }
__device__ __forceinline__ int ld2x16(const u8* p) {  // 4 bytes from a 2-byte aligned address
    const u16* q = (const u16*)p;
    return (int)((u32)q[0] | ((u32)q[1] << 16));
}
#define ONES 0x01010101

// Q4_K: item = 16 code bytes (16 values of sub-blocks j0 and j0+1). 8 items per block.
struct QQ4_K {
    enum { BE = 256, BB = 144, IPB = 8 };
    static __device__ __forceinline__ void dot(const u8* row, int it, const i8* const* xq,
                                               const float* const* xd, int nt, float* acc) {
        int b = it >> 3, p = it & 7;
        const u8* blk = row + (size_t)b * BB;
        uint4 q = *(const uint4*)(blk + 16 + 16 * p);
        u32 dd = *(const u32*)blk;
        float d = h2f((u16)(dd & 0xffff)), dmin = h2f((u16)(dd >> 16));
        int j0 = 2 * (p >> 1);
        int sc0, m0, sc1, m1;
        k_scale_min(blk + 4, j0, sc0, m0);
        k_scale_min(blk + 4, j0 + 1, sc1, m1);
        float d0 = d * (float)sc0, n0 = dmin * (float)m0, d1 = d * (float)sc1, n1 = dmin * (float)m1;
        int lo0 = q.x & 0x0f0f0f0f, lo1 = q.y & 0x0f0f0f0f, lo2 = q.z & 0x0f0f0f0f, lo3 = q.w & 0x0f0f0f0f;
        int hi0 = (q.x >> 4) & 0x0f0f0f0f, hi1 = (q.y >> 4) & 0x0f0f0f0f;
        int hi2 = (q.z >> 4) & 0x0f0f0f0f, hi3 = (q.w >> 4) & 0x0f0f0f0f;
        int off = 256 * b + 32 * j0 + 16 * (p & 1);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                int4 x0 = *(const int4*)(xq[t] + off);
                int4 x1 = *(const int4*)(xq[t] + off + 32);
                int s0 = dp4(lo3, x0.w, dp4(lo2, x0.z, dp4(lo1, x0.y, dp4(lo0, x0.x, 0))));
                int s1 = dp4(hi3, x1.w, dp4(hi2, x1.z, dp4(hi1, x1.y, dp4(hi0, x1.x, 0))));
                int u0 = dp4(ONES, x0.w, dp4(ONES, x0.z, dp4(ONES, x0.y, dp4(ONES, x0.x, 0))));
                int u1 = dp4(ONES, x1.w, dp4(ONES, x1.z, dp4(ONES, x1.y, dp4(ONES, x1.x, 0))));
                const float* dx = xd[t] + (off >> 5);
                acc[t] += dx[0] * (d0 * (float)s0 - n0 * (float)u0) +
                          dx[1] * (d1 * (float)s1 - n1 * (float)u1);
            }
        }
    }
};

// Q5_K: as Q4_K plus the fifth bit of each value from qh (bit j of qh[l] for sub-block j).
struct QQ5_K {
    enum { BE = 256, BB = 176, IPB = 8 };
    static __device__ __forceinline__ void dot(const u8* row, int it, const i8* const* xq,
                                               const float* const* xd, int nt, float* acc) {
        int b = it >> 3, p = it & 7;
        const u8* blk = row + (size_t)b * BB;
        uint4 q = *(const uint4*)(blk + 48 + 16 * p);
        uint4 qh = *(const uint4*)(blk + 16 + 16 * (p & 1));
        u32 dd = *(const u32*)blk;
        float d = h2f((u16)(dd & 0xffff)), dmin = h2f((u16)(dd >> 16));
        int j0 = 2 * (p >> 1);
        int sc0, m0, sc1, m1;
        k_scale_min(blk + 4, j0, sc0, m0);
        k_scale_min(blk + 4, j0 + 1, sc1, m1);
        float d0 = d * (float)sc0, n0 = dmin * (float)m0, d1 = d * (float)sc1, n1 = dmin * (float)m1;
        u32 qw[4] = {q.x, q.y, q.z, q.w}, hw[4] = {qh.x, qh.y, qh.z, qh.w};
        int lo[4], hi[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            lo[i] = (int)((qw[i] & 0x0f0f0f0fu) | (((hw[i] >> j0) & 0x01010101u) << 4));
            hi[i] = (int)(((qw[i] >> 4) & 0x0f0f0f0fu) | (((hw[i] >> (j0 + 1)) & 0x01010101u) << 4));
        }
        int off = 256 * b + 32 * j0 + 16 * (p & 1);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                int4 x0 = *(const int4*)(xq[t] + off);
                int4 x1 = *(const int4*)(xq[t] + off + 32);
                int s0 = dp4(lo[3], x0.w, dp4(lo[2], x0.z, dp4(lo[1], x0.y, dp4(lo[0], x0.x, 0))));
                int s1 = dp4(hi[3], x1.w, dp4(hi[2], x1.z, dp4(hi[1], x1.y, dp4(hi[0], x1.x, 0))));
                int u0 = dp4(ONES, x0.w, dp4(ONES, x0.z, dp4(ONES, x0.y, dp4(ONES, x0.x, 0))));
                int u1 = dp4(ONES, x1.w, dp4(ONES, x1.z, dp4(ONES, x1.y, dp4(ONES, x1.x, 0))));
                const float* dx = xd[t] + (off >> 5);
                acc[t] += dx[0] * (d0 * (float)s0 - n0 * (float)u0) +
                          dx[1] * (d1 * (float)s1 - n1 * (float)u1);
            }
        }
    }
};

// Q6_K: item = 16 values sharing one 8-bit scale (16 items per block).
struct QQ6_K {
    enum { BE = 256, BB = 210, IPB = 16 };
    static __device__ __forceinline__ void dot(const u8* row, int it, const i8* const* xq,
                                               const float* const* xd, int nt, float* acc) {
        int b = it >> 4, i = it & 15;
        dot_blk(row + (size_t)b * BB, b, i, xq, xd, nt, acc);
    }
    // Item i of block b (its bytes at blk: in the row, or a copy of them).
    static __device__ __forceinline__ void dot_blk(const u8* blk, int b, int i,
                                                   const i8* const* xq, const float* const* xd,
                                                   int nt, float* acc) {
        int h = i >> 3, e0 = (16 * i) & 127;
        const u8* ql = blk + 64 * h + (e0 & 63);
        const u8* qh = blk + 128 + 32 * h + (e0 & 31);
        int lsh = e0 < 64 ? 0 : 4, hsh = 2 * (e0 >> 5);
        float d = h2f(*(const u16*)(blk + 208)) * (float)(i8)blk[192 + i];
        int v[4];
#pragma unroll
        for (int w = 0; w < 4; w++) {
            u32 l = (u32)ld2x16(ql + 4 * w), hh = (u32)ld2x16(qh + 4 * w);
            v[w] = (int)(((l >> lsh) & 0x0f0f0f0fu) | (((hh >> hsh) & 0x03030303u) << 4));
        }
        int off = 256 * b + 16 * i;
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                int4 x = *(const int4*)(xq[t] + off);
                int s = dp4(v[3], x.w, dp4(v[2], x.z, dp4(v[1], x.y, dp4(v[0], x.x, 0))));
                int u = dp4(ONES, x.w, dp4(ONES, x.z, dp4(ONES, x.y, dp4(ONES, x.x, 0))));
                acc[t] += xd[t][off >> 5] * d * (float)(s - 32 * u);
            }
        }
    }
};

// Q8_0: item = half a block (16 values).
struct QQ8_0 {
    enum { BE = 32, BB = 34, IPB = 2 };
    static __device__ __forceinline__ void dot(const u8* row, int it, const i8* const* xq,
                                               const float* const* xd, int nt, float* acc) {
        int b = it >> 1, hf = it & 1;
        const u8* blk = row + (size_t)b * BB;
        float d = h2f(*(const u16*)blk);
        const u8* qs = blk + 2 + 16 * hf;
        int w0 = ld2x16(qs), w1 = ld2x16(qs + 4), w2 = ld2x16(qs + 8), w3 = ld2x16(qs + 12);
        int off = 32 * b + 16 * hf;
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                int4 x = *(const int4*)(xq[t] + off);
                int s = dp4(w3, x.w, dp4(w2, x.z, dp4(w1, x.y, dp4(w0, x.x, 0))));
                acc[t] += xd[t][b] * d * (float)s;
            }
        }
    }
};

// Q4_0: item = one block (values i and i+16 in byte i).
struct QQ4_0 {
    enum { BE = 32, BB = 18, IPB = 1 };
    static __device__ __forceinline__ void dot(const u8* row, int it, const i8* const* xq,
                                               const float* const* xd, int nt, float* acc) {
        const u8* blk = row + (size_t)it * BB;
        float d = h2f(*(const u16*)blk);
        int w[4];
#pragma unroll
        for (int i = 0; i < 4; i++) w[i] = ld2x16(blk + 2 + 4 * i);
        int off = 32 * it;
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                int4 x0 = *(const int4*)(xq[t] + off);
                int4 x1 = *(const int4*)(xq[t] + off + 16);
                int s = 0, u = 0;
                s = dp4(w[0] & 0x0f0f0f0f, x0.x, s);
                s = dp4(w[1] & 0x0f0f0f0f, x0.y, s);
                s = dp4(w[2] & 0x0f0f0f0f, x0.z, s);
                s = dp4(w[3] & 0x0f0f0f0f, x0.w, s);
                s = dp4((w[0] >> 4) & 0x0f0f0f0f, x1.x, s);
                s = dp4((w[1] >> 4) & 0x0f0f0f0f, x1.y, s);
                s = dp4((w[2] >> 4) & 0x0f0f0f0f, x1.z, s);
                s = dp4((w[3] >> 4) & 0x0f0f0f0f, x1.w, s);
                u = dp4(ONES, x0.w, dp4(ONES, x0.z, dp4(ONES, x0.y, dp4(ONES, x0.x, 0))));
                u = dp4(ONES, x1.w, dp4(ONES, x1.z, dp4(ONES, x1.y, dp4(ONES, x1.x, u))));
                acc[t] += xd[t][it] * d * (float)(s - 8 * u);
            }
        }
    }
};

// acc[t] = <row, x_t> over quantized activations (xq/xd per token), summed over the warp.
// NTT: the tokens a pass can hold (arrays of NTT; nt <= NTT). The decode step's kernels are
// instantiated with NTT = 1 (`*_t1`): the same sums for one token in ~half the registers, so
// 2-3x the warps fit on an SM (mmq_q4_k with NT = 4 takes 94 registers: 2 blocks per SM).
template <class T, int NTT = NT>
__device__ __forceinline__ void row_dotq(const u8* row, int cols, const i8* const* xq,
                                         const float* const* xd, int nt, float* acc) {
    const int lane = threadIdx.x & 31;
    const int items = (cols / T::BE) * T::IPB;
#pragma unroll
    for (int t = 0; t < NTT; t++) acc[t] = 0.f;
#pragma unroll 4
    for (int it = lane; it < items; it += 32) T::dot(row, it, xq, xd, NTT == 1 ? 1 : nt, acc);
#pragma unroll
    for (int t = 0; t < NTT; t++) acc[t] = warp_sum(acc[t]);
}

// Q6_K rows staged through shared memory (`mmq_q6_ks`, the output head's type): Q6_K blocks are
// 210 bytes, so a lane reading its items straight from the row makes ~18 narrow loads per 16
// values; here the warp copies 8 blocks (1680 bytes) of its row with 16-byte loads, then each lane
// reads its items from the copy. Lane l's items stay l, l + 32, ... in the same order (a piece
// is 128 items), so the sums are row_dotq<QQ6_K>'s. Rows not 16-byte aligned, a short last piece
// and blocks wider than 8 warps read the row directly.
struct QQ6_KS : QQ6_K {};

template <>
__device__ __forceinline__ void row_dotq<QQ6_KS, NT>(const u8* row, int cols, const i8* const* xq,
                                                 const float* const* xd, int nt, float* acc) {
    __shared__ uint4 q6s[8][105];
    const int lane = threadIdx.x & 31, nb = cols / 256;
    const bool stage = blockDim.x <= 256 && ((size_t)row & 15) == 0;
    uint4* buf = q6s[(threadIdx.x >> 5) & 7];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.f;
    for (int b0 = 0; b0 < nb; b0 += 8) {
        const u8* src = row + (size_t)b0 * 210;
        if (stage && nb - b0 >= 8) {
            const uint4* s4 = (const uint4*)src;
            __syncwarp();
#pragma unroll
            for (int c = lane; c < 105; c += 32) buf[c] = s4[c];
            __syncwarp();
            const u8* sb = (const u8*)buf;
#pragma unroll
            for (int it = lane; it < 128; it += 32)
                QQ6_K::dot_blk(sb + (it >> 4) * 210, b0 + (it >> 4), it & 15, xq, xd, nt, acc);
        } else {
            int items = min(8, nb - b0) * 16;
            for (int it = lane; it < items; it += 32)
                QQ6_K::dot_blk(src + (it >> 4) * 210, b0 + (it >> 4), it & 15, xq, xd, nt, acc);
        }
    }
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = warp_sum(acc[t]);
}

// Y[t*ldy + r] = <W row r, x_t>, x_t quantized (XQ row stride cols, XD row stride cols/32).
template <class T, int NTT = NT>
__device__ void mmq(const u8* W, long long rb, int rows, int cols, const i8* XQ, const float* XD,
                    int n, float* Y, int ldy) {
    int r = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (r < rows) prefetch_l2_pdl(W + (size_t)r * rb, rb);
    pdl_wait();
    pdl_go();
    if (r >= rows) return;
    const u8* row = W + (size_t)r * rb;
    for (int t0 = 0; t0 < n; t0 += NTT) {
        int nt = NTT == 1 ? 1 : min(NTT, n - t0);
        const i8* xq[NTT];
        const float* xd[NTT];
#pragma unroll
        for (int t = 0; t < NTT; t++) {
            size_t tt = t0 + min(t, nt - 1);
            xq[t] = XQ + tt * cols;
            xd[t] = XD + tt * (cols >> 5);
        }
        float acc[NTT];
        row_dotq<T, NTT>(row, cols, xq, xd, nt, acc);
        if ((threadIdx.x & 31) == 0)
            for (int t = 0; t < nt; t++) Y[(size_t)(t0 + t) * ldy + r] = acc[t];
    }
}

// As moe_gate_up, against the quantized rows of XN (token tok[a] of assignment a).
template <class T, int NTT = NT>
__device__ void moe_gate_up_q(const Job* jobs, const int* nj, int f, int h, long long rb,
                              const i8* XQ, const float* XD, const int* tok, float* Hb) {
    pdl_wait();
    pdl_go();
    if (nj && (int)blockIdx.y >= *nj) return;
    Job j = jobs[blockIdx.y];
    int r = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (r >= f) return;
    const u8* g = (const u8*)j.gate + (size_t)r * rb;
    const u8* u = (const u8*)j.up + (size_t)r * rb;
    for (int a0 = j.a0; a0 < j.a0 + j.cnt; a0 += NTT) {
        int nt = NTT == 1 ? 1 : min(NTT, j.a0 + j.cnt - a0);
        const i8* xq[NTT];
        const float* xd[NTT];
#pragma unroll
        for (int t = 0; t < NTT; t++) {
            size_t tt = tok[a0 + min(t, nt - 1)];
            xq[t] = XQ + tt * h;
            xd[t] = XD + tt * (h >> 5);
        }
        float ag[NTT], au[NTT];
        row_dotq<T, NTT>(g, h, xq, xd, nt, ag);
        row_dotq<T, NTT>(u, h, xq, xd, nt, au);
        if ((threadIdx.x & 31) == 0)
            for (int t = 0; t < nt; t++) Hb[(size_t)(a0 + t) * f + r] = silu(ag[t]) * au[t];
    }
}

// As moe_down, against the quantized rows of Hb (one per assignment).
template <class T>
__device__ void moe_down_q(const Job* jobs, const int* nj, int h, int f, long long rb,
                           const i8* XQ, const float* XD, const int* dst, float* SO) {
    if (nj && (int)blockIdx.y >= *nj) return;
    Job j = jobs[blockIdx.y];
    int r = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (r >= h) return;
    const u8* w = (const u8*)j.down + (size_t)r * rb;
    for (int a0 = j.a0; a0 < j.a0 + j.cnt; a0 += NT) {
        int nt = min(NT, j.a0 + j.cnt - a0);
        const i8* xq[NT];
        const float* xd[NT];
#pragma unroll
        for (int t = 0; t < NT; t++) {
            size_t tt = a0 + min(t, nt - 1);
            xq[t] = XQ + tt * f;
            xd[t] = XD + tt * (f >> 5);
        }
        float acc[NT];
        row_dotq<T>(w, f, xq, xd, nt, acc);
        if ((threadIdx.x & 31) == 0)
            for (int t = 0; t < nt; t++) SO[(size_t)dst[a0 + t] * h + r] = acc[t];
    }
}

#define QTYPE_KERNELS(NAME, T)                                                                    \
    extern "C" __global__ void mmq_##NAME(const u8* W, long long rb, int rows, int cols,          \
                                          const i8* XQ, const float* XD, int n, float* Y,         \
                                          int ldy) {                                              \
        mmq<T>(W, rb, rows, cols, XQ, XD, n, Y, ldy);                                             \
    }                                                                                             \
    extern "C" __global__ void moe_gate_up_q_##NAME(const Job* jobs, const int* nj, int f, int h, \
                                                    long long rb, const i8* XQ, const float* XD,  \
                                                    const int* tok, float* Hb) {                  \
        moe_gate_up_q<T>(jobs, nj, f, h, rb, XQ, XD, tok, Hb);                                    \
    }                                                                                             \
    extern "C" __global__ void moe_down_q_##NAME(const Job* jobs, const int* nj, int h, int f,    \
                                                 long long rb, const i8* XQ, const float* XD,     \
                                                 const int* dst, float* SO) {                     \
        moe_down_q<T>(jobs, nj, h, f, rb, XQ, XD, dst, SO);                                       \
    }

QTYPE_KERNELS(q4_k, QQ4_K)
QTYPE_KERNELS(q5_k, QQ5_K)
QTYPE_KERNELS(q6_k, QQ6_K)
QTYPE_KERNELS(q8_0, QQ8_0)
QTYPE_KERNELS(q4_0, QQ4_0)

// One token per pass (`*_t1`, the decode step's): see row_dotq. `*_t1` are held to 40 registers
// (6 blocks of 256 per SM; a few bytes spill), `*_t1n` are not (~53: 4 blocks).
#define QTYPE_T1_KERNELS(NAME, T, SFX, LB)                                                                 \
    extern "C" __global__ void LB mmq_##NAME##SFX(const u8* W, long long rb, int rows, int cols,     \
                                               const i8* XQ, const float* XD, int n, float* Y,    \
                                               int ldy) {                                         \
        mmq<T, 1>(W, rb, rows, cols, XQ, XD, n, Y, ldy);                                          \
    }                                                                                             \
    extern "C" __global__ void LB moe_gate_up_q_##NAME##SFX(                                         \
        const Job* jobs, const int* nj, int f, int h, long long rb, const i8* XQ,                 \
        const float* XD, const int* tok, float* Hb) {                                             \
        moe_gate_up_q<T, 1>(jobs, nj, f, h, rb, XQ, XD, tok, Hb);                                 \
    }
QTYPE_T1_KERNELS(q4_k, QQ4_K, _t1, __launch_bounds__(256, 6))
QTYPE_T1_KERNELS(q4_k, QQ4_K, _t1n, )
QTYPE_T1_KERNELS(q5_k, QQ5_K, _t1, __launch_bounds__(256, 6))
QTYPE_T1_KERNELS(q5_k, QQ5_K, _t1n, )
QTYPE_T1_KERNELS(q6_k, QQ6_K, _t1, __launch_bounds__(256, 6))
QTYPE_T1_KERNELS(q6_k, QQ6_K, _t1n, )
QTYPE_T1_KERNELS(q8_0, QQ8_0, _t1, __launch_bounds__(256, 6))
QTYPE_T1_KERNELS(q8_0, QQ8_0, _t1n, )
QTYPE_T1_KERNELS(q4_0, QQ4_0, _t1, __launch_bounds__(256, 6))
QTYPE_T1_KERNELS(q4_0, QQ4_0, _t1n, )

// mmq with each warp on R rows at once (rows r, r + 1, ...: R times the bytes in flight per
// warp, R times fewer blocks), each row's sums exactly as row_dotq's (same items per lane in
// the same order, same warp reduction). For a matvec over many rows (the output head), where one
// row per warp leaves each warp a single short round trip. Grid: ceil(rows / (WARPS * R)).
template <class T, int R>
__device__ void mmq_rows(const u8* W, long long rb, int rows, int cols, const i8* XQ,
                         const float* XD, int n, float* Y, int ldy) {
    const int lane = threadIdx.x & 31;
    int r0 = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * R;
    if (r0 >= rows) return;
    const int items = (cols / T::BE) * T::IPB;
    for (int t0 = 0; t0 < n; t0 += NT) {
        int nt = min(NT, n - t0);
        const i8* xq[NT];
        const float* xd[NT];
#pragma unroll
        for (int t = 0; t < NT; t++) {
            size_t tt = t0 + min(t, nt - 1);
            xq[t] = XQ + tt * cols;
            xd[t] = XD + tt * (cols >> 5);
        }
        float acc[R][NT];
#pragma unroll
        for (int q = 0; q < R; q++)
#pragma unroll
            for (int t = 0; t < NT; t++) acc[q][t] = 0.f;
#pragma unroll 2
        for (int it = lane; it < items; it += 32)
#pragma unroll
            for (int q = 0; q < R; q++)
                T::dot(W + (size_t)min(r0 + q, rows - 1) * rb, it, xq, xd, nt, acc[q]);
#pragma unroll
        for (int q = 0; q < R; q++)
#pragma unroll
            for (int t = 0; t < NT; t++) acc[q][t] = warp_sum(acc[q][t]);
        if (lane == 0)
#pragma unroll
            for (int q = 0; q < R; q++)
                if (r0 + q < rows)
                    for (int t = 0; t < nt; t++) Y[(size_t)(t0 + t) * ldy + r0 + q] = acc[q][t];
    }
}

#define MMQ_ROWS_KERNEL(NAME, T)                                                                  \
    extern "C" __global__ void mmq2_##NAME(const u8* W, long long rb, int rows, int cols,         \
                                           const i8* XQ, const float* XD, int n, float* Y,        \
                                           int ldy) {                                             \
        mmq_rows<T, 2>(W, rb, rows, cols, XQ, XD, n, Y, ldy);                                     \
    }
MMQ_ROWS_KERNEL(q4_k, QQ4_K)
MMQ_ROWS_KERNEL(q5_k, QQ5_K)
MMQ_ROWS_KERNEL(q6_k, QQ6_K)
MMQ_ROWS_KERNEL(q8_0, QQ8_0)
MMQ_ROWS_KERNEL(q4_0, QQ4_0)

extern "C" __global__ void mmq_q6_ks(const u8* W, long long rb, int rows, int cols, const i8* XQ,
                                     const float* XD, int n, float* Y, int ldy) {
    mmq<QQ6_KS>(W, rb, rows, cols, XQ, XD, n, Y, ldy);
}

// ---- Routing on the device ---------------------------------------------------------------------
//
// route_token of model/forward.rs, one warp per token: scores by softmax or sigmoid (the softmax
// sum in index order, as the CPU), selection on score + bias within the best groups, top-k with
// the CPU's tie rule (the lower index wins), weights = unbiased scores, optionally renormalised
// (summed in slot order), times the routed scale. Grid: n blocks of 32; shared 2*E floats.
// route_warp: token t's routing by one warp (lane = its lane), in the warp's own scratch: sc, ch
// (E floats each), gsc, gkeep, chosen (64 each).
__device__ void route_warp(const float* logits, int E, int k, const float* bias, int sigmoid,
                           int n_group, int topk_group, int norm, float scale, int* sel,
                           float* selw, int t, int lane, float* sc, float* ch, float* gsc,
                           int* gkeep, int* chosen) {
    const float* x = logits + (size_t)t * E;
    if (sigmoid) {
        for (int i = lane; i < E; i += 32) sc[i] = 1.f / (1.f + expf(-x[i]));
    } else {
        float m = -INFINITY;
        for (int i = lane; i < E; i += 32) m = fmaxf(m, x[i]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        for (int i = lane; i < E; i += 32) sc[i] = expf(x[i] - m);
        __syncwarp();
        float s = 0.f;
        if (lane == 0)
            for (int i = 0; i < E; i++) s += sc[i];
        s = __shfl_sync(0xffffffffu, s, 0);
        float inv = 1.f / s;
        __syncwarp();
        for (int i = lane; i < E; i += 32) sc[i] *= inv;
    }
    __syncwarp();
    for (int i = lane; i < E; i += 32) ch[i] = sc[i] + (bias ? bias[i] : 0.f);
    __syncwarp();
    if (n_group > 1) {
        int per = E / n_group;
        if (lane < n_group) {
            float a = -INFINITY, b = -INFINITY;
            for (int i = lane * per; i < (lane + 1) * per; i++) {
                float v = ch[i];
                if (v > a) {
                    b = a;
                    a = v;
                } else if (v > b) {
                    b = v;
                }
            }
            gsc[lane] = per >= 2 ? a + b : a;
        }
        __syncwarp();
        if (lane == 0) {
            for (int s = 0; s < topk_group; s++) {
                int best = -1;
                for (int g = 0; g < n_group; g++) {
                    bool taken = false;
                    for (int q = 0; q < s; q++) taken |= gkeep[q] == g;
                    if (taken) continue;
                    if (best < 0 || gsc[g] > gsc[best]) best = g;
                }
                gkeep[s] = best;
            }
        }
        __syncwarp();
        for (int i = lane; i < E; i += 32) {
            int g = i / per;
            bool kept = false;
            for (int q = 0; q < topk_group; q++) kept |= gkeep[q] == g;
            if (!kept) ch[i] = 0.f;
        }
        __syncwarp();
    }
    if (E <= 32 * 16 && k <= 32) {
        // The same selection with each lane's candidates and a taken mask in registers, the
        // slot-s winner kept by lane s (no shared-memory scans per round: a decode step's
        // routing is one warp's latency).
        float cv[16];
#pragma unroll
        for (int m = 0; m < 16; m++) cv[m] = lane + 32 * m < E ? ch[lane + 32 * m] : 0.f;
        u32 taken = 0;
        int mine = 0;
        for (int s = 0; s < k; s++) {
            float bv = -INFINITY;
            int bi = 0x7fffffff;
#pragma unroll
            for (int m = 0; m < 16; m++) {
                int i = lane + 32 * m;
                if (i < E && !((taken >> m) & 1u)) {
                    float v = cv[m];
                    if (bi == 0x7fffffff || v > bv) {
                        bv = v;
                        bi = i;
                    }
                }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                float ov = __shfl_xor_sync(0xffffffffu, bv, o);
                int oi = __shfl_xor_sync(0xffffffffu, bi, o);
                bool better = oi != 0x7fffffff &&
                              (bi == 0x7fffffff || ov > bv || (ov == bv && oi < bi));
                if (better) {
                    bv = ov;
                    bi = oi;
                }
            }
            if (bi != 0x7fffffff && (bi & 31) == lane) taken |= 1u << (bi >> 5);
            if (lane == s) mine = bi;
        }
        // Weights: the slot-order sum of the chosen scores (every lane adds them in order).
        float wv = lane < k ? sc[mine] : 0.f;
        float sum = 0.f;
        for (int s = 0; s < k; s++) sum += __shfl_sync(0xffffffffu, wv, s);
        if (sigmoid) sum += 1e-20f;
        if (lane < k) {
            float v = wv;
            if (norm) v /= sum;
            if (scale != 1.f) v *= scale;
            sel[t * k + lane] = mine;
            selw[t * k + lane] = v;
        }
        return;
    }
    for (int s = 0; s < k; s++) {
        float bv = -INFINITY;
        int bi = 0x7fffffff;
        for (int i = lane; i < E; i += 32) {
            bool taken = false;
            for (int q = 0; q < s; q++) taken |= chosen[q] == i;
            if (taken) continue;
            float v = ch[i];
            if (bi == 0x7fffffff || v > bv) {
                bv = v;
                bi = i;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            bool better = oi != 0x7fffffff &&
                          (bi == 0x7fffffff || ov > bv || (ov == bv && oi < bi));
            if (better) {
                bv = ov;
                bi = oi;
            }
        }
        if (lane == 0) chosen[s] = bi;
        __syncwarp();
    }
    if (lane == 0) {
        float w[64];
        float sum = 0.f;
        for (int s = 0; s < k; s++) {
            w[s] = sc[chosen[s]];
            sum += w[s];
        }
        if (sigmoid) sum += 1e-20f;
        for (int s = 0; s < k; s++) {
            float v = w[s];
            if (norm) v /= sum;
            if (scale != 1.f) v *= scale;
            sel[t * k + s] = chosen[s];
            selw[t * k + s] = v;
        }
    }
}

extern "C" __global__ void route(const float* logits, int E, int k, const float* bias,
                                 int sigmoid, int n_group, int topk_group, int norm, float scale,
                                 int* sel, float* selw) {
    extern __shared__ float rsh[];
    __shared__ float gsc[64];
    __shared__ int gkeep[64];
    __shared__ int chosen[64];
    route_warp(logits, E, k, bias, sigmoid, n_group, topk_group, norm, scale, sel, selw,
               blockIdx.x, threadIdx.x, rsh, rsh + E, gsc, gkeep, chosen);
}

// The job list of a MoE layer from the device's selection, in the host's order: experts in
// ascending index with at least one assignment, each expert's assignments by token then slot.
// etab: per expert its gate, up, down device pointers. One block of >= E threads (E <= 1024).
// build_block: the whole block builds it (any block size; jsh: 3*E ints of shared memory).
// Counts by shared atomics (all threads), offsets by thread 0, then warp 0 places the
// assignments 32 at a time in index order (lanes of one expert ranked by __match_any_sync), so
// each expert's assignments stay in ascending order, as a serial scan puts them.
__device__ void build_block(const int* sel, int n, int k, int E, const u64* etab, Job* jobs,
                            int* tok, int* dst, int* njobs, int* stat, int* jsh) {
    int* cnt = jsh;
    int* a0 = jsh + E;
    int* ji = jsh + 2 * E;
    int nk = n * k;
    for (int ex = threadIdx.x; ex < E; ex += blockDim.x) cnt[ex] = 0;
    __syncthreads();
    for (int a = threadIdx.x; a < nk; a += blockDim.x) atomicAdd(&cnt[sel[a]], 1);
    __syncthreads();
    // Exclusive prefix sums of the counts (a0) and of the non-empty experts (ji), blockDim
    // experts at a time: warp scans by shuffles, then across the warps (integers: the serial
    // scan's values).
    __shared__ int wsc[32], wsj[32];
    {
        int lane = threadIdx.x & 31, wp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
        int carry_a = 0, carry_j = 0;
        for (int base = 0; base < E; base += blockDim.x) {
            int ex = base + threadIdx.x;
            int c = ex < E ? cnt[ex] : 0, b = c > 0;
            int ic = c, ib = b;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                int tc = __shfl_up_sync(0xffffffffu, ic, o);
                int tb = __shfl_up_sync(0xffffffffu, ib, o);
                if (lane >= o) {
                    ic += tc;
                    ib += tb;
                }
            }
            if (lane == 31) {
                wsc[wp] = ic;
                wsj[wp] = ib;
            }
            __syncthreads();
            if (wp == 0) {
                int vc = lane < nw ? wsc[lane] : 0, vb = lane < nw ? wsj[lane] : 0;
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) {
                    int tc = __shfl_up_sync(0xffffffffu, vc, o);
                    int tb = __shfl_up_sync(0xffffffffu, vb, o);
                    if (lane >= o) {
                        vc += tc;
                        vb += tb;
                    }
                }
                if (lane < nw) {
                    wsc[lane] = vc;
                    wsj[lane] = vb;
                }
            }
            __syncthreads();
            if (ex < E) {
                a0[ex] = carry_a + (wp ? wsc[wp - 1] : 0) + ic - c;
                ji[ex] = carry_j + (wp ? wsj[wp - 1] : 0) + ib - b;
            }
            carry_a += wsc[nw - 1];
            carry_j += wsj[nw - 1];
            __syncthreads();
        }
        if (threadIdx.x == 0) {
            *njobs = carry_j;
            if (stat) *stat += carry_j;
        }
    }
    __syncthreads();
    for (int ex = threadIdx.x; ex < E; ex += blockDim.x) {
        if (cnt[ex] == 0) continue;
        Job jb;
        jb.gate = etab[3 * ex];
        jb.up = etab[3 * ex + 1];
        jb.down = etab[3 * ex + 2];
        jb.a0 = a0[ex];
        jb.cnt = cnt[ex];
        jobs[ji[ex]] = jb;
    }
    __syncthreads();
    // a0 becomes each expert's next free position.
    if (threadIdx.x < 32) {
        int lane = threadIdx.x;
        for (int c0 = 0; c0 < nk; c0 += 32) {
            int a = c0 + lane;
            bool valid = a < nk;
            int e = valid ? sel[a] : -1 - lane;  // past the end: a key no other lane has
            unsigned peers = __match_any_sync(0xffffffffu, e);
            int rank = __popc(peers & ((1u << lane) - 1u));
            int c = valid ? a0[e] + rank : 0;
            __syncwarp();
            if (valid) {
                tok[c] = a / k;
                dst[c] = a;
                if (rank == 0) a0[e] += __popc(peers);
            }
            __syncwarp();
        }
    }
}

extern "C" __global__ void build_jobs(const int* sel, int n, int k, int E, const u64* etab,
                                      Job* jobs, int* tok, int* dst, int* njobs, int* stat) {
    extern __shared__ int jsh[];
    build_block(sel, n, k, E, etab, jobs, tok, dst, njobs, stat, jsh);
}

// Cache rows for tokens 0..n at position *pp: row (*pp + t) of Dst (cols elements) = row t of
// Src (stride ss), stored as cache_put's h16 says (f32, f32 rounded to f16, or f16).
extern "C" __global__ void kv_store(const float* Src, int ss, void* Dst, int cols, const int* pp,
                                    int h16) {
    size_t row = (size_t)(*pp + blockIdx.x) * cols;
    void* d = h16 == 2 ? (void*)((u16*)Dst + row) : (void*)((float*)Dst + row);
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        cache_put(d, c, Src[(size_t)blockIdx.x * ss + c], h16);
}

// ---- Flash-decoding: attention of few tokens split over position chunks ------------------------
//
// Block (head hh, token t, split s) takes positions [s*chunk, min(len, (s+1)*chunk)) and writes
// its running max, sum of exponentials and unnormalised output to the partial buffers; the merge
// kernel combines the splits. Same layout arguments as `attention`. Grid: (heads, n, splits),
// block 128, shared (dk + chunk) floats.
// Positions per split for a context of len: the context spread over all S splits (so a long
// context keeps every split block busy and a short one few), at least 32 and a multiple of 16,
// at most `chunk` (the shared-memory size: chunk >= ctx / S >= len / S).
__device__ __forceinline__ int split_chunk(int len, int chunk, int S) {
    int c = (len + S - 1) / S;
    c = max(32, (c + 15) & ~15);
    return min(c, chunk);
}

extern "C" __global__ void attention_split(const float* Q, int qts, int qhs, const float* K,
                                           int ks, int khs, const float* V, int vs, int vhs,
                                           int dk, int dv, int group, const int* pp, int padd,
                                           float scale, int chunk, float* PM, float* PL,
                                           float* PO) {
    __shared__ float red[32];
    extern __shared__ float ash[];
    float* qsh = ash;
    float* sc = ash + dk;
    int hh = blockIdx.x, t = blockIdx.y, s = blockIdx.z, heads = gridDim.x, S = gridDim.z;
    int len = *pp + padd + t + 1;
    chunk = split_chunk(len, chunk, S);
    int j0 = s * chunk, j1 = min(len, j0 + chunk);
    size_t part = ((size_t)t * heads + hh) * S + s;
    float* po = PO + part * dv;
    if (j0 >= j1) {
        if (threadIdx.x == 0) {
            PM[part] = -INFINITY;
            PL[part] = 0.f;
        }
        return;
    }
    int g = hh / group;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const float* q = Q + (size_t)t * qts + (size_t)hh * qhs;
    for (int i = threadIdx.x; i < dk; i += blockDim.x) qsh[i] = q[i];
    __syncthreads();
    float mx = -INFINITY;
    for (int j = j0 + warp; j < j1; j += nw) {
        const float* kk = K + (size_t)j * ks + (size_t)g * khs;
        float v = 0.f;
        for (int i = lane; i < dk; i += 32) v += qsh[i] * kk[i];
        v = warp_sum(v) * scale;
        if (lane == 0) sc[j - j0] = v;
        mx = fmaxf(mx, v);
    }
    mx = block_max(mx, red);
    float sum = 0.f;
    for (int j = threadIdx.x; j < j1 - j0; j += blockDim.x) {
        float e = expf(sc[j] - mx);
        sc[j] = e;
        sum += e;
    }
    sum = block_sum(sum, red);
    const float* vb = V + (size_t)g * vhs;
    for (int d = threadIdx.x; d < dv; d += blockDim.x) {
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
        int j = j0;
        for (; j + 4 <= j1; j += 4) {
            a0 += sc[j - j0] * vb[(size_t)j * vs + d];
            a1 += sc[j + 1 - j0] * vb[(size_t)(j + 1) * vs + d];
            a2 += sc[j + 2 - j0] * vb[(size_t)(j + 2) * vs + d];
            a3 += sc[j + 3 - j0] * vb[(size_t)(j + 3) * vs + d];
        }
        for (; j < j1; j++) a0 += sc[j - j0] * vb[(size_t)j * vs + d];
        po[d] = (a0 + a1) + (a2 + a3);
    }
    if (threadIdx.x == 0) {
        PM[part] = mx;
        PL[part] = sum;
    }
}

// O[t*ots + hh*ohs + d] from the splits of attention_split. Grid: (heads, n), block 128.
extern "C" __global__ void attention_merge(const float* PM, const float* PL, const float* PO,
                                           int S, int dv, float* O, int ots, int ohs) {
    int hh = blockIdx.x, t = blockIdx.y, heads = gridDim.x;
    size_t base = ((size_t)t * heads + hh) * S;
    float m = -INFINITY;
    for (int s = 0; s < S; s++) m = fmaxf(m, PM[base + s]);
    float l = 0.f;
    for (int s = 0; s < S; s++)
        if (PL[base + s] > 0.f) l += PL[base + s] * expf(PM[base + s] - m);
    float inv = 1.f / l;
    float* o = O + (size_t)t * ots + (size_t)hh * ohs;
    for (int d = threadIdx.x; d < dv; d += blockDim.x) {
        float a = 0.f;
        for (int s = 0; s < S; s++)
            if (PL[base + s] > 0.f) a += PO[(base + s) * dv + d] * expf(PM[base + s] - m);
        o[d] = a * inv;
    }
}

// ==== prefill GEMM (tensor cores) ====
//
// Forwards of more than a few tokens (prefill) multiply on the tensor cores instead of one warp
// per weight row: a block takes a tile of GBM weight rows x GBN tokens and walks the inner
// dimension GBK values at a time. Each stage unpacks the weight tile's quantized blocks into
// shared memory as int8 codes with their per-16 scales and per-32 mins (a type's own layout:
// Q4_K/Q5_K codes 0..31 with d*sc and dmin*m, Q6_K codes q-32 with d*sc per 16, Q8_0 and Q4_0
// signed codes with d), copies the tokens' 8-bit activations (quantize_q8's XQ/XD, the same
// codes the matvec kernels and the CPU use), and multiplies with mma.sync m16n8k32 s8 -> s32
// (m16n8k16 twice for Q6_K, whose scales change every 16 values). The exact integer sum of one
// 32-value chunk is then scaled in f32: acc += (d_w * d_x) * S - m_w * (d_x * sum(x codes)),
// the matvec kernels' formula, so the GEMM differs from them only by f32 summation order.
// Every output element is summed over the chunks in index order, whatever tile it sits in, so
// results do not depend on which other tokens share an expert's tile.
//
// Grid: x = ceil(rows / GBM), y = ceil(tokens / GBN) (for experts: the most tokens any job can
// hold), z = jobs. Block: 128 threads (4 warps; warp w owns rows 16w..16w+15 of the tile and all
// GBN tokens). cols must be a multiple of GBK (gemm.rs checks; other shapes take the matvec path).

#define GBM 64
#define GBN 64
#define GBK 128
#define GLD (GBK + 16)  // bytes per shared row: rows 16 bytes apart mod 128 spread the banks
#define GTHREADS 128

// unpack(blk, j, q, d, m): the 32 codes of chunk j of a block as 8 words of 4 int8, the scales
// of its two 16-value halves, and its min coefficient (value = d * code - m).
struct GQ4_K {
    enum { BE = 256, BB = 144, HALF = 0 };
    static __device__ __forceinline__ void unpack(const u8* b, int j, u32* q, float* d, float& m) {
        float dd = h2f(ld16(b)), dmin = h2f(ld16(b + 2));
        int sc, mn;
        k_scale_min(b + 4, j, sc, mn);
        d[0] = d[1] = dd * (float)sc;
        m = dmin * (float)mn;
        const u32* qs = (const u32*)(b + 16 + 32 * (j >> 1));
        int sh = 4 * (j & 1);
#pragma unroll
        for (int w = 0; w < 8; w++) q[w] = (qs[w] >> sh) & 0x0f0f0f0fu;
    }
};
struct GQ5_K {
    enum { BE = 256, BB = 176, HALF = 0 };
    static __device__ __forceinline__ void unpack(const u8* b, int j, u32* q, float* d, float& m) {
        float dd = h2f(ld16(b)), dmin = h2f(ld16(b + 2));
        int sc, mn;
        k_scale_min(b + 4, j, sc, mn);
        d[0] = d[1] = dd * (float)sc;
        m = dmin * (float)mn;
        const u32* qh = (const u32*)(b + 16);
        const u32* qs = (const u32*)(b + 48 + 32 * (j >> 1));
        int sh = 4 * (j & 1);
#pragma unroll
        for (int w = 0; w < 8; w++)
            q[w] = ((qs[w] >> sh) & 0x0f0f0f0fu) | (((qh[w] >> j) & 0x01010101u) << 4);
    }
};
struct GQ6_K {
    enum { BE = 256, BB = 210, HALF = 1 };
    static __device__ __forceinline__ void unpack(const u8* b, int j, u32* q, float* d, float& m) {
        float dd = h2f(ld16(b + 208));
        d[0] = dd * (float)(i8)b[192 + 2 * j];
        d[1] = dd * (float)(i8)b[192 + 2 * j + 1];
        m = 0.f;
        int h = j >> 2, p = j & 3;  // 128-value half, 32-value quarter within it
        const u8* ql = b + 64 * h + 32 * (p & 1);
        const u8* qh = b + 128 + 32 * h;
        int lsh = p >= 2 ? 4 : 0, hsh = 2 * p;
#pragma unroll
        for (int w = 0; w < 8; w++) {
            u32 l = (u32)ld2x16(ql + 4 * w), hh = (u32)ld2x16(qh + 4 * w);
            u32 c = ((l >> lsh) & 0x0f0f0f0fu) | (((hh >> hsh) & 0x03030303u) << 4);
            q[w] = __vsub4(c, 0x20202020u);
        }
    }
};
struct GQ8_0 {
    enum { BE = 32, BB = 34, HALF = 0 };
    static __device__ __forceinline__ void unpack(const u8* b, int, u32* q, float* d, float& m) {
        d[0] = d[1] = h2f(ld16(b));
        m = 0.f;
#pragma unroll
        for (int w = 0; w < 8; w++) q[w] = (u32)ld2x16(b + 2 + 4 * w);
    }
};
struct GQ4_0 {
    enum { BE = 32, BB = 18, HALF = 0 };
    static __device__ __forceinline__ void unpack(const u8* b, int, u32* q, float* d, float& m) {
        d[0] = d[1] = h2f(ld16(b));
        m = 0.f;
#pragma unroll
        for (int w = 0; w < 4; w++) {
            u32 v = (u32)ld2x16(b + 2 + 4 * w);
            q[w] = __vsub4(v & 0x0f0f0f0fu, 0x08080808u);
            q[w + 4] = __vsub4((v >> 4) & 0x0f0f0f0fu, 0x08080808u);
        }
    }
};

__device__ __forceinline__ void mma_k32(int* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%10,%10,%10};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(0));
}
__device__ __forceinline__ void mma_k16(int* c, u32 a0, u32 a1, u32 b0) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
        "{%7,%7,%7,%7};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a0), "r"(a1), "r"(b0), "r"(0));
}

// One tile of Y = W X^T for job j: W rows row0.., the job's tokens tile0.. of a0..a0+cnt. Token
// slot a reads activation row xrow[a] (or a) and writes output row yrow[a] (or a) at stride ldy.
// NM = 2 (gate and up, written as silu(gate) * up) or 1.
template <class T, int NM>
__device__ void gemm_tile(const u8* W0, const u8* W1, long long rb, int rows, int cols,
                          const i8* XQ, const float* XD, int a0, int cnt, const int* xrow,
                          const int* yrow, float* Y, int ldy) {
    __shared__ __align__(16) u8 sw[NM][GBM][GLD];
    __shared__ float ssc[NM][GBM][2 * GBK / 32];
    __shared__ float smn[NM][GBM][GBK / 32];
    __shared__ __align__(16) u8 sx[GBN][GLD];
    __shared__ float sxd[GBN][GBK / 32];
    __shared__ float sxu[GBN][GBK / 32];
    const int row0 = blockIdx.x * GBM, tile0 = blockIdx.y * GBN;
    if (tile0 >= cnt) return;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int gid = lane >> 2, t4 = lane & 3;
    const int wr = 16 * warp + gid;  // this thread's first tile row (and wr + 8)
    const int per = T::BE / 32;
    float acc[NM][GBN / 8][4];
#pragma unroll
    for (int m = 0; m < NM; m++)
#pragma unroll
        for (int nt = 0; nt < GBN / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[m][nt][e] = 0.f;

    for (int k0 = 0; k0 < cols; k0 += GBK) {
        // Weights: NM x GBM rows x GBK/32 chunks, a chunk per thread per step.
        for (int i = tid; i < NM * GBM * (GBK / 32); i += GTHREADS) {
            int m = i / (GBM * (GBK / 32)), r = (i / (GBK / 32)) % GBM, c = i % (GBK / 32);
            u32 q[8];
            float d[2] = {0.f, 0.f}, mn = 0.f;
            int row = row0 + r;
            if (row < rows) {
                int cg = k0 / 32 + c;
                const u8* blk = (m ? W1 : W0) + (size_t)row * rb + (size_t)(cg / per) * T::BB;
                T::unpack(blk, cg % per, q, d, mn);
            } else {
#pragma unroll
                for (int w = 0; w < 8; w++) q[w] = 0;
            }
            uint4* dst = (uint4*)&sw[m][r][32 * c];
            dst[0] = make_uint4(q[0], q[1], q[2], q[3]);
            dst[1] = make_uint4(q[4], q[5], q[6], q[7]);
            ssc[m][r][2 * c] = d[0];
            ssc[m][r][2 * c + 1] = d[1];
            smn[m][r][c] = mn;
        }
        // Activations: GBN tokens x GBK/32 chunks, with d_x and d_x * (sum of the codes).
        for (int i = tid; i < GBN * (GBK / 32); i += GTHREADS) {
            int t = i / (GBK / 32), c = i % (GBK / 32);
            int4 v0 = make_int4(0, 0, 0, 0), v1 = v0;
            float dx = 0.f;
            if (tile0 + t < cnt) {
                int a = a0 + tile0 + t;
                size_t xr = xrow ? (size_t)xrow[a] : (size_t)a;
                const int4* src = (const int4*)(XQ + xr * cols + k0 + 32 * c);
                v0 = src[0];
                v1 = src[1];
                dx = XD[xr * (cols >> 5) + (k0 >> 5) + c];
            }
            int u = dp4(ONES, v0.x, dp4(ONES, v0.y, dp4(ONES, v0.z, dp4(ONES, v0.w, 0))));
            u = dp4(ONES, v1.x, dp4(ONES, v1.y, dp4(ONES, v1.z, dp4(ONES, v1.w, u))));
            int4* dst = (int4*)&sx[t][32 * c];
            dst[0] = v0;
            dst[1] = v1;
            sxd[t][c] = dx;
            sxu[t][c] = dx * (float)u;
        }
        __syncthreads();
#pragma unroll
        for (int c = 0; c < GBK / 32; c++) {
            const int kc = 32 * c + 4 * t4;
#pragma unroll
            for (int m = 0; m < NM; m++) {
                u32 a0r = *(const u32*)&sw[m][wr][kc];
                u32 a1r = *(const u32*)&sw[m][wr + 8][kc];
                u32 a2r = *(const u32*)&sw[m][wr][kc + 16];
                u32 a3r = *(const u32*)&sw[m][wr + 8][kc + 16];
                float dl0 = ssc[m][wr][2 * c], dh0 = ssc[m][wr][2 * c + 1], m0 = smn[m][wr][c];
                float dl1 = ssc[m][wr + 8][2 * c], dh1 = ssc[m][wr + 8][2 * c + 1];
                float m1 = smn[m][wr + 8][c];
#pragma unroll
                for (int nt = 0; nt < GBN / 8; nt++) {
                    if (8 * nt >= cnt - tile0) break;  // no token of the job left (warp-uniform)
                    const int col = 8 * nt + gid;
                    u32 b0 = *(const u32*)&sx[col][kc];
                    u32 b1 = *(const u32*)&sx[col][kc + 16];
                    const int tA = 8 * nt + 2 * t4;  // this thread's output tokens tA, tA + 1
                    float xa = sxd[tA][c], xb = sxd[tA + 1][c];
                    float* o = acc[m][nt];
                    if (T::HALF) {
                        int lo[4], hi[4];
                        mma_k16(lo, a0r, a1r, b0);
                        mma_k16(hi, a2r, a3r, b1);
                        o[0] += xa * (dl0 * (float)lo[0] + dh0 * (float)hi[0]);
                        o[1] += xb * (dl0 * (float)lo[1] + dh0 * (float)hi[1]);
                        o[2] += xa * (dl1 * (float)lo[2] + dh1 * (float)hi[2]);
                        o[3] += xb * (dl1 * (float)lo[3] + dh1 * (float)hi[3]);
                    } else {
                        int s[4];
                        mma_k32(s, a0r, a1r, a2r, a3r, b0, b1);
                        float ua = sxu[tA][c], ub = sxu[tA + 1][c];
                        o[0] += (dl0 * xa) * (float)s[0] - m0 * ua;
                        o[1] += (dl0 * xb) * (float)s[1] - m0 * ub;
                        o[2] += (dl1 * xa) * (float)s[2] - m1 * ua;
                        o[3] += (dl1 * xb) * (float)s[3] - m1 * ub;
                    }
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int nt = 0; nt < GBN / 8; nt++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int t = 8 * nt + 2 * t4 + (e & 1);
            int row = row0 + wr + 8 * (e >> 1);
            if (tile0 + t >= cnt || row >= rows) continue;
            int a = a0 + tile0 + t;
            size_t yr = yrow ? (size_t)yrow[a] : (size_t)a;
            float v = NM == 2 ? silu(acc[0][nt][e]) * acc[NM - 1][nt][e] : acc[0][nt][e];
            Y[yr * ldy + row] = v;
        }
    }
}

// The three entry points take the matvec kernels' arguments (mmq_*, moe_gate_up_q_*,
// moe_down_q_*), so a call site changes only its kernel and grid.
#define GEMM_KERNELS(NAME, T)                                                                     \
    extern "C" __global__ void __launch_bounds__(GTHREADS)                                        \
        gemm_##NAME(const u8* W, long long rb, int rows, int cols, const i8* XQ, const float* XD,  \
                    int n, float* Y, int ldy) {                                                   \
        gemm_tile<T, 1>(W, W, rb, rows, cols, XQ, XD, 0, n, nullptr, nullptr, Y, ldy);            \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(GTHREADS)                                        \
        moe_gemm_gate_up_##NAME(const Job* jobs, const int* nj, int f, int h, long long rb,        \
                                const i8* XQ, const float* XD, const int* tok, float* Hb) {       \
        if (nj && (int)blockIdx.z >= *nj) return;                                                 \
        Job j = jobs[blockIdx.z];                                                                 \
        gemm_tile<T, 2>((const u8*)j.gate, (const u8*)j.up, rb, f, h, XQ, XD, j.a0, j.cnt, tok,   \
                        nullptr, Hb, f);                                                          \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(GTHREADS)                                        \
        moe_gemm_down_##NAME(const Job* jobs, const int* nj, int h, int f, long long rb,           \
                             const i8* XQ, const float* XD, const int* dst, float* SO) {          \
        if (nj && (int)blockIdx.z >= *nj) return;                                                 \
        Job j = jobs[blockIdx.z];                                                                 \
        gemm_tile<T, 1>((const u8*)j.down, (const u8*)j.down, rb, h, f, XQ, XD, j.a0, j.cnt,      \
                        nullptr, dst, SO, h);                                                     \
    }

GEMM_KERNELS(q4_k, GQ4_K)
GEMM_KERNELS(q5_k, GQ5_K)
GEMM_KERNELS(q6_k, GQ6_K)
GEMM_KERNELS(q8_0, GQ8_0)
GEMM_KERNELS(q4_0, GQ4_0)
