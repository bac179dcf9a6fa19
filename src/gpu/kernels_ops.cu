
// ==== kernels_ops.cu: the forward's less common operations (gpu/ops.rs launches them) ==========
//
// clip_qkv's clamp; attention with a sliding window and per-head sink logits (gpt-oss), in the
// one-pass and the split (flash-decoding) forms; the gpt-oss expert path: raw gate and up
// products, their biases and the clamped SwiGLU, the down bias. Compiled after kernels.cu as one
// translation unit (its types, row_dot, warp_sum, block_sum/max, Job and silu are in scope).

// x = clamp(x, -c, c) (OLMoE's clip_qkv), over len values.
extern "C" __global__ void clamp_rows(float* X, float c, int len) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) X[i] = fminf(fmaxf(X[i], -c), c);
}

// `attention` (kernels.cu) over positions first..len-1 only, first = max(0, len - window) when
// window > 0, and with a sink logit per head (sinks non-null: it joins the softmax's max and sum
// and contributes no value, as gptoss::softmax_with_sink). Grid: (heads, n); block 128.
extern "C" __global__ void attention_ws(const float* Q, int qts, int qhs, const float* K, int ks,
                                        int khs, const float* V, int vs, int vhs, int dk, int dv,
                                        int group, const int* pp, int padd, float scale,
                                        float* S, int ctx, float* O, int ots, int ohs,
                                        int window, const float* sinks) {
    __shared__ float red[32];
    extern __shared__ float qsh[];
    int hh = blockIdx.x, t = blockIdx.y, heads = gridDim.x;
    int len = *pp + padd + t + 1;
    int first = window > 0 ? max(0, len - window) : 0;
    int g = hh / group;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const float* q = Q + (size_t)t * qts + (size_t)hh * qhs;
    for (int i = threadIdx.x; i < dk; i += blockDim.x) qsh[i] = q[i];
    __syncthreads();
    float* sc = S + ((size_t)t * heads + hh) * ctx;
    float sink = sinks ? sinks[hh] : -INFINITY;
    float mx = sink;
    for (int j = first + warp; j < len; j += nw) {
        const float* k = K + (size_t)j * ks + (size_t)g * khs;
        float s = 0.f;
        for (int i = lane; i < dk; i += 32) s += qsh[i] * k[i];
        s = warp_sum(s) * scale;
        if (lane == 0) sc[j] = s;
        mx = fmaxf(mx, s);
    }
    mx = block_max(mx, red);  // its barriers also make every sc[j] visible to the block
    float sum = 0.f;
    for (int j = first + threadIdx.x; j < len; j += blockDim.x) {
        float e = expf(sc[j] - mx);
        sc[j] = e;
        sum += e;
    }
    sum = block_sum(sum, red);
    if (sinks) sum += expf(sink - mx);
    float inv = 1.f / sum;
    float* o = O + (size_t)t * ots + (size_t)hh * ohs;
    const float* vb = V + (size_t)g * vhs;
    for (int d = threadIdx.x; d < dv; d += blockDim.x) {
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
        int j = first;
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

// `attention_split` (kernels.cu) restricted to the sliding window: split s takes positions
// [max(s*chunk, first), min(len, (s+1)*chunk)). The sinks join in attention_merge_sink.
extern "C" __global__ void attention_split_ws(const float* Q, int qts, int qhs, const float* K,
                                              int ks, int khs, const float* V, int vs, int vhs,
                                              int dk, int dv, int group, const int* pp, int padd,
                                              float scale, int chunk, float* PM, float* PL,
                                              float* PO, int window) {
    __shared__ float red[32];
    extern __shared__ float ash[];
    float* qsh = ash;
    float* sc = ash + dk;
    int hh = blockIdx.x, t = blockIdx.y, s = blockIdx.z, heads = gridDim.x, S = gridDim.z;
    int len = *pp + padd + t + 1;
    int first = window > 0 ? max(0, len - window) : 0;
    int j0 = max(s * chunk, first), j1 = min(len, s * chunk + chunk);
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

// `attention_merge` (kernels.cu) with a sink logit per head (sinks non-null) in the softmax's
// max and sum. Grid: (heads, n), block 128.
extern "C" __global__ void attention_merge_sink(const float* PM, const float* PL, const float* PO,
                                                int S, int dv, float* O, int ots, int ohs,
                                                const float* sinks) {
    int hh = blockIdx.x, t = blockIdx.y, heads = gridDim.x;
    size_t base = ((size_t)t * heads + hh) * S;
    float sink = sinks ? sinks[hh] : -INFINITY;
    float m = sink;
    for (int s = 0; s < S; s++) m = fmaxf(m, PM[base + s]);
    float l = sinks ? expf(sink - m) : 0.f;
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

// ---- gpt-oss experts ---------------------------------------------------------------------------
//
// The expert of assignment a is sel[dst[a]] (dst[a] = token * k + slot, sel the routing's choice
// per token and slot), so the biases need no change to the job list.

// Hb[a*f + r] = gate_r . x, Hu[a*f + r] = up_r . x for each assignment a of the block's job (the
// products without activation). Grid: (ceil(f / WARPS), jobs); block 32*WARPS.
template <class T>
__device__ void moe_gate_up_raw(const Job* jobs, const int* nj, int f, int h, long long rb,
                                const float* XN, int ldx, const int* tok, float* Hb, float* Hu) {
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
            for (int t = 0; t < nt; t++) {
                Hb[(size_t)(a0 + t) * f + r] = ag[t];
                Hu[(size_t)(a0 + t) * f + r] = au[t];
            }
    }
}

#define RAW_KERNELS(NAME, T)                                                                      \
    extern "C" __global__ void moe_gate_up_raw_##NAME(const Job* jobs, const int* nj, int f,     \
                                                      int h, long long rb, const float* XN,      \
                                                      int ldx, const int* tok, float* Hb,        \
                                                      float* Hu) {                               \
        moe_gate_up_raw<T>(jobs, nj, f, h, rb, XN, ldx, tok, Hb, Hu);                             \
    }

RAW_KERNELS(f32, TF32)
RAW_KERNELS(f16, TF16)
RAW_KERNELS(bf16, TBF16)
RAW_KERNELS(q8_0, TQ8_0)
RAW_KERNELS(q4_0, TQ4_0)
RAW_KERNELS(q4_k, TQ4_K)
RAW_KERNELS(q5_k, TQ5_K)
RAW_KERNELS(q6_k, TQ6_K)
RAW_KERNELS(q2_k, TQ2_K)
RAW_KERNELS(q3_k, TQ3_K)
RAW_KERNELS(iq2_xxs, TIQ2_XXS)
RAW_KERNELS(mxfp4, TMXFP4)

// For each assignment a of the block's job (expert e): g = Hb + bg[e], u = Hu + bu[e] (biases
// optional), then Hb = act(g, u): act 0 silu(g) * u; act 1 gpt-oss's clamped SwiGLU,
// (clamp(u, -limit, limit) + 1) * x * sigmoid(alpha * x), x = min(g, limit). Grid: (ceil(f/256),
// jobs); block 256.
extern "C" __global__ void moe_act_bias(const Job* jobs, const int* nj, int f, float* Hb,
                                        const float* Hu, const int* dst, const int* sel,
                                        const float* bg, const float* bu, int act, float alpha,
                                        float limit) {
    if (nj && (int)blockIdx.y >= *nj) return;
    Job j = jobs[blockIdx.y];
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= f || j.cnt <= 0) return;
    int e = sel[dst[j.a0]];
    float gb = bg ? bg[(size_t)e * f + r] : 0.f;
    float ub = bu ? bu[(size_t)e * f + r] : 0.f;
    for (int a = j.a0; a < j.a0 + j.cnt; a++) {
        float g = Hb[(size_t)a * f + r] + gb;
        float u = Hu[(size_t)a * f + r] + ub;
        float y;
        if (act == 1) {
            float x = fminf(g, limit);
            float uc = fminf(fmaxf(u, -limit), limit);
            y = (uc + 1.f) * (x / (1.f + expf(-alpha * x)));
        } else {
            y = silu(g) * u;
        }
        Hb[(size_t)a * f + r] = y;
    }
}

// SO[dst[a]*h + c] += bd[e*h + c] for each assignment a of the block's job (expert e): the down
// projection's bias. Grid: (ceil(h/256), jobs); block 256.
extern "C" __global__ void moe_down_bias(const Job* jobs, const int* nj, int h, float* SO,
                                         const int* dst, const int* sel, const float* bd) {
    if (nj && (int)blockIdx.y >= *nj) return;
    Job j = jobs[blockIdx.y];
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= h || j.cnt <= 0) return;
    int e = sel[dst[j.a0]];
    float b = bd[(size_t)e * h + c];
    for (int a = j.a0; a < j.a0 + j.cnt; a++) SO[(size_t)dst[a] * h + c] += b;
}

