// ==== Fused kernels for the decode step (issue 15) ====
//
// Each kernel here does the work of two to six of kernels.cu's, with the same arithmetic on each
// value (the same expressions in the same order, the same reductions over the same thread
// layout), so a forward gives the same numbers through either path (logits byte-identical with
// SLUICE_GPU_FUSED=0). A decode step of the 8-layer Qwen3-30B-A3B shape went from 220 launches
// to 75; replayed as a CUDA graph that saved only ~3% (docs/PERFORMANCE.md): what remains is
// each kernel's own latency.

// Row values tid + BD*j (j < J) of x (+ P) (+ the slots' combine) into xv, and of w into wv,
// every load in flight at once (the combine 4 slots at a time for all J values, each value's
// slots still summed in slot order). Each value's operations do not depend on BD.
template <int J, int BD>
__device__ __forceinline__ void add_rows_regs(const float* x, const float* P, const float* SO,
                                              const float* selw, int k, const float* w, int dim,
                                              int row, float* xv, float* wv) {
    const int tid = threadIdx.x;
#pragma unroll
    for (int j = 0; j < J; j++) {
        int i = min(tid + BD * j, dim - 1);
        float v = x[i];
        if (P) v += P[(size_t)row * dim + i];
        xv[j] = v;
        wv[j] = w[i];
    }
    if (SO) {
        float acc[J];
#pragma unroll
        for (int j = 0; j < J; j++) acc[j] = 0.f;
        for (int q0 = 0; q0 < k; q0 += 4) {
            float sv[4][J], sw[4];
#pragma unroll
            for (int qq = 0; qq < 4; qq++) {
                int q = min(q0 + qq, k - 1);
                sw[qq] = selw[row * k + q];
#pragma unroll
                for (int j = 0; j < J; j++)
                    sv[qq][j] = SO[((size_t)row * k + q) * dim + min(tid + BD * j, dim - 1)];
            }
#pragma unroll
            for (int qq = 0; qq < 4; qq++)
                if (q0 + qq < k)
#pragma unroll
                    for (int j = 0; j < J; j++) acc[j] += sw[qq] * sv[qq][j];
        }
#pragma unroll
        for (int j = 0; j < J; j++) xv[j] += acc[j];
    }
}

// y = xv * inv * wv for this thread's values tid + BD*j and, if XQ, their 8-bit quantization
// per 32 values (group g = warp + (BD/32)*j holds values 32g + lane = tid + BD*j: this
// thread's own), as quantize_q8.
template <int J, int BD>
__device__ __forceinline__ void norm_q8_store(const float* xv, const float* wv, float inv, int dim,
                                              float* y, i8* XQ, float* XD, int row) {
    const int tid = threadIdx.x;
    if (!XQ) {
#pragma unroll
        for (int j = 0; j < J; j++) {
            int i = tid + BD * j;
            if (i < dim) y[i] = xv[j] * inv * wv[j];
        }
        return;
    }
    int wp = tid >> 5, lane = tid & 31, per = dim >> 5;
#pragma unroll
    for (int j = 0; j < J; j++) {
        int g = wp + (BD / 32) * j;
        if (g < per) {
            int i = 32 * g + lane;
            float v = xv[j] * inv * wv[j];
            y[i] = v;
            float a = fabsf(v);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
            float d = a / 127.f;
            float id = d > 0.f ? 1.f / d : 0.f;
            int q = (int)roundf(v * id);
            XQ[(size_t)row * dim + i] = (i8)max(-127, min(127, q));
            if (lane == 0) XD[(size_t)row * per + g] = d;
        }
    }
}

// Residual add (optional), RMSNorm and 8-bit quantization of one row per block (256 threads):
//   x = X row (+ P row, if P) (+ sum over slots s of selw[s] * SO[row*k + s], if SO; in slot
//   order, as moe_combine), written back to X when anything was added;
//   Y row = x / rms(x) * w; and, if XQ, Y row quantized per 32 values into XQ/XD (as quantize_q8;
//   dim a multiple of 32).
// Same sums as add + moe_combine + rmsnorm + quantize_q8 (block of 256, as rmsnorm's launch).
//
// A decode step runs 17 of these on one block each, so what they cost is latency: a row of up to
// 256*J values is read into registers first (every load of the row, its addends and its weights
// in flight at once), then written back and summed in the same order as the loop below, so the
// numbers are the loop's. The loop serves wider rows.
template <int J>
__device__ __forceinline__ void add_rmsnorm_q8_regs(float* x, const float* P, const float* SO,
                                                    const float* selw, int k, const float* w,
                                                    int dim, float eps, float* y, i8* XQ,
                                                    float* XD, int row, float* red) {
    float xv[J], wv[J];
    const int tid = threadIdx.x, bd = 256;
    add_rows_regs<J, 256>(x, P, SO, selw, k, w, dim, row, xv, wv);
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < J; j++) {
        int i = tid + bd * j;
        if (i < dim) {
            if (P || SO) x[i] = xv[j];
            s += xv[j] * xv[j];
        }
    }
    s = block_sum(s, red);
    float inv = 1.f / sqrtf(s / (float)dim + eps);
    norm_q8_store<J, 256>(xv, wv, inv, dim, y, XQ, XD, row);
}

extern "C" __global__ void add_rmsnorm_q8(float* X, int ldx, const float* P, const float* SO,
                                          const float* selw, int k, const float* w, int dim,
                                          float eps, float* Y, int ldy, i8* XQ, float* XD) {
    __shared__ float red[32];
    pdl_wait();
    pdl_go();
    int row = blockIdx.x;
    if (blockDim.x == 256 && dim <= 256 * 16) {
        float* x = X + (size_t)row * ldx;
        float* y = Y + (size_t)row * ldy;
        if (dim <= 256 * 8)
            add_rmsnorm_q8_regs<8>(x, P, SO, selw, k, w, dim, eps, y, XQ, XD, row, red);
        else
            add_rmsnorm_q8_regs<16>(x, P, SO, selw, k, w, dim, eps, y, XQ, XD, row, red);
        return;
    }
    float* x = X + (size_t)row * ldx;
    float* y = Y + (size_t)row * ldy;
    float s = 0.f;
#pragma unroll 4
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = x[i];
        if (P) v += P[(size_t)row * dim + i];
        if (SO) {
            float acc = 0.f;
            for (int q = 0; q < k; q++)
                acc += selw[row * k + q] * SO[((size_t)row * k + q) * dim + i];
            v += acc;
        }
        if (P || SO) x[i] = v;
        s += v * v;
    }
    s = block_sum(s, red);  // its barriers make every x[i] visible to the block
    float inv = 1.f / sqrtf(s / (float)dim + eps);
    if (!XQ) {
#pragma unroll 4
        for (int i = threadIdx.x; i < dim; i += blockDim.x) y[i] = x[i] * inv * w[i];
        return;
    }
    int wp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5, per = dim >> 5;
