
// ==== kernels_hybrid.cu: Qwen3-Next / Qwen3.5-MoE's hybrid layers (gpu/hybrid.rs launches them) ==
//
// The Gated DeltaNet's causal conv with its rolling state, its delta rule with the gated RMSNorm
// (one block per value head, the state in registers, sequential over the chunk's tokens), the
// gated attention's q/gate split and sigmoid gate, and the shared expert's sigmoid gate. Each is
// the CPU's formula (model/qwen3next.rs `conv_step`, `delta_step`, `gated_norm`; cpu.rs). A chunk
// whose first position (*pp + padd) is 0 starts from a zero state, read from the device so a
// captured decode step replays at any position. Compiled after kernels.cu as one translation unit
// (warp_sum, block_sum and silu are in scope).

#define GDN_MAXK 8
#define GDN_MAXR 32

// Causal depthwise conv + silu of channels 0..C of rows 0..n of X (row stride ldx), in place:
// out_t[c] = silu(sum_j W[c][j] * in_{t-K+1+j}[c]), the inputs before the chunk from `state`
// ((K-1, C), oldest first), which keeps the last K-1 inputs after. One thread per channel.
extern "C" __global__ void gdn_conv(float* X, int ldx, int n, int C, float* state,
                                    const float* W, int K, const int* pp, int padd) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    bool fresh = *pp + padd == 0;
    float win[GDN_MAXK], w[GDN_MAXK];
#pragma unroll
    for (int j = 0; j < GDN_MAXK; j++) {
        win[j] = (j < K - 1 && !fresh) ? state[(size_t)j * C + c] : 0.f;
        w[j] = j < K ? W[(size_t)c * K + j] : 0.f;
    }
    float wl = W[(size_t)c * K + K - 1];
    for (int t = 0; t < n; t++) {
        float* x = X + (size_t)t * ldx + c;
        float in = *x, acc = 0.f;
#pragma unroll
        for (int j = 0; j < GDN_MAXK; j++)
            if (j < K - 1) acc += w[j] * win[j];
        acc += wl * in;
#pragma unroll
        for (int j = 0; j < GDN_MAXK - 1; j++) {
            if (j < K - 2) win[j] = win[j + 1];
            else if (j == K - 2) win[j] = in;
        }
        *x = silu(acc);
    }
#pragma unroll
    for (int j = 0; j < GDN_MAXK; j++)
        if (j < K - 1) state[(size_t)j * C + c] = win[j];
}