// ---- DeepSeek-V3.2 / GLM-5 lightning indexer (DSA) ---------------------------------------------

// x *= s over len values.
extern "C" __global__ void scale_rows(float* X, float s, int len) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) X[i] *= s;
}

__device__ __forceinline__ double block_sum_d(double s, double* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) red[warp] = s;
    __syncthreads();
    double t = 0.0;
    for (int w = 0; w < nw; w++) t += red[w];
    return t;
}

// torch LayerNorm of each row in place (biased variance, sums in f64, as deepseek2::layer_norm):
// x = (float)((x - mean) / sqrt(var + eps)) * w + b. Grid: rows; block 256.
extern "C" __global__ void layer_norm_rows(float* X, int ld, const float* w, const float* b,
                                           int dim, double eps) {
    __shared__ double red[32];
    float* x = X + (size_t)blockIdx.x * ld;
    double s = 0.0;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) s += (double)x[i];
    double mean = block_sum_d(s, red) / dim;
    double v = 0.0;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        double d = (double)x[i] - mean;
        v += d * d;
    }
    double inv = 1.0 / sqrt(block_sum_d(v, red) / dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        x[i] = (float)(((double)x[i] - mean) * inv) * w[i] + b[i];
}

// Index scores of query row t (position *pp + padd + t) over its causal positions j < len:
// SC[t*ctx + j] = sum_h relu(q[t,h] . k[j] * scale) * w[t,h], heads summed in order (as
// Model::indexer_select). IQ: (rows, nh*d), IW: (rows, nh), KC: the layer's indexer keys (ctx, d).
// One warp per position. Grid: (ceil(ctx / 8), rows); block 256.
extern "C" __global__ void idx_scores(const float* IQ, const float* IW, const float* KC, int nh,
                                      int d, float scale, const int* pp, int padd, float* SC,
                                      int ctx) {
    int t = blockIdx.y, lane = threadIdx.x & 31;
    int j = blockIdx.x * 8 + (threadIdx.x >> 5);
    int len = *pp + padd + t + 1;
    if (j >= len) return;
    const float* q = IQ + (size_t)t * nh * d;
    const float* w = IW + (size_t)t * nh;
    const float* k = KC + (size_t)j * d;
    float acc = 0.f;
    for (int h = 0; h < nh; h++) {
        float s = 0.f;
        for (int i = lane; i < d; i += 32) s += q[h * d + i] * k[i];
        s = warp_sum(s);
        acc += fmaxf(s * scale, 0.f) * w[h];
    }
    if (lane == 0) SC[(size_t)t * ctx + j] = acc;
}

