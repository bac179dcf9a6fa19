// ==== Prompt attention on tensor cores (an f16 KV cache) ====
//
// `attention_tiled` runs the scores and the weighted sum on f32 FMA units: ~13 TFLOP/s, so a
// 512-token prompt at 16k of context spent ~85% of its time there (docs/PERFORMANCE.md, session
// 32). With an f16 cache (-ctk f16 -ctv f16: every stored key and value is an f16 number, as in
// llama.cpp's default) the products can run on the tensor cores with the keys and values exact:
// `mma.sync.m16n8k16` with f16 inputs and f32 accumulators. What rounds, as in llama.cpp's
// flash attention: each query (once, to f16) and each probability before the weighted sum (to
// f16); the softmax (running max, sum, rescale) is f32.
//
// Block: 4 warps, 64 queries of one head (16 per warp); keys and values in tiles of 64 through
// shared memory as f16 (converted once per block from an f32 cache, copied from an f16 one). Per warp and tile: S = Q K^T
// in 8 fragments of 16 x 8, the online softmax on them in registers, O += P V with P taken from
// S's registers as the A operand (the m16n8 accumulator layout of two key fragments is the
// m16k16 operand layout) and V's fragments by `ldmatrix.trans`. Causal: query t sees keys
// 0 ..= *pp + padd + t; a warp skips tiles wholly after its last query. Grid: (heads,
// ceil(n / 64)), block 128. D = dk = dv, a multiple of 16 (instantiated for 16, 32, 64, 128);
// Q and O rows 8-byte aligned (float2), K and V rows 16-byte aligned.
#define MQ 64   // queries per block (16 per warp)
#define MK 64   // keys per tile

__device__ __forceinline__ u32 pack_h2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Cache element types: `float` (an f32 cache rounded to f16 values) or `u16` (f16 storage: half
// the bytes per key and value).
// Rows k0 .. k0 + MK of the keys and values (row strides ks, vs, in elements of T) into shared
// memory as f16 rows of SR halves, rows at or past `lim` zero. Each thread's loads are issued
// together (up to 8 16-byte loads of each matrix) before any store: a store to shared memory
// between two loads through generic pointers would make each load wait for the one before.
template <int D, int SR, typename T>
__device__ __forceinline__ void kv_tile(const T* kb, int ks, const T* vb, int vs, int k0, int lim,
                                        u16* Ks, u16* Vs) {
    constexpr int E = 16 / sizeof(T);  // elements per 16-byte load
    constexpr int C = D / E, N = MK * C / 128, B = N < 8 ? N : 8;
    const int tid = threadIdx.x;
#pragma unroll
    for (int b0 = 0; b0 < N; b0 += B) {
        uint4 a[B], b[B];
#pragma unroll
        for (int u = 0; u < B; u++) {
            int i = tid + 128 * (b0 + u), r = i / C, c = i % C, j = k0 + r;
            a[u] = b[u] = make_uint4(0u, 0u, 0u, 0u);
            if (j < lim) {
                a[u] = ((const uint4*)(kb + (size_t)j * ks))[c];
                b[u] = ((const uint4*)(vb + (size_t)j * vs))[c];
            }
        }
#pragma unroll
        for (int u = 0; u < B; u++) {
            int i = tid + 128 * (b0 + u), r = i / C, c = i % C;
            if constexpr (E == 8) {
                *(uint4*)(Ks + r * SR + 8 * c) = a[u];
                *(uint4*)(Vs + r * SR + 8 * c) = b[u];
            } else {
                const float4 x = *(const float4*)&a[u], y = *(const float4*)&b[u];
                *(uint2*)(Ks + r * SR + 4 * c) = make_uint2(pack_h2(x.x, x.y), pack_h2(x.z, x.w));
                *(uint2*)(Vs + r * SR + 4 * c) = make_uint2(pack_h2(y.x, y.y), pack_h2(y.z, y.w));
            }
        }
    }
}

// One online-softmax step of a warp's rows r0 (accumulator elements 0, 1) and r1 (2, 3) over F
// score fragments in log2 units, t0 / t1 this thread's maxima of them: the rows' maxima across
// the quad, the rescale factors of what was summed before (al0, al1), the scores replaced by
// their exponentials, and this thread's part of each row sum (l0, l1) updated.
template <int F>
__device__ __forceinline__ void softmax_step(float (&sc)[F][4], float t0, float t1, float& m0,
                                             float& m1, float& l0, float& l1, float& al0,
                                             float& al1) {
    t0 = fmaxf(t0, __shfl_xor_sync(0xffffffffu, t0, 1));
    t0 = fmaxf(t0, __shfl_xor_sync(0xffffffffu, t0, 2));
    t1 = fmaxf(t1, __shfl_xor_sync(0xffffffffu, t1, 1));
    t1 = fmaxf(t1, __shfl_xor_sync(0xffffffffu, t1, 2));
    float n0 = fmaxf(m0, t0), n1 = fmaxf(m1, t1);
    al0 = exp2f(m0 - n0);
    al1 = exp2f(m1 - n1);
    m0 = n0;
    m1 = n1;
    float s0 = 0.f, s1 = 0.f;
#pragma unroll
    for (int f = 0; f < F; f++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            float a = exp2f(sc[f][e] - n0), b = exp2f(sc[f][2 + e] - n1);
            sc[f][e] = a;
            sc[f][2 + e] = b;
            s0 += a;
            s1 += b;
        }
    }
    l0 = l0 * al0 + s0;  // this lane's part of the row sum (the quad's added at the end)
    l1 = l1 * al1 + s1;
}