#pragma unroll 4
    for (int g = wp; g < per; g += nw) {
        int i = 32 * g + lane;
        float v = x[i] * inv * w[i];
        y[i] = v;
        float a = fabsf(v);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
        float d = a / 127.f;
        float id = d > 0.f ? 1.f / d : 0.f;
        int q = (int)roundf(v * id);
        XQ[(size_t)row * dim + i] = (i8)max(-127, min(127, q));
        if (lane == 0) XD[(size_t)row * per + g] = d;
    }
}

// add_rmsnorm_q8 on 1024 threads for rows of up to 4096 values (a decode step's 17 launches of
// it are latency: at 256 threads a warp spent ~20 cycles per instruction waiting, Nsight Compute
// session 38). Four times the warps to hide the waits, a quarter of the values each. Every
// value's operations are add_rmsnorm_q8_regs' (the same expressions in the same order), and the
// sum of squares is made in the 256-thread order: thread t < 256 sums values t, t + 256, .. (from
// shared memory), then block_sum's warp sums and warp partials of those eight warps in order. So
// each output has add_rmsnorm_q8's bits (SLUICE_GPU_NORM_WIDE=0 launches that one instead).
template <int J>
__device__ __forceinline__ void add_rmsnorm_q8_wide_regs(float* x, const float* P, const float* SO,
                                                         const float* selw, int k, const float* w,
                                                         int dim, float eps, float* y, i8* XQ,
                                                         float* XD, int row, float* red,
                                                         float* xs) {
    float xv[J], wv[J];
    const int tid = threadIdx.x, bd = 1024;
    add_rows_regs<J, 1024>(x, P, SO, selw, k, w, dim, row, xv, wv);
#pragma unroll
    for (int j = 0; j < J; j++) {
        int i = tid + bd * j;
        if (i < dim) {
            if (P || SO) x[i] = xv[j];
            xs[i] = xv[j];
        }
    }
    __syncthreads();
    int wp = tid >> 5, lane = tid & 31;
    float s = 0.f;
    if (tid < 256)
        for (int i = tid; i < dim; i += 256) s += xs[i] * xs[i];
    s = warp_sum(s);
    if (lane == 0 && wp < 8) red[wp] = s;
    __syncthreads();
    float t = 0.f;
    for (int q = 0; q < 8; q++) t += red[q];
    float inv = 1.f / sqrtf(t / (float)dim + eps);
    norm_q8_store<J, 1024>(xv, wv, inv, dim, y, XQ, XD, row);
}

// Arguments as add_rmsnorm_q8; blocks of 1024 threads, dim <= 4096.
extern "C" __global__ void __launch_bounds__(1024)
    add_rmsnorm_q8_w(float* X, int ldx, const float* P, const float* SO, const float* selw, int k,
                     const float* w, int dim, float eps, float* Y, int ldy, i8* XQ, float* XD) {
    __shared__ float red[32];
    __shared__ float xs[4096];
    pdl_wait();
    pdl_go();
    int row = blockIdx.x;
    float* x = X + (size_t)row * ldx;
    float* y = Y + (size_t)row * ldy;
    if (dim <= 1024)
        add_rmsnorm_q8_wide_regs<1>(x, P, SO, selw, k, w, dim, eps, y, XQ, XD, row, red, xs);
    else if (dim <= 2048)
        add_rmsnorm_q8_wide_regs<2>(x, P, SO, selw, k, w, dim, eps, y, XQ, XD, row, red, xs);
    else
        add_rmsnorm_q8_wide_regs<4>(x, P, SO, selw, k, w, dim, eps, y, XQ, XD, row, red, xs);
}

// Up to three matrices of one quantized type and width against the same quantized input, in
// one launch: blocks [0, b1) take matrix 0's rows, [b1, b2) matrix 1's, the rest matrix 2's
// (b1, b2 in blocks of WARPS rows). Each row as mmq computes it.
template <class T, int NTT = NT>
__device__ void mmq3(const u8* W0, long long rb0, int rows0, float* Y0, int ldy0, const u8* W1,
                     long long rb1, int rows1, float* Y1, int ldy1, const u8* W2, long long rb2,
                     int rows2, float* Y2, int ldy2, int cols, const i8* XQ, const float* XD,
                     int n) {
    int b = blockIdx.x;
    int b1 = (rows0 + WARPS - 1) / WARPS, b2 = b1 + (rows1 + WARPS - 1) / WARPS;
    const u8* W = W0;
    long long rb = rb0;
    int rows = rows0, ldy = ldy0;
    float* Y = Y0;
    if (b >= b2) {
        W = W2, rb = rb2, rows = rows2, Y = Y2, ldy = ldy2, b -= b2;
    } else if (b >= b1) {
        W = W1, rb = rb1, rows = rows1, Y = Y1, ldy = ldy1, b -= b1;
    }
    int r = b * WARPS + (threadIdx.x >> 5);
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

#define MMQ3_KERNEL(NAME, T)                                                                      \
    extern "C" __global__ void mmq3_##NAME(                                                       \
        const u8* W0, long long rb0, int rows0, float* Y0, int ldy0, const u8* W1, long long rb1, \
        int rows1, float* Y1, int ldy1, const u8* W2, long long rb2, int rows2, float* Y2,        \
        int ldy2, int cols, const i8* XQ, const float* XD, int n) {                               \
        mmq3<T>(W0, rb0, rows0, Y0, ldy0, W1, rb1, rows1, Y1, ldy1, W2, rb2, rows2, Y2, ldy2,     \
                cols, XQ, XD, n);                                                                 \
    }

MMQ3_KERNEL(q4_k, QQ4_K)
MMQ3_KERNEL(q5_k, QQ5_K)
MMQ3_KERNEL(q6_k, QQ6_K)
MMQ3_KERNEL(q8_0, QQ8_0)
MMQ3_KERNEL(q4_0, QQ4_0)

#define MMQ3_T1_KERNEL(NAME, T, SFX, LB)                                                                   \
    extern "C" __global__ void LB mmq3_##NAME##SFX(                                                  \
        const u8* W0, long long rb0, int rows0, float* Y0, int ldy0, const u8* W1, long long rb1, \
        int rows1, float* Y1, int ldy1, const u8* W2, long long rb2, int rows2, float* Y2,        \
        int ldy2, int cols, const i8* XQ, const float* XD, int n) {                               \
        mmq3<T, 1>(W0, rb0, rows0, Y0, ldy0, W1, rb1, rows1, Y1, ldy1, W2, rb2, rows2, Y2, ldy2,  \
                   cols, XQ, XD, n);                                                              \
    }