// The gated delta rule of value head hv = blockIdx.x over rows 0..n, then its gated RMSNorm.
// X rows: the conv output [q (nk*dk); k (nk*dk); v (nv*dv)]; BA rows: [b (nv); a (nv)]; Z rows: z
// (nv*dv); O rows: the normed, gated output (nv*dv). State: (nv, dk, dv). Value head hv reads key
// head hv % nk (tiled) or hv / (nv/nk). Per token: q, k L2-normed (eps 1e-6), q / sqrt(dk);
// beta = sigmoid(b), decay = exp(a_neg * softplus(a + dt_bias)); S *= decay; delta = beta (v - S^T
// k); S += k delta^T; o = S^T q; out = w * o / rms(o) * silu(z).
// Threads: j = tid / P over the dv columns, p = tid % P over rows i = p, p + P, .. of dk (P a power
// of two <= 32, dk <= P * GDN_MAXR); each thread keeps its state entries in registers, the P
// threads of one column are adjacent lanes and reduce by shuffles. Block: dv * P rounded up to 32.
// Shared: 2 dk floats.
extern "C" __global__ void __launch_bounds__(1024)
    gdn_delta(const float* X, int ldx, const float* BA, int ldba, const float* Z, int ldz,
              float* O, int ldo, float* state, const float* a_neg, const float* dt_bias,
              const float* normw, int n, int nk, int nv, int dk, int dv, int tiled, int P,
              float eps, const int* pp, int padd) {
    __shared__ float red[32];
    extern __shared__ float qk[];
    float* qs = qk;
    float* ks = qk + dk;
    int hv = blockIdx.x;
    int kh = tiled ? hv % nk : hv / (nv / nk);
    int tid = threadIdx.x, j = tid / P, p = tid % P;
    bool on = j < dv;
    int cnt = on ? (dk - p + P - 1) / P : 0;
    float* S = state + (size_t)hv * dk * dv;
    bool fresh = *pp + padd == 0;
    float s[GDN_MAXR];
#pragma unroll
    for (int r = 0; r < GDN_MAXR; r++)
        s[r] = (r < cnt && !fresh) ? S[(size_t)(p + r * P) * dv + j] : 0.f;
    int kd = nk * dk;
    float scale = 1.f / sqrtf((float)dk);
    float an = a_neg[hv], dt = dt_bias[hv];
    float wj = on ? normw[j] : 0.f;
    for (int t = 0; t < n; t++) {
        const float* x = X + (size_t)t * ldx;
        float sq = 0.f, sk = 0.f;
        for (int i = tid; i < dk; i += blockDim.x) {
            float qv = x[kh * dk + i], kv = x[kd + kh * dk + i];
            qs[i] = qv;
            ks[i] = kv;
            sq += qv * qv;
            sk += kv * kv;
        }
        sq = block_sum(sq, red);
        sk = block_sum(sk, red);
        float iq = 1.f / sqrtf(sq + 1e-6f) * scale, ik = 1.f / sqrtf(sk + 1e-6f);
        float b = BA[(size_t)t * ldba + hv], a = BA[(size_t)t * ldba + nv + hv];
        float beta = 1.f / (1.f + expf(-b));
        float u = a + dt;
        float sp = u > 20.f ? u : log1pf(expf(u));
        float decay = expf(an * sp);
        float kv = 0.f;
#pragma unroll
        for (int r = 0; r < GDN_MAXR; r++)
            if (r < cnt) {
                s[r] *= decay;
                kv += s[r] * (ks[p + r * P] * ik);
            }
        for (int o = P >> 1; o > 0; o >>= 1) kv += __shfl_xor_sync(0xffffffffu, kv, o);
        float v = on ? x[2 * kd + hv * dv + j] : 0.f;
        float delta = beta * (v - kv);
        float o = 0.f;
#pragma unroll
        for (int r = 0; r < GDN_MAXR; r++)
            if (r < cnt) {
                s[r] += (ks[p + r * P] * ik) * delta;
                o += s[r] * (qs[p + r * P] * iq);
            }
        for (int m = P >> 1; m > 0; m >>= 1) o += __shfl_xor_sync(0xffffffffu, o, m);
        // Its barriers also keep this token's q and k in place until every thread is done.
        float ss = block_sum(on && p == 0 ? o * o : 0.f, red);
        float inv = 1.f / sqrtf(ss / (float)dv + eps);
        if (on && p == 0) {
            float z = Z[(size_t)t * ldz + hv * dv + j];
            O[(size_t)t * ldo + hv * dv + j] = wj * (o * inv) * silu(z);
        }
    }
#pragma unroll
    for (int r = 0; r < GDN_MAXR; r++)
        if (r < cnt) S[(size_t)(p + r * P) * dv + j] = s[r];
}

// Gated attention's q_proj output, per head [q (hd); gate (hd)], split: Q and G rows are
// heads*hd wide. len = n * heads * hd.
extern "C" __global__ void gated_split(const float* QG, float* Q, float* G, int heads, int hd,
                                       int len) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    int w = heads * hd, t = i / w, r = i % w, hh = r / hd, d = r % hd;
    const float* src = QG + (size_t)t * 2 * w + (size_t)hh * 2 * hd;
    Q[i] = src[d];
    G[i] = src[hd + d];
}

// O[i] *= sigmoid(G[i]) over len values.
extern "C" __global__ void sigmoid_mul(float* O, const float* G, int len) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) O[i] *= 1.f / (1.f + expf(-G[i]));
}

// The shared expert's sigmoid gate: P[row] += sigmoid(g . X[row]) * D[row], rows h wide. Grid:
// rows blocks.
extern "C" __global__ void shared_gate_add(float* P, const float* D, const float* X,
                                           const float* g, int h) {
    __shared__ float red[32];
    size_t o = (size_t)blockIdx.x * h;
    float s = 0.f;
    for (int i = threadIdx.x; i < h; i += blockDim.x) s += g[i] * X[o + i];
    s = block_sum(s, red);
    float gate = 1.f / (1.f + expf(-s));
    for (int i = threadIdx.x; i < h; i += blockDim.x) P[o + i] += gate * D[o + i];
}