template <int D, typename T>
__device__ __forceinline__ void attention_mma_body(const float* Q, int qts, int qhs,
                                                   const T* K, int ks, int khs,
                                                   const T* V, int vs, int vhs, int group,
                                                   const int* pp, int padd, float scale, int n,
                                                   float* O, int ots, int ohs) {
    constexpr int SR = D + 8;  // shared row stride in halves: 16-byte rows, 4 banks apart
    __shared__ __align__(16) u16 Ks[MK * SR];
    __shared__ __align__(16) u16 Vs[MK * SR];
    const int hh = blockIdx.x, q0 = blockIdx.y * MQ, tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31, gr = lane >> 2, tq = lane & 3;
    const int kvh = hh / group, pos0 = *pp + padd;
    const int nq = min(MQ, n - q0);
    const int kend = pos0 + q0 + nq;  // keys 0 .. kend - 1 for the block
    // This warp's rows: queries q0 + 16 warp + gr (accumulator elements 0, 1) and + 8 (2, 3).
    const int r0 = q0 + warp * 16 + gr, r1 = r0 + 8;
    const int lim0 = pos0 + min(r0, n - 1), lim1 = pos0 + min(r1, n - 1);
    const int wlast = pos0 + min(q0 + warp * 16 + 15, n - 1);  // the warp's last visible key
    // Q fragments (A operand, row-major 16 x 16 per k step), converted once.
    u32 qa[D / 16][4];
#pragma unroll
    for (int s = 0; s < D / 16; s++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int c = s * 16 + h * 8 + 2 * tq;
            float2 x0 = r0 < n ? *(const float2*)(Q + (size_t)r0 * qts + (size_t)hh * qhs + c)
                               : make_float2(0.f, 0.f);
            float2 x1 = r1 < n ? *(const float2*)(Q + (size_t)r1 * qts + (size_t)hh * qhs + c)
                               : make_float2(0.f, 0.f);
            qa[s][2 * h] = pack_h2(x0.x, x0.y);
            qa[s][2 * h + 1] = pack_h2(x1.x, x1.y);
        }
    }
    float o[D / 8][4];