MMQ3_T1_KERNEL(q4_k, QQ4_K, _t1, __launch_bounds__(256, 6))
MMQ3_T1_KERNEL(q4_k, QQ4_K, _t1n, )
MMQ3_T1_KERNEL(q5_k, QQ5_K, _t1, __launch_bounds__(256, 6))
MMQ3_T1_KERNEL(q5_k, QQ5_K, _t1n, )
MMQ3_T1_KERNEL(q6_k, QQ6_K, _t1, __launch_bounds__(256, 6))
MMQ3_T1_KERNEL(q6_k, QQ6_K, _t1n, )
MMQ3_T1_KERNEL(q8_0, QQ8_0, _t1, __launch_bounds__(256, 6))
MMQ3_T1_KERNEL(q8_0, QQ8_0, _t1n, )
MMQ3_T1_KERNEL(q4_0, QQ4_0, _t1, __launch_bounds__(256, 6))
MMQ3_T1_KERNEL(q4_0, QQ4_0, _t1n, )

// Between the q/k/v projections and attention, per head: optional RMSNorm of each q and k head
// (qn / kn: hd weights; as rmsnorm over hd-wide parts), rotary embedding of the first 2*half
// values (as rope, position *rp + rpadd + t), the head written back, and k and v heads stored in
// the cache layer at position *pp + t (as kv_store; keys rounded to f16 when h16 & 1, values when
// h16 & 2; both stored as f16 when h16 & 4). Grid: (n, heads + 2*kv_heads): q heads, then k heads, then v heads. Block 256
// (rmsnorm's), shared hd floats; hd <= 256.
extern "C" __global__ void qk_rope_store(float* Q, int qts, float* K, int kts, const float* V,
                                         int vts, int heads, int kvh, int hd, const float* qn,
                                         const float* kn, float eps, int half, int layout,
                                         const float* cosT, const float* sinT, const int* rp,
                                         int rpadd, const int* pp, void* KC, void* VC,
                                         int h16) {
    __shared__ float red[32];
    extern __shared__ float hsh[];
    pdl_wait();
    pdl_go();
    int t = blockIdx.x, hh = blockIdx.y, i = threadIdx.x;
    int cols = kvh * hd;
    size_t pos = (size_t)(*pp + t);
    const int hk = h16 & 4 ? 2 : h16 & 1, hv = h16 & 4 ? 2 : (h16 >> 1) & 1;  // cache_put's
    if (hh >= heads + kvh) {
        int g = hh - heads - kvh;
        if (i < hd) {
            float v = V[(size_t)t * vts + g * hd + i];
            cache_put(hv == 2 ? (void*)((u16*)VC + pos * cols) : (void*)((float*)VC + pos * cols),
                      g * hd + i, v, hv);
        }
        return;
    }
    bool isk = hh >= heads;
    int g = isk ? hh - heads : hh;
    float* x = isk ? K + (size_t)t * kts + g * hd : Q + (size_t)t * qts + g * hd;
    const float* nw = isk ? kn : qn;
    float v = i < hd ? x[i] : 0.f;
    if (nw) {
        float s = block_sum(i < hd ? v * v : 0.f, red);
        float inv = 1.f / sqrtf(s / (float)hd + eps);
        if (i < hd) v = v * inv * nw[i];
    }
    if (i < hd) hsh[i] = v;
    __syncthreads();
    int rpos = *rp + rpadd + t;
    const float* c = cosT + (size_t)rpos * half;
    const float* sn = sinT + (size_t)rpos * half;
    if (i < hd) {
        float o = v;
        if (i < 2 * half) {
            int p = layout == 0 ? (i < half ? i : i - half) : i >> 1;
            bool first = layout == 0 ? i < half : (i & 1) == 0;
            int ia = layout == 0 ? p : 2 * p;
            int ib = layout == 0 ? p + half : 2 * p + 1;
            float a = hsh[ia], b = hsh[ib];
            o = first ? a * c[p] - b * sn[p] : b * c[p] + a * sn[p];
        }
        x[i] = o;
        if (isk)
            cache_put(hk == 2 ? (void*)((u16*)KC + pos * cols) : (void*)((float*)KC + pos * cols),
                      g * hd + i, o, hk);
    }
}

// attention_merge of head hh, token t (block of 128), then, if XQ, the output rows quantized per
// 32 values (as quantize_q8) into XQ/XD (row stride heads*dv: O packed, ohs == dv, dv a multiple
// of 32). Splits S_act..S are empty (max -inf, sum 0) and skipped: the same sums as
// attention_merge's over all S.
__device__ void merge_head(const float* PM, const float* PL, const float* PO, int S, int S_act,
                           int dv, float* O, int ots, int ohs, i8* XQ, float* XD, int hh, int t,
                           int heads) {
    size_t base = ((size_t)t * heads + hh) * S;
    float m = -INFINITY;
    for (int s = 0; s < S_act; s++) m = fmaxf(m, PM[base + s]);
    float l = 0.f;
    for (int s = 0; s < S_act; s++)
        if (PL[base + s] > 0.f) l += PL[base + s] * expf(PM[base + s] - m);
    float inv = 1.f / l;
    float* o = O + (size_t)t * ots + (size_t)hh * ohs;
    int cols = heads * dv, lane = threadIdx.x & 31;
    for (int d = threadIdx.x; d < dv; d += blockDim.x) {
        float a = 0.f;
#pragma unroll 8
        for (int s = 0; s < S_act; s++)
            if (PL[base + s] > 0.f) a += PO[(base + s) * dv + d] * expf(PM[base + s] - m);
        float v = a * inv;
        o[d] = v;
        if (!XQ) continue;
        float am = fabsf(v);
#pragma unroll
        for (int q = 16; q > 0; q >>= 1) am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, q));
        float dq = am / 127.f;
        float id = dq > 0.f ? 1.f / dq : 0.f;
        int qv = (int)roundf(v * id);
        int c = hh * dv + d;
        XQ[(size_t)t * cols + c] = (i8)max(-127, min(127, qv));
        if (lane == 0) XD[(size_t)t * (cols >> 5) + (c >> 5)] = dq;
    }
}

// Grid-wide hand-off to the block that finishes last: every block of a group calls it once, at
// its end; it returns true in the group's last block (which then sees every other block's
// global writes, fenced before the count) and rearms the counter for the next launch.
__device__ __forceinline__ bool last_block(unsigned* done, unsigned blocks) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned prev = atomicAdd(done, 1u);
        last = prev == blocks - 1;
        if (last) *done = 0;
    }
    __syncthreads();
    if (last) __threadfence();
    return last;
}