// An order-preserving unsigned key of a float (a larger float, a larger key).
__device__ __forceinline__ u32 fkey(float f) {
    u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exclusive prefix sum of v over the block (blockDim a multiple of 32, at most 1024); *total gets
// the block's sum. Uses ws[32].
__device__ __forceinline__ int block_scan(int v, int* ws, int* total) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads();
    if (lane == 31) ws[warp] = x;
    __syncthreads();
    int before = 0, all = 0;
    for (int w = 0; w < nw; w++) {
        if (w < warp) before += ws[w];
        all += ws[w];
    }
    *total = all;
    return before + x - v;
}

// The positions query row t attends to: all len causal positions when len <= topk, else the
// topk best index scores (SC row t), ties to the lower position (Model::indexer_select's order);
// written ascending to SEL[t*topk ..], their count to CNT[t]. A radix select finds the topk-th
// largest key, then one ordered pass keeps the keys above it and the first equal ones.
// Grid: rows; block 1024.
extern "C" __global__ void idx_select(const float* SC, int ctx, int topk, const int* pp, int padd,
                                      int* SEL, int* CNT) {
    __shared__ int hist[256];
    __shared__ int ws[32];
    __shared__ u32 sh_prefix;
    __shared__ int sh_rem;
    int t = blockIdx.x;
    int len = *pp + padd + t + 1;
    int* sel = SEL + (size_t)t * topk;
    if (len <= topk) {
        for (int j = threadIdx.x; j < len; j += blockDim.x) sel[j] = j;
        if (threadIdx.x == 0) CNT[t] = len;
        return;
    }
    const float* sc = SC + (size_t)t * ctx;
    u32 prefix = 0, mask = 0;
    int rem = topk;  // how many of the keys matching prefix (under mask) are still to take
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        for (int j = threadIdx.x; j < len; j += blockDim.x) {
            u32 kk = fkey(sc[j]);
            if ((kk & mask) == prefix) atomicAdd(&hist[(kk >> shift) & 255], 1);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int acc = 0, dg = 255;
            for (; dg > 0; dg--) {
                if (acc + hist[dg] >= rem) break;
                acc += hist[dg];
            }
            sh_prefix = prefix | ((u32)dg << shift);
            sh_rem = rem - acc;
        }
        __syncthreads();
        prefix = sh_prefix;
        rem = sh_rem;
        mask |= 255u << shift;
        __syncthreads();
    }
    // prefix: the topk-th largest key; rem: how many keys equal to it are taken (lowest first).
    int eq_seen = 0, out = 0;
    for (int j0 = 0; j0 < len; j0 += blockDim.x) {
        int j = j0 + threadIdx.x;
        u32 kk = j < len ? fkey(sc[j]) : 0u;
        int eq = j < len && kk == prefix;
        int gt = j < len && kk > prefix;
        int eq_tot, take_tot;
        int eq_rank = eq_seen + block_scan(eq, ws, &eq_tot);
        int take = gt || (eq && eq_rank < rem);
        int at = out + block_scan(take, ws, &take_tot);
        if (take) sel[at] = j;
        eq_seen += eq_tot;
        out += take_tot;
    }
    if (threadIdx.x == 0) CNT[t] = topk;
}