#pragma unroll
    for (int d = 0; d < D / 8; d++) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
    const float sl2 = scale * 1.4426950408889634f;  // scores in log2 units
    for (int k0 = 0; k0 < kend; k0 += MK) {
        __syncthreads();  // the previous tile's readers are done
        kv_tile<D, SR>(K + (size_t)kvh * khs, ks, V + (size_t)kvh * vhs, vs, k0, kend, Ks, Vs);
        __syncthreads();
        if (k0 > wlast) continue;  // every key of the tile is after this warp's queries
        // S = Q K^T: 8 fragments of 16 queries x 8 keys.
        float sc[MK / 8][4];
#pragma unroll
        for (int f = 0; f < MK / 8; f++) {
            sc[f][0] = sc[f][1] = sc[f][2] = sc[f][3] = 0.f;
            const u16* kr = Ks + (f * 8 + gr) * SR + 2 * tq;
#pragma unroll
            for (int s = 0; s < D / 16; s++) {
                u32 b0 = *(const u32*)(kr + s * 16), b1 = *(const u32*)(kr + s * 16 + 8);
                mma16816(sc[f], qa[s], b0, b1);
            }
        }
        // Online softmax per row (this thread: 2 keys of each fragment in rows r0 and r1; the
        // row's other keys are in the quad's other 3 lanes).
        const bool mask = k0 + MK - 1 > pos0 + q0 + warp * 16;  // some key after some query
        float t0 = -INFINITY, t1 = -INFINITY;
#pragma unroll
        for (int f = 0; f < MK / 8; f++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                int j = k0 + f * 8 + 2 * tq + e;
                float a = sc[f][e] * sl2, b = sc[f][2 + e] * sl2;
                if (mask) {
                    a = j <= lim0 ? a : -INFINITY;
                    b = j <= lim1 ? b : -INFINITY;
                }
                sc[f][e] = a;
                sc[f][2 + e] = b;
                t0 = fmaxf(t0, a);
                t1 = fmaxf(t1, b);
            }
        }
        // Key 0 is in every row's first tile, so a row's max is finite from there on.
        float al0, al1;  // 0 on the first tile
        softmax_step<MK / 8>(sc, t0, t1, m0, m1, l0, l1, al0, al1);
#pragma unroll
        for (int d = 0; d < D / 8; d++) {
            o[d][0] *= al0;
            o[d][1] *= al0;
            o[d][2] *= al1;
            o[d][3] *= al1;
        }
        // O += P V, 16 keys per step: P's A operand is two S fragments' registers.
#pragma unroll
        for (int s = 0; s < MK / 16; s++) {
            u32 pa[4] = {pack_h2(sc[2 * s][0], sc[2 * s][1]), pack_h2(sc[2 * s][2], sc[2 * s][3]),
                         pack_h2(sc[2 * s + 1][0], sc[2 * s + 1][1]),
                         pack_h2(sc[2 * s + 1][2], sc[2 * s + 1][3])};
            // Lanes 0-15 address key rows s*16 + lane of dim block d, lanes 16-31 of d + 1.
            const u16* vrow = Vs + (s * 16 + (lane & 15)) * SR + (lane >> 4) * 8;
#pragma unroll
            for (int d = 0; d < D / 8; d += 2) {
                u32 b0, b1, b2, b3;
                unsigned addr = (unsigned)__cvta_generic_to_shared(vrow + d * 8);
                asm volatile(
                    "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                    : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3)
                    : "r"(addr));
                mma16816(o[d], pa, b0, b1);
                mma16816(o[d + 1], pa, b2, b3);
            }
        }
    }
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    float i0 = 1.f / l0, i1 = 1.f / l1;
#pragma unroll
    for (int d = 0; d < D / 8; d++) {
        int c = d * 8 + 2 * tq;
        if (r0 < n)
            *(float2*)(O + (size_t)r0 * ots + (size_t)hh * ohs + c) =
                make_float2(o[d][0] * i0, o[d][1] * i0);
        if (r1 < n)
            *(float2*)(O + (size_t)r1 * ots + (size_t)hh * ohs + c) =
                make_float2(o[d][2] * i1, o[d][3] * i1);
    }
}