// attention_split (same arguments, same arithmetic), and the last split block of each (head,
// token) merges them (merge_head; quantized when XQ). done: heads*n zeroed counters (left
// zeroed). Grid: (heads, n, splits), block 128, shared (dk + chunk) floats.
extern "C" __global__ void attention_split_merge(
    const float* Q, int qts, int qhs, const float* K, int ks, int khs, const float* V, int vs,
    int vhs, int dk, int dv, int group, const int* pp, int padd, float scale, int chunk,
    float* PM, float* PL, float* PO, float* O, int ots, int ohs, i8* XQ, float* XD,
    unsigned* done) {
    __shared__ float red[32];
    extern __shared__ float ash[];
    float* qsh = ash;
    float* sc = ash + dk;
    int hh = blockIdx.x, t = blockIdx.y, s = blockIdx.z, heads = gridDim.x, S = gridDim.z;
    // *pp comes from the host before the step; the keys and values of earlier positions are
    // read-only here: the split's rows start on their way to L2 before the wait (the last
    // position's, which the kernel before stores, may be fetched early: L2 is coherent).
    int len = *pp + padd + t + 1;
    chunk = split_chunk(len, chunk, S);
    int j0 = s * chunk, j1 = min(len, j0 + chunk);
    if (pdl_on && hh % group == 0)
        for (int j = j0 + (threadIdx.x >> 5); j < j1; j += blockDim.x >> 5) {
            prefetch_l2(K + (size_t)j * ks + (size_t)(hh / group) * khs, 4 * dk);
            prefetch_l2(V + (size_t)j * vs + (size_t)(hh / group) * vhs, 4 * dv);
        }
    pdl_wait();
    pdl_go();
    size_t part = ((size_t)t * heads + hh) * S + s;
    float* po = PO + part * dv;
    if (j0 >= j1) {
        if (threadIdx.x == 0) {
            PM[part] = -INFINITY;
            PL[part] = 0.f;
        }
    } else {
        int g = hh / group;
        int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
        const float* q = Q + (size_t)t * qts + (size_t)hh * qhs;
        for (int i = threadIdx.x; i < dk; i += blockDim.x) qsh[i] = q[i];
        __syncthreads();
        float mx = -INFINITY;
        // Four keys per warp pass (their loads in flight together), each summed as alone.
        int j = j0 + warp;
        for (; j + 3 * nw < j1; j += 4 * nw) {
            const float* kk = K + (size_t)j * ks + (size_t)g * khs;
            size_t st = (size_t)nw * ks;
            float v0 = 0.f, v1 = 0.f, v2 = 0.f, v3 = 0.f;
            for (int i = lane; i < dk; i += 32) {
                float qv = qsh[i];
                v0 += qv * kk[i];
                v1 += qv * kk[st + i];
                v2 += qv * kk[2 * st + i];
                v3 += qv * kk[3 * st + i];
            }
            v0 = warp_sum(v0) * scale;
            v1 = warp_sum(v1) * scale;
            v2 = warp_sum(v2) * scale;
            v3 = warp_sum(v3) * scale;
            if (lane == 0) {
                sc[j - j0] = v0;
                sc[j + nw - j0] = v1;
                sc[j + 2 * nw - j0] = v2;
                sc[j + 3 * nw - j0] = v3;
            }
            mx = fmaxf(fmaxf(mx, fmaxf(v0, v1)), fmaxf(v2, v3));
        }
        for (; j < j1; j += nw) {
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
    if (!last_block(done + (size_t)t * heads + hh, S)) return;
    merge_head(PM, PL, PO, S, min(S, (len + chunk - 1) / chunk), dv, O, ots, ohs, XQ, XD, hh, t,
               heads);
}

// Flash-decoding with the query heads of one key/value head together (grouped-query attention):
// attention_split_merge reads each key and value row once per query head (8 times for
// Qwen3-30B-A3B's 32 / 4 heads); here a block takes kv head g, token t and split s for all G =
// group query heads, so a row is read once. Keys and values go through shared memory in tiles of
// 32 positions (coalesced float4 loads, the next tile's in flight while this one is used), with
// an online softmax per head (running max and sum, the accumulators rescaled when the max
// grows). Scores: thread (lane = key, warp = head); values: thread (d = tid % 128, heads
// tid / 128 + 2i). The split's partial (max, sum, unnormalized output) per head is written as
// attention_split writes it, and the last split block of (t, g) merges every head of the group
// (merge_head; quantized when XQ). Other sums than attention_split (each score is one thread's
// sequential dot, the values accumulate per tile): both the fused and the unfused path call this
// kernel, so they stay identical. G <= 8, dk <= 128 and dv <= 128 multiples of 4, rows 16-byte
// aligned (else attention_split_merge). done: heads*n zeroed counters (left zeroed). Grid: (kv
// heads, n, splits), block 256; shared 4 * (G*(dk+4) + 32*(dk+4) + 32*dv + G*33 + G) bytes.
#define GT 32
extern "C" __global__ void __launch_bounds__(256, 2) attention_group_split_merge(
    const float* Q, int qts, int qhs, const float* K, int ks, int khs, const float* V, int vs,
    int vhs, int dk, int dv, int group, const int* pp, int padd, float scale, int chunk,
    float* PM, float* PL, float* PO, float* O, int ots, int ohs, i8* XQ, float* XD,
    unsigned* done) {
    extern __shared__ float4 gsh4[];
    const int G = group, sk = dk + 4, tid = threadIdx.x, lane = tid & 31, wp = tid >> 5;
    float* qs = (float*)gsh4;          // G x sk
    float* Ks = qs + G * sk;           // GT x sk
    float* Vs = Ks + GT * sk;          // GT x dv
    float* Ss = Vs + GT * dv;          // G x (GT + 1)
    float* Al = Ss + G * (GT + 1);     // G: this tile's rescale factor
    int g = blockIdx.x, t = blockIdx.y, s = blockIdx.z, S = gridDim.z;
    int kvh = gridDim.x, heads = kvh * G;
    int len = *pp + padd + t + 1;
    chunk = split_chunk(len, chunk, S);
    int j0 = s * chunk, j1 = min(len, j0 + chunk);
    const float* kb = K + (size_t)g * khs;
    const float* vb = V + (size_t)g * vhs;
    for (int j = j0 + wp; j < j1; j += 8) {
        prefetch_l2(kb + (size_t)j * ks, 4 * dk);
        prefetch_l2(vb + (size_t)j * vs, 4 * dv);
    }
    pdl_wait();
    pdl_go();
    const int dk4 = dk >> 2, dv4 = dv >> 2;
    for (int i = tid; i < G * dk4; i += 256) {
        int h = i / dk4, c = i % dk4;
        ((float4*)(qs + h * sk))[c] =
            ((const float4*)(Q + (size_t)t * qts + (size_t)(g * G + h) * qhs))[c];
    }
    // This thread's share of a tile: float4 number i = tid + 256u of the GT x dk4 keys and of
    // the GT x dv4 values (u < 4: dk4, dv4 <= 32).
    float4 kr[4], vr[4];
    auto load = [&](int k0) {
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int i = tid + 256 * u;
            float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
            int rk = i / dk4, ck = i % dk4, rv = i / dv4, cv = i % dv4;
            kr[u] = rk < GT && k0 + rk < j1
                        ? ((const float4*)(kb + (size_t)(k0 + rk) * ks))[ck]
                        : z;
            vr[u] = rv < GT && k0 + rv < j1
                        ? ((const float4*)(vb + (size_t)(k0 + rv) * vs))[cv]
                        : z;
        }
    };
    const int vd = tid & 127, vh0 = tid >> 7;  // value column, first head (then + 2, + 4, + 6)
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    float mrun = -INFINITY, lrun = 0.f;  // head wp's (warps < G), kept by every lane
    if (j0 < j1) load(j0);
    for (int k0 = j0; k0 < j1; k0 += GT) {
        __syncthreads();  // the previous tile's readers (and the q rows' writers) are done
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int i = tid + 256 * u;
            int rk = i / dk4, ck = i % dk4, rv = i / dv4, cv = i % dv4;
            if (rk < GT) ((float4*)(Ks + rk * sk))[ck] = kr[u];
            if (rv < GT) ((float4*)(Vs + rv * dv))[cv] = vr[u];
        }
        __syncthreads();
        if (k0 + GT < j1) load(k0 + GT);
        const int nk = min(GT, j1 - k0);
        if (wp < G) {
            // Score of key `lane` for head wp, then the head's online-softmax step by the warp.
            float sc = -INFINITY;
            if (lane < nk) {
                const float4* kk = (const float4*)(Ks + lane * sk);
                const float4* qq = (const float4*)(qs + wp * sk);
                float a = 0.f;
                for (int c = 0; c < dk4; c++) {
                    float4 x = qq[c], y = kk[c];
                    a += x.x * y.x + x.y * y.y + x.z * y.z + x.w * y.w;
                }
                sc = a * scale;
            }
            float mt = sc;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
            float mnew = fmaxf(mrun, mt);
            float alpha = expf(mrun - mnew);  // 0 on the first tile
            float p = lane < nk ? expf(sc - mnew) : 0.f;
            Ss[wp * (GT + 1) + lane] = p;
            lrun = lrun * alpha + warp_sum(p);
            mrun = mnew;
            if (lane == 0) Al[wp] = alpha;
        }
        __syncthreads();
        if (vd < dv) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int h = vh0 + 2 * i;
                if (h < G) {
                    const float* pr = Ss + h * (GT + 1);
                    float a = acc[i] * Al[h];
                    for (int j = 0; j < nk; j++) a += pr[j] * Vs[j * dv + vd];
                    acc[i] = a;
                }
            }
        }
    }
    // The split's partial per head, as attention_split leaves it.
    if (wp < G && lane == 0) {
        size_t part = ((size_t)t * heads + g * G + wp) * S + s;
        PM[part] = j0 < j1 ? mrun : -INFINITY;
        PL[part] = j0 < j1 ? lrun : 0.f;
    }
    if (vd < dv && j0 < j1)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int h = vh0 + 2 * i;
            if (h < G) PO[(((size_t)t * heads + g * G + h) * S + s) * dv + vd] = acc[i];
        }
    if (!last_block(done + (size_t)t * heads + g, S)) return;
    for (int h = 0; h < G; h++)
        merge_head(PM, PL, PO, S, min(S, (len + chunk - 1) / chunk), dv, O, ots, ohs, XQ, XD,
                   g * G + h, t, heads);
}
#undef GT