// `attention` (kernels.cu) over a list of positions per query row: row t attends to
// SEL[t*lds + jj] for jj < CNT[t] (ascending). Grid: (heads, rows); block 128.
extern "C" __global__ void attention_list(const float* Q, int qts, int qhs, const float* K, int ks,
                                          int khs, const float* V, int vs, int vhs, int dk, int dv,
                                          int group, const int* SEL, int lds, const int* CNT,
                                          float scale, float* S, int ctx, float* O, int ots,
                                          int ohs) {
    __shared__ float red[32];
    extern __shared__ float qsh[];
    int hh = blockIdx.x, t = blockIdx.y, heads = gridDim.x;
    int cnt = CNT[t];
    const int* sel = SEL + (size_t)t * lds;
    int g = hh / group;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const float* q = Q + (size_t)t * qts + (size_t)hh * qhs;
    for (int i = threadIdx.x; i < dk; i += blockDim.x) qsh[i] = q[i];
    __syncthreads();
    float* sc = S + ((size_t)t * heads + hh) * ctx;
    float mx = -INFINITY;
    for (int jj = warp; jj < cnt; jj += nw) {
        const float* k = K + (size_t)sel[jj] * ks + (size_t)g * khs;
        float s = 0.f;
        for (int i = lane; i < dk; i += 32) s += qsh[i] * k[i];
        s = warp_sum(s) * scale;
        if (lane == 0) sc[jj] = s;
        mx = fmaxf(mx, s);
    }
    mx = block_max(mx, red);
    float sum = 0.f;
    for (int jj = threadIdx.x; jj < cnt; jj += blockDim.x) {
        float e = expf(sc[jj] - mx);
        sc[jj] = e;
        sum += e;
    }
    sum = block_sum(sum, red);
    float inv = 1.f / sum;
    float* o = O + (size_t)t * ots + (size_t)hh * ohs;
    const float* vb = V + (size_t)g * vhs;
    for (int d = threadIdx.x; d < dv; d += blockDim.x) {
        float a0 = 0.f, a1 = 0.f;
        int jj = 0;
        for (; jj + 2 <= cnt; jj += 2) {
            a0 += sc[jj] * vb[(size_t)sel[jj] * vs + d];
            a1 += sc[jj + 1] * vb[(size_t)sel[jj + 1] * vs + d];
        }
        for (; jj < cnt; jj++) a0 += sc[jj] * vb[(size_t)sel[jj] * vs + d];
        o[d] = (a0 + a1) * inv;
    }
}