// attention_mma_<D> reads an f32 cache (f16 values), attention_mma_h_<D> an f16 one.
#define ATTENTION_MMA(NAME, D, T)                                                               \
    extern "C" __global__ void __launch_bounds__(128) NAME(                                     \
        const float* Q, int qts, int qhs, const T* K, int ks, int khs, const T* V, int vs,      \
        int vhs, int group, const int* pp, int padd, float scale, int n, float* O, int ots,     \
        int ohs) {                                                                              \
        attention_mma_body<D>(Q, qts, qhs, K, ks, khs, V, vs, vhs, group, pp, padd, scale, n,   \
                              O, ots, ohs);                                                     \
    }
ATTENTION_MMA(attention_mma_16, 16, float)
ATTENTION_MMA(attention_mma_32, 32, float)
ATTENTION_MMA(attention_mma_64, 64, float)
ATTENTION_MMA(attention_mma_128, 128, float)
ATTENTION_MMA(attention_mma_h_16, 16, u16)
ATTENTION_MMA(attention_mma_h_32, 32, u16)
ATTENTION_MMA(attention_mma_h_64, 64, u16)
ATTENTION_MMA(attention_mma_h_128, 128, u16)

// Lane `lane` of a warp holding 32 consecutive output values (c the value's column, a multiple
// of 32 at lane 0) quantizes its value v into row t of XQ / XD as quantize_q8 does.
__device__ __forceinline__ void quantize_lane(float v, i8* XQ, float* XD, int t, int cols, int c,
                                              int lane) {
    float am = fabsf(v);
#pragma unroll
    for (int q = 16; q > 0; q >>= 1) am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, q));
    float dq = am / 127.f;
    float id = dq > 0.f ? 1.f / dq : 0.f;
    XQ[(size_t)t * cols + c] = (i8)max(-127, min(127, (int)roundf(v * id)));
    if (lane == 0) XD[(size_t)t * (cols >> 5) + (c >> 5)] = dq;
}