// route + build_jobs in one block for a few tokens: warp w routes tokens w, w + nw, ... (each in
// its own scratch, as `route`; nw = min(n, warps)), then the block builds the job list (as
// `build_jobs`). Shared: nw * (2E + 192) words for routing, then 3E ints.
// 1 with SLUICE_GPU_JOBS1=1 (driver.rs sets it at load): a one-token step's job list by the
// routing warp alone (route_jobs_block).
__constant__ int jobs1_on;

__device__ void route_jobs_block(const float* logits, int n, int E, int k, const float* bias,
                                 int sigmoid, int n_group, int topk_group, int norm, float scale,
                                 int* sel, float* selw, const u64* etab, Job* jobs, int* tok,
                                 int* dst, int* njobs, int* stat) {
    extern __shared__ float rjs[];
    int wp = threadIdx.x >> 5, lane = threadIdx.x & 31, rw = min(n, (int)(blockDim.x >> 5));
    float* mine = rjs + (size_t)wp * (2 * E + 192);
    if (jobs1_on && n == 1 && k <= 32) {
        // One token's k experts are distinct, so build_block's list is: the experts in
        // ascending index (job i = the expert of rank i among the k), each one assignment
        // (a0 = rank, cnt 1, token 0, destination slot = its slot). Warp 0 writes it from the
        // selection it just made, without the block's count / scan / place passes.
        if (wp == 0) {
            route_warp(logits, E, k, bias, sigmoid, n_group, topk_group, norm, scale, sel, selw,
                       0, lane, mine, mine + E, mine + 2 * E, (int*)(mine + 2 * E + 64),
                       (int*)(mine + 2 * E + 128));
            __syncwarp();
            int e = lane < k ? sel[lane] : 0x7fffffff;
            int rank = 0;
            for (int q = 0; q < k; q++) rank += __shfl_sync(0xffffffffu, e, q) < e;
            if (lane < k) {
                Job jb;
                jb.gate = etab[3 * e];
                jb.up = etab[3 * e + 1];
                jb.down = etab[3 * e + 2];
                jb.a0 = rank;
                jb.cnt = 1;
                jobs[rank] = jb;
                tok[rank] = 0;
                dst[rank] = lane;
            }
            if (lane == 0) {
                *njobs = k;
                if (stat) *stat += k;
            }
        }
        return;
    }
    if (wp < rw)
        for (int t = wp; t < n; t += rw)
            route_warp(logits, E, k, bias, sigmoid, n_group, topk_group, norm, scale, sel, selw,
                       t, lane, mine, mine + E, mine + 2 * E, (int*)(mine + 2 * E + 64),
                       (int*)(mine + 2 * E + 128));
    __syncthreads();
    build_block(sel, n, k, E, etab, jobs, tok, dst, njobs, stat,
                (int*)(rjs + (size_t)rw * (2 * E + 192)));
}

extern "C" __global__ void route_jobs(const float* logits, int n, int E, int k, const float* bias,
                                      int sigmoid, int n_group, int topk_group, int norm,
                                      float scale, int* sel, float* selw, const u64* etab,
                                      Job* jobs, int* tok, int* dst, int* njobs, int* stat) {
    route_jobs_block(logits, n, E, k, bias, sigmoid, n_group, topk_group, norm, scale, sel, selw,
                     etab, jobs, tok, dst, njobs, stat);
}

// The F32 router product (as mm_f32: logits = X rows 0..n (h wide, packed) x W^T, E rows), then
// the block that finishes last routes and builds the job list (route_jobs_block). done: one
// zeroed counter (left zeroed). Grid: ceil(E / WARPS) blocks of 32*WARPS; shared as route_jobs.
extern "C" __global__ void router_route_jobs(const u8* W, long long rb, const float* X, int h,
                                             float* logits, int n, int E, int k,
                                             const float* bias, int sigmoid, int n_group,
                                             int topk_group, int norm, float scale, int* sel,
                                             float* selw, const u64* etab, Job* jobs, int* tok,
                                             int* dst, int* njobs, int* stat, unsigned* done) {
    int r = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (r < E) prefetch_l2_pdl(W + (size_t)r * rb, rb);
    pdl_wait();
    pdl_go();
    mm<TF32>(W, rb, E, h, X, h, n, logits, E);
    if (!last_block(done, gridDim.x)) return;
    route_jobs_block(logits, n, E, k, bias, sigmoid, n_group, topk_group, norm, scale, sel, selw,
                     etab, jobs, tok, dst, njobs, stat);
}

// moe_down_q with the block quantizing its job's rows of Hb itself (as quantize_q8 does, into
// shared memory: NT*f codes, then NT*f/32 scales), so the down product needs no quantize launch
// before it. f a multiple of 32. Grid as moe_down_q; shared NT*f + 4*NT*f/32 bytes.
template <class T, int NTT = NT>
__device__ void moe_down_qs(const Job* jobs, const int* nj, int h, int f, long long rb,
                            const float* Hb, const int* dst, float* SO) {
    extern __shared__ int4 dsm4[];
    int wp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    int r = blockIdx.x * WARPS + wp, per = f >> 5;
    // The job list comes from two kernels back (the router, complete before the gate/up kernel
    // let this one start): the row's bytes start on their way to L2 while the gate/up product
    // still runs (and, without PDL, while the block quantizes its input).
    if (pdl_on && (!nj || (int)blockIdx.y < *nj))
        prefetch_l2((const u8*)jobs[blockIdx.y].down + (size_t)min(r, h - 1) * rb, rb);
    pdl_wait();
    pdl_go();
    if (nj && (int)blockIdx.y >= *nj) return;
    Job j = jobs[blockIdx.y];
    i8* sq = (i8*)dsm4;
    float* sd = (float*)(sq + NT * f);
    const u8* w = (const u8*)j.down + (size_t)min(r, h - 1) * rb;
    if (!pdl_on) prefetch_l2(w, rb);
    for (int a0 = j.a0; a0 < j.a0 + j.cnt; a0 += NTT) {
        int nt = NTT == 1 ? 1 : min(NTT, j.a0 + j.cnt - a0);
        __syncthreads();
        for (int g = wp; g < nt * per; g += nw) {
            int t = g / per, c = g % per;
            float v = Hb[(size_t)(a0 + t) * f + 32 * c + lane];
            float a = fabsf(v);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
            float d = a / 127.f;
            float id = d > 0.f ? 1.f / d : 0.f;
            int q = (int)roundf(v * id);
            sq[t * f + 32 * c + lane] = (i8)max(-127, min(127, q));
            if (lane == 0) sd[t * per + c] = d;
        }
        __syncthreads();
        if (r >= h) continue;
        const i8* xq[NTT];
        const float* xd[NTT];
#pragma unroll
        for (int t = 0; t < NTT; t++) {
            int tt = min(t, nt - 1);
            xq[t] = sq + tt * f;
            xd[t] = sd + tt * per;
        }
        float acc[NTT];
        row_dotq<T, NTT>(w, f, xq, xd, nt, acc);
        if (lane == 0)
            for (int t = 0; t < nt; t++) SO[(size_t)dst[a0 + t] * h + r] = acc[t];
    }
}

#define DOWN_QS_KERNEL(NAME, T)                                                                   \
    extern "C" __global__ void moe_down_qs_##NAME(const Job* jobs, const int* nj, int h, int f,   \
                                                  long long rb, const float* Hb, const int* dst, \
                                                  float* SO) {                                    \
        moe_down_qs<T>(jobs, nj, h, f, rb, Hb, dst, SO);                                          \
    }

DOWN_QS_KERNEL(q4_k, QQ4_K)
DOWN_QS_KERNEL(q5_k, QQ5_K)
DOWN_QS_KERNEL(q6_k, QQ6_K)
DOWN_QS_KERNEL(q8_0, QQ8_0)
DOWN_QS_KERNEL(q4_0, QQ4_0)

#define DOWN_QS_T1_KERNEL(NAME, T, SFX, LB)                                                                \
    extern "C" __global__ void LB moe_down_qs_##NAME##SFX(const Job* jobs, const int* nj, int h,    \
                                                       int f, long long rb, const float* Hb,     \
                                                       const int* dst, float* SO) {              \
        moe_down_qs<T, 1>(jobs, nj, h, f, rb, Hb, dst, SO);                                       \
    }
DOWN_QS_T1_KERNEL(q4_k, QQ4_K, _t1, __launch_bounds__(256, 6))
DOWN_QS_T1_KERNEL(q4_k, QQ4_K, _t1n, )
DOWN_QS_T1_KERNEL(q5_k, QQ5_K, _t1, __launch_bounds__(256, 6))
DOWN_QS_T1_KERNEL(q5_k, QQ5_K, _t1n, )
DOWN_QS_T1_KERNEL(q6_k, QQ6_K, _t1, __launch_bounds__(256, 6))
DOWN_QS_T1_KERNEL(q6_k, QQ6_K, _t1n, )
DOWN_QS_T1_KERNEL(q8_0, QQ8_0, _t1, __launch_bounds__(256, 6))
DOWN_QS_T1_KERNEL(q8_0, QQ8_0, _t1n, )
DOWN_QS_T1_KERNEL(q4_0, QQ4_0, _t1, __launch_bounds__(256, 6))
DOWN_QS_T1_KERNEL(q4_0, QQ4_0, _t1n, )