// ==== Decode attention on tensor cores: flash-decoding with a key/value head's query heads ====
//
// attention_split_merge gives every query head its own block, so the 8 query heads of a
// Qwen3-30B-A3B key/value head read each key and value row 8 times (through L2); at 16k of
// context that was ~110 us per layer (docs/PERFORMANCE.md, session 32). Here a block takes key/
// value head g, token t and split s, with the group's G query heads (G <= 16) as the rows of one
// m16n8k16 A operand: each key and value row is read once per group. Keys and values go through
// shared memory in tiles of 64 as f16 (exact for an f16 cache), each warp takes 16 keys of a tile
// with its own online softmax (rows = heads; the token's keys are the same for every row, so
// one mask), and the 4 warps' (max, sum, unnormalized output) are combined at the end into the
// split's partial (max in natural-log units, as attention_split's). The last split block of
// (t, g) merges every head of the group, a warp per head (quantized as merge_head when XQ).
// What rounds: each query (to f16) and each probability before the weighted sum, as the prompt
// kernel. Splits are whole tiles of keys where they can be (at least MK positions, at least
// minc from 16 * minc on), so a token of at most MK positions (every token of a short context)
// has one split: its block writes the output itself (the merge's sums over one split, bit for
// bit) and no block counts or merges.
// done: heads*n zeroed counters (left zeroed). Grid: (kv heads, n, splits <= MAX_DEC_SPLITS),
// block 128.
#define MAX_DEC_SPLITS 128  // gpu/model.rs keeps splits <= 128 (dec_splits_max)
template <int D, typename T>
__device__ __forceinline__ void attention_mma_dec_body(
    const float* Q, int qts, int qhs, const T* K, int ks, int khs, const T* V, int vs,
    int vhs, int group, const int* pp, int padd, float scale, int chunk, int minc, float* PM,
    float* PL, float* PO, float* O, int ots, int ohs, i8* XQ, float* XD, unsigned* done) {
    constexpr int SR = D + 8;
    __shared__ __align__(16) u16 KVs[2 * MK * SR];  // keys then values; the merge reuses it
    __shared__ float Wm[4][16], Wl[4][16];
    __shared__ float Wsp[16][MAX_DEC_SPLITS];  // split weights per head in the merge
    __shared__ float Winv[16];
    u16* Ks = KVs;
    u16* Vs = KVs + MK * SR;
    const int g = blockIdx.x, t = blockIdx.y, s = blockIdx.z, S = gridDim.z;
    const int G = group, heads = gridDim.x * G, tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31, gr = lane >> 2, tq = lane & 3;
    const int len = *pp + padd + t + 1;
    // From 16 * minc positions on, splits of at least minc (a multiple of MK): fewer, longer
    // splits leave less to merge, which at 4096 positions costs more than the blocks they would
    // keep busy; at 1024 and 2048 the 64-key splits were faster (measured on an H100:
    // docs/PERFORMANCE.md, session 37).
    const int lo = len >= 16 * minc ? minc : MK;
    chunk = max(min(max(MK, ((len + S - 1) / S + 15) & ~15), chunk), lo);
    const int S_act = min(S, (len + chunk - 1) / chunk), cols = heads * D;
    const bool direct = S_act == 1;  // one split: its block writes the output
    const int j0 = s * chunk, j1 = min(len, j0 + chunk);
    const T* kb = K + (size_t)g * khs;
    const T* vb = V + (size_t)g * vhs;
    if (pdl_on)
        for (int j = j0 + warp; j < j1; j += 4) {
            prefetch_l2(kb + (size_t)j * ks, sizeof(T) * D);
            prefetch_l2(vb + (size_t)j * vs, sizeof(T) * D);
        }
    pdl_wait();
    pdl_go();
    // A split past the token's length (the trailing splits of a short one) computes nothing
    // and writes no partial: the merge reads only the first S_act splits.
    if (j0 < j1) {
        // Rows gr and gr + 8 are heads g*G + gr and g*G + gr + 8 (zero queries past G).
        const int r0 = gr, r1 = gr + 8;
        u32 qa[D / 16][4];
#pragma unroll
        for (int k = 0; k < D / 16; k++) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int c = k * 16 + h * 8 + 2 * tq;
                const float* qt = Q + (size_t)t * qts + (size_t)(g * G) * qhs + c;
                float2 x0 = r0 < G ? *(const float2*)(qt + (size_t)r0 * qhs) : make_float2(0.f, 0.f);
                float2 x1 = r1 < G ? *(const float2*)(qt + (size_t)r1 * qhs) : make_float2(0.f, 0.f);
                qa[k][2 * h] = pack_h2(x0.x, x0.y);
                qa[k][2 * h + 1] = pack_h2(x1.x, x1.y);
            }
        }
        float o[D / 8][4];
#pragma unroll
        for (int d = 0; d < D / 8; d++) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
        float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
        const float sl2 = scale * 1.4426950408889634f;  // scores in log2 units
        for (int k0 = j0; k0 < j1; k0 += MK) {
            __syncthreads();  // the previous tile's readers are done
            kv_tile<D, SR>(kb, ks, vb, vs, k0, j1, Ks, Vs);
            __syncthreads();
            const int kw = k0 + 16 * warp;  // this warp's 16 keys
            if (kw >= j1) continue;
            float sc[2][4];
#pragma unroll
            for (int f = 0; f < 2; f++) {
                sc[f][0] = sc[f][1] = sc[f][2] = sc[f][3] = 0.f;
                const u16* kr = Ks + (16 * warp + f * 8 + gr) * SR + 2 * tq;
#pragma unroll
                for (int k = 0; k < D / 16; k++) {
                    u32 b0 = *(const u32*)(kr + k * 16), b1 = *(const u32*)(kr + k * 16 + 8);
                    mma16816(sc[f], qa[k], b0, b1);
                }
            }
            float t0 = -INFINITY, t1 = -INFINITY;
#pragma unroll
            for (int f = 0; f < 2; f++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    bool in = kw + f * 8 + 2 * tq + e < j1;
                    float a = in ? sc[f][e] * sl2 : -INFINITY, b = in ? sc[f][2 + e] * sl2 : -INFINITY;
                    sc[f][e] = a;
                    sc[f][2 + e] = b;
                    t0 = fmaxf(t0, a);
                    t1 = fmaxf(t1, b);
                }
            }
            // Key kw < j1 is in this warp's share, so both maxima are finite.
            float al0, al1;  // 0 on the warp's first keys
            softmax_step<2>(sc, t0, t1, m0, m1, l0, l1, al0, al1);
            u32 pa[4] = {pack_h2(sc[0][0], sc[0][1]), pack_h2(sc[0][2], sc[0][3]),
                         pack_h2(sc[1][0], sc[1][1]), pack_h2(sc[1][2], sc[1][3])};
            const u16* vrow = Vs + (16 * warp + (lane & 15)) * SR + (lane >> 4) * 8;