// ==== One-token products with R rows per warp (decode) ====
//
// The decode step's expert down product is 8 jobs x 2048 rows of 768 values: with one row per
// warp, a lane makes one 16-byte load and the block (8 rows) quantizes its 768 inputs for it,
// 2048 blocks in ~3 waves. Here each warp takes R rows (r0 .. r0 + R - 1): R loads per lane in
// flight, R times fewer blocks and input quantizations. Each row's sum is row_dotq<T, 1>'s (the
// same items per lane in the same order, the same warp reduction), the input quantized as
// moe_down_qs quantizes it: results byte-identical to moe_down_qs. Grid: (ceil(h / (WARPS R)),
// jobs); shared as moe_down_qs.
template <class T, int R>
__device__ void moe_down_qs_rows(const Job* jobs, const int* nj, int h, int f, long long rb,
                                 const float* Hb, const int* dst, float* SO) {
    extern __shared__ int4 dsm4[];
    int wp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    int r0 = (blockIdx.x * WARPS + wp) * R, per = f >> 5;
    // As moe_down_qs: the job list is two kernels old, the rows go to L2 before the wait.
    if (r0 < h && (!nj || (int)blockIdx.y < *nj)) {
        const u8* w0 = (const u8*)jobs[blockIdx.y].down;
#pragma unroll
        for (int q = 0; q < R; q++) prefetch_l2(w0 + (size_t)min(r0 + q, h - 1) * rb, rb);
    }
    pdl_wait();
    pdl_go();
    if (nj && (int)blockIdx.y >= *nj) return;
    Job j = jobs[blockIdx.y];
    i8* sq = (i8*)dsm4;
    float* sd = (float*)(sq + NT * f);
    const u8* wd = (const u8*)j.down;
    const int items = (f / T::BE) * T::IPB;
    for (int a = j.a0; a < j.a0 + j.cnt; a++) {
        __syncthreads();
        for (int c = wp; c < per; c += nw) {
            float v = Hb[(size_t)a * f + 32 * c + lane];
            float am = fabsf(v);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, o));
            float d = am / 127.f;
            float id = d > 0.f ? 1.f / d : 0.f;
            int q = (int)roundf(v * id);
            sq[32 * c + lane] = (i8)max(-127, min(127, q));
            if (lane == 0) sd[c] = d;
        }
        __syncthreads();
        if (r0 >= h) continue;
        const i8* xq[1] = {sq};
        const float* xd[1] = {sd};
        float acc[R];
#pragma unroll
        for (int q = 0; q < R; q++) acc[q] = 0.f;
#pragma unroll 2
        for (int it = lane; it < items; it += 32)
#pragma unroll
            for (int q = 0; q < R; q++)
                T::dot(wd + (size_t)min(r0 + q, h - 1) * rb, it, xq, xd, 1, &acc[q]);
#pragma unroll
        for (int q = 0; q < R; q++) acc[q] = warp_sum(acc[q]);
        if (lane == 0)
#pragma unroll
            for (int q = 0; q < R; q++)
                if (r0 + q < h) SO[(size_t)dst[a] * h + r0 + q] = acc[q];
    }
}

// mmq for one token with R rows per warp (the output head: 152k rows), each row's sum
// row_dotq<T, 1>'s. Grid: ceil(rows / (WARPS R)).
template <class T, int R>
__device__ void mmq_rows1(const u8* W, long long rb, int rows, int cols, const i8* XQ,
                          const float* XD, float* Y) {
    const int lane = threadIdx.x & 31;
    int r0 = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * R;
    if (r0 < rows)
#pragma unroll
        for (int q = 0; q < R; q++) prefetch_l2(W + (size_t)min(r0 + q, rows - 1) * rb, rb);
    pdl_wait();
    pdl_go();
    if (r0 >= rows) return;
    const int items = (cols / T::BE) * T::IPB;
    const i8* xq[1] = {XQ};
    const float* xd[1] = {XD};
    float acc[R];
#pragma unroll
    for (int q = 0; q < R; q++) acc[q] = 0.f;
#pragma unroll 2
    for (int it = lane; it < items; it += 32)
#pragma unroll
        for (int q = 0; q < R; q++)
            T::dot(W + (size_t)min(r0 + q, rows - 1) * rb, it, xq, xd, 1, &acc[q]);
#pragma unroll
    for (int q = 0; q < R; q++) acc[q] = warp_sum(acc[q]);
    if (lane == 0)
#pragma unroll
        for (int q = 0; q < R; q++)
            if (r0 + q < rows) Y[r0 + q] = acc[q];
}

#define ROWS_T1_KERNELS(NAME, T)                                                                  \
    extern "C" __global__ void __launch_bounds__(256, 4) moe_down_qs2_##NAME##_t1(                \
        const Job* jobs, const int* nj, int h, int f, long long rb, const float* Hb,              \
        const int* dst, float* SO) {                                                              \
        moe_down_qs_rows<T, 2>(jobs, nj, h, f, rb, Hb, dst, SO);                                  \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(256, 4) moe_down_qs4_##NAME##_t1(                \
        const Job* jobs, const int* nj, int h, int f, long long rb, const float* Hb,              \
        const int* dst, float* SO) {                                                              \
        moe_down_qs_rows<T, 4>(jobs, nj, h, f, rb, Hb, dst, SO);                                  \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(256, 3) mmq2_##NAME##_t1(                        \
        const u8* W, long long rb, int rows, int cols, const i8* XQ, const float* XD, int n,      \
        float* Y, int ldy) {                                                                      \
        mmq_rows1<T, 2>(W, rb, rows, cols, XQ, XD, Y);                                            \
    }
ROWS_T1_KERNELS(q4_k, QQ4_K)
ROWS_T1_KERNELS(q5_k, QQ5_K)
ROWS_T1_KERNELS(q6_k, QQ6_K)
ROWS_T1_KERNELS(q8_0, QQ8_0)
ROWS_T1_KERNELS(q4_0, QQ4_0)

// ==== Prompt attention in tiles (prefill) ====
//
// `attention` (one block per head and query, every key and value read from L2 again for each
// query) took ~46% of a 1.5k-token prefill. Here a block takes AQ = 32 queries of one head and
// walks the keys in tiles of AK = 16 through shared memory, with an online softmax (running max
// and sum per query, the accumulators rescaled when the max grows): K and V are read once per
// 32 queries, and the next tile's loads are in flight while the block computes on this one.
// f32 throughout. Scores: each thread 2 queries x 2 keys, 4 dimensions per shared load; values:
// each thread one query and 8 groups of 4 dimensions. Causal: query t sees keys 0 ..= *pp +
// padd + t. Same arguments as `attention` without the score scratch. dk <= 192 and dv <= 128,
// both multiples of 4, rows 16-byte aligned (else `attention`). Grid: (heads, ceil(n / AQ));
// block 128; shared 4 * (AQ*(dk+4) + AK*(dk+4) + AK*dv + AQ*(AK+1)) bytes.
#define AQ 32
#define AK 16
extern "C" __global__ void attention_tiled(const float* Q, int qts, int qhs, const float* K,
                                           int ks, int khs, const float* V, int vs, int vhs,
                                           int dk, int dv, int group, const int* pp, int padd,
                                           float scale, int n, float* O, int ots, int ohs) {
    extern __shared__ float4 tsh4[];
    float* tsh = (float*)tsh4;
    const int sq = dk + 4;  // rows 4 banks apart: a quarter warp's 8 key rows hit 32 banks
    float* Qs = tsh;                 // AQ x sq
    float* Ks = Qs + AQ * sq;        // AK x sq
    float* Vs = Ks + AK * sq;        // AK x dv
    float* Ss = Vs + AK * dv;        // AQ x (AK + 1)
    const int hh = blockIdx.x, q0 = blockIdx.y * AQ, tid = threadIdx.x;
    const int g = hh / group, pos0 = *pp + padd;
    const int nq = min(AQ, n - q0);
    const int dk4 = dk >> 2, dv4 = dv >> 2;
    for (int r = 0; r < AQ; r++)
        for (int c = tid; c < dk4; c += 128)
            ((float4*)(Qs + r * sq))[c] =
                r < nq ? ((const float4*)(Q + (size_t)(q0 + r) * qts + (size_t)hh * qhs))[c]
                       : make_float4(0.f, 0.f, 0.f, 0.f);
    // This thread's share of a key/value tile (row r, float4 column tid [+ 128]): dk/4 <= 48,
    // dv/4 <= 32, so at most 16 of each per row... laid out as rows r = tid / 32 + 4u below.
    // Tile element (r, c): thread tid takes c = tid % 32 (+32) of rows tid / 32 + 4u, u < 4.
    const int tc = tid & 31, tr = tid >> 5;
    float4 kr[4][2], vr[4];
    const int kend = pos0 + q0 + nq;  // keys 0 .. kend - 1
    auto load = [&](int k0) {
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int j = k0 + tr + 4 * u;
            bool ok = j < kend;
            const float4* kp = (const float4*)(K + (size_t)j * ks + (size_t)g * khs);
            const float4* vp = (const float4*)(V + (size_t)j * vs + (size_t)g * vhs);
            float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
            kr[u][0] = ok && tc < dk4 ? kp[tc] : z;
            kr[u][1] = ok && tc + 32 < dk4 ? kp[tc + 32] : z;
            vr[u] = ok && tc < dv4 ? vp[tc] : z;
        }
    };
    const int sa = 2 * (tid >> 3), sb = 2 * (tid & 7);
    const int qi = tid >> 2, dq = tid & 3;
    const int lim = qi < nq ? pos0 + q0 + qi : -1;  // last key query qi sees
    float4 acc[8];
#pragma unroll
    for (int m = 0; m < 8; m++) acc[m] = make_float4(0.f, 0.f, 0.f, 0.f);
    float mrun = -INFINITY, lrun = 0.f;
    load(0);
    for (int k0 = 0; k0 < kend; k0 += AK) {
        __syncthreads();  // the previous tile's readers are done
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int r = tr + 4 * u;
            float4* kd = (float4*)(Ks + r * sq);
            if (tc < dk4) kd[tc] = kr[u][0];
            if (tc + 32 < dk4) kd[tc + 32] = kr[u][1];
            if (tc < dv4) ((float4*)(Vs + r * dv))[tc] = vr[u];
        }
        __syncthreads();
        if (k0 + AK < kend) load(k0 + AK);
        {
            float s00 = 0.f, s01 = 0.f, s10 = 0.f, s11 = 0.f;
            const float4* qa = (const float4*)(Qs + sa * sq);
            const float4* qb = (const float4*)(Qs + (sa + 1) * sq);
            const float4* ka = (const float4*)(Ks + sb * sq);
            const float4* kb = (const float4*)(Ks + (sb + 1) * sq);
            for (int c = 0; c < dk4; c++) {
                float4 x0 = qa[c], x1 = qb[c], y0 = ka[c], y1 = kb[c];
                s00 += x0.x * y0.x + x0.y * y0.y + x0.z * y0.z + x0.w * y0.w;
                s01 += x0.x * y1.x + x0.y * y1.y + x0.z * y1.z + x0.w * y1.w;
                s10 += x1.x * y0.x + x1.y * y0.y + x1.z * y0.z + x1.w * y0.w;
                s11 += x1.x * y1.x + x1.y * y1.y + x1.z * y1.z + x1.w * y1.w;
            }
            Ss[sa * (AK + 1) + sb] = s00 * scale;
            Ss[sa * (AK + 1) + sb + 1] = s01 * scale;
            Ss[(sa + 1) * (AK + 1) + sb] = s10 * scale;
            Ss[(sa + 1) * (AK + 1) + sb + 1] = s11 * scale;
        }
        __syncthreads();
        const float* srow = Ss + qi * (AK + 1);
        float mt = -INFINITY;
#pragma unroll
        for (int j = 0; j < AK; j++)
            if (k0 + j <= lim) mt = fmaxf(mt, srow[j]);
        if (mt == -INFINITY) continue;  // every key of the tile is masked for this query
        float mnew = fmaxf(mrun, mt);
        float alpha = expf(mrun - mnew);  // 0 on the first tile (mrun = -inf)
        float p[AK];
        float ps = 0.f;
#pragma unroll
        for (int j = 0; j < AK; j++) {
            p[j] = k0 + j <= lim ? expf(srow[j] - mnew) : 0.f;
            ps += p[j];
        }
        lrun = lrun * alpha + ps;
        mrun = mnew;
#pragma unroll
        for (int m = 0; m < 8; m++) {
            int c = dq + 4 * m;  // float4 column of V
            if (c < dv4) {
                float4 a = acc[m];
                a.x *= alpha;
                a.y *= alpha;
                a.z *= alpha;
                a.w *= alpha;
#pragma unroll
                for (int j = 0; j < AK; j++) {
                    float4 v = ((const float4*)(Vs + j * dv))[c];
                    a.x += p[j] * v.x;
                    a.y += p[j] * v.y;
                    a.z += p[j] * v.z;
                    a.w += p[j] * v.w;
                }
                acc[m] = a;
            }
        }
    }
    if (qi >= nq) return;
    float inv = 1.f / lrun;
    float4* o = (float4*)(O + (size_t)(q0 + qi) * ots + (size_t)hh * ohs);
#pragma unroll
    for (int m = 0; m < 8; m++) {
        int c = dq + 4 * m;
        if (c < dv4) {
            float4 a = acc[m];
            o[c] = make_float4(a.x * inv, a.y * inv, a.z * inv, a.w * inv);
        }
    }
}