#pragma unroll
            for (int d = 0; d < D / 8; d += 2) {
                o[d][0] *= al0;
                o[d][1] *= al0;
                o[d][2] *= al1;
                o[d][3] *= al1;
                o[d + 1][0] *= al0;
                o[d + 1][1] *= al0;
                o[d + 1][2] *= al1;
                o[d + 1][3] *= al1;
                u32 b0, b1, b2, b3;
                unsigned addr = (unsigned)__cvta_generic_to_shared(vrow + d * 8);
                asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                             : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3)
                             : "r"(addr));
                mma16816(o[d], pa, b0, b1);
                mma16816(o[d + 1], pa, b2, b3);
            }
        }
        // The 4 warps' states -> the split's partial per head (max in natural-log units).
        l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
        l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
        __syncthreads();  // the last tile's readers are done: KVs holds the warps' outputs now
        float* Wo = (float*)KVs;  // [warp][row 16][D]: 4 * 16 * D floats <= 2 * MK * SR halves
        if (tq == 0) {
            Wm[warp][r0] = m0;
            Wm[warp][r1] = m1;
            Wl[warp][r0] = l0;
            Wl[warp][r1] = l1;
        }
#pragma unroll
        for (int d = 0; d < D / 8; d++) {
            int c = d * 8 + 2 * tq;
            *(float2*)(Wo + (warp * 16 + r0) * D + c) = make_float2(o[d][0], o[d][1]);
            *(float2*)(Wo + (warp * 16 + r1) * D + c) = make_float2(o[d][2], o[d][3]);
        }
        __syncthreads();
        for (int i = tid; i < G * D; i += 128) {
            int r = i / D, c = i % D;
            float m = fmaxf(fmaxf(Wm[0][r], Wm[1][r]), fmaxf(Wm[2][r], Wm[3][r]));
            float l = 0.f, a = 0.f;
            if (m > -INFINITY)
#pragma unroll
                for (int w = 0; w < 4; w++) {
                    float f = exp2f(Wm[w][r] - m);  // 0 for a warp that had no keys
                    l += Wl[w][r] * f;
                    a += Wo[(w * 16 + r) * D + c] * f;
                }
            if (direct) {
                // The merge of one split: weight expf(0) = 1, so a * (1 / l) as it computes.
                const float v = a * (1.f / l);
                const int h = g * G + r;
                O[(size_t)t * ots + (size_t)h * ohs + c] = v;
                if (XQ) quantize_lane(v, XQ, XD, t, cols, h * D + c, lane);
                continue;
            }
            size_t part = ((size_t)t * heads + g * G + r) * S + s;
            PO[part * D + c] = a;
            if (c == 0) {
                PM[part] = m > -INFINITY ? m * 0.6931471805599453f : -INFINITY;
                PL[part] = l;
            }
        }
    }
    if (direct || !last_block(done + (size_t)t * heads + g, S)) return;
    // The group's heads merged by the whole block: first each head's split weights (a warp per
    // head, merge_head's max and sums) into shared memory, then every thread 4 consecutive
    // outputs at once, the splits' partials loaded 16 at a time (one warp per head summing 64
    // splits one after another spent ~20 us per layer waiting on chains of loads). Each output
    // is still merge_head's sum over the splits in order, times the same 1 / l: the same bits.
    for (int r = warp; r < G; r += 4) {
        size_t base = ((size_t)t * heads + g * G + r) * S;
        float m = -INFINITY;
        for (int i = lane; i < S_act; i += 32) m = fmaxf(m, PM[base + i]);
#pragma unroll
        for (int q = 16; q > 0; q >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, q));
        float l = 0.f;
        for (int i = lane; i < S_act; i += 32) {
            float p = PL[base + i], w = p > 0.f ? expf(PM[base + i] - m) : 0.f;
            Wsp[r][i] = w;
            l += p * w;
        }
        l = warp_sum(l);
        if (lane == 0) Winv[r] = 1.f / l;
    }
    __syncthreads();
    // G * D / 4 outputs-of-4 (G * D a multiple of 32 when XQ: dv % 32 == 0): 8 lanes hold one
    // 32-value block of the quantized row. Every lane of a warp runs the loop's iterations
    // (the shuffles are warp-wide); those past the end compute nothing.
    const int n4 = G * D / 4;
    for (int i0 = 0; i0 < n4; i0 += 128) {
        const int i = i0 + tid;
        const bool act = i < n4;
        const int r = act ? 4 * i / D : 0, c = act ? 4 * i % D : 0, h = g * G + r;
        const float4* p = (const float4*)(PO + ((size_t)t * heads + h) * S * D + c);
        const float* wr = Wsp[r];
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
        if (act) {
#pragma unroll 16
            for (int q = 0; q < S_act; q++) {
                const float4 x = p[(size_t)q * (D / 4)];
                const float w = wr[q];
                a.x += x.x * w;
                a.y += x.y * w;
                a.z += x.z * w;
                a.w += x.w * w;
            }
        }
        const float inv = Winv[r];
        const float v[4] = {a.x * inv, a.y * inv, a.z * inv, a.w * inv};
        if (act) {
            float* o = O + (size_t)t * ots + (size_t)h * ohs + c;
#pragma unroll
            for (int e = 0; e < 4; e++) o[e] = v[e];
        }
        if (XQ) {
            float am = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
            for (int q = 4; q > 0; q >>= 1) am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, q));
            if (act) {
                const float dq = am / 127.f;
                const float id = dq > 0.f ? 1.f / dq : 0.f;
                const int col = h * D + c;
#pragma unroll
                for (int e = 0; e < 4; e++)
                    XQ[(size_t)t * cols + col + e] = (i8)max(-127, min(127, (int)roundf(v[e] * id)));
                if ((lane & 7) == 0) XD[(size_t)t * (cols >> 5) + (col >> 5)] = dq;
            }
        }
    }
}

// attention_mma_dec_<D> reads an f32 cache (f16 values), attention_mma_dec_h_<D> an f16 one.
#define ATTENTION_MMA_DEC(NAME, D, T)                                                           \
    extern "C" __global__ void __launch_bounds__(128) NAME(                                     \
        const float* Q, int qts, int qhs, const T* K, int ks, int khs, const T* V, int vs,      \
        int vhs, int group, const int* pp, int padd, float scale, int chunk, int minc,          \
        float* PM, float* PL, float* PO, float* O, int ots, int ohs, i8* XQ, float* XD,         \
        unsigned* done) {                                                                       \
        attention_mma_dec_body<D>(Q, qts, qhs, K, ks, khs, V, vs, vhs, group, pp, padd, scale,  \
                                  chunk, minc, PM, PL, PO, O, ots, ohs, XQ, XD, done);          \
    }
ATTENTION_MMA_DEC(attention_mma_dec_16, 16, float)
ATTENTION_MMA_DEC(attention_mma_dec_32, 32, float)
ATTENTION_MMA_DEC(attention_mma_dec_64, 64, float)
ATTENTION_MMA_DEC(attention_mma_dec_128, 128, float)
ATTENTION_MMA_DEC(attention_mma_dec_h_16, 16, u16)
ATTENTION_MMA_DEC(attention_mma_dec_h_32, 32, u16)
ATTENTION_MMA_DEC(attention_mma_dec_h_64, 64, u16)
ATTENTION_MMA_DEC(attention_mma_dec_h_128, 128, u16)
