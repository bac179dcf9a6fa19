
// ==== kernels_v4.cu: DeepSeek-V4's operations (gpu/v4.rs launches them) ========================
//
// The hyper-connection streams (expand, mix, Sinkhorn weights, collapse, post), V4 attention's
// pieces (per-head norm + interleaved rope, cache row stores, the compressors' pooled entries,
// the lightning indexer's scores and top-k over closed windows, attention over the window and the
// compressed entries with a sink logit per head and the output rotated back), V4 routing
// (sqrtsoftplus / sigmoid / softmax scores, hash or biased top-k) and the clamped SwiGLU, the
// combine. Each is deepseek_v4.rs's `cpu_*` arithmetic (f32, sums of squares in f64), with
// positions read from the device (`*pp + padd + row`) so a captured decode step replays at any
// position. Compiled after kernels.cu and kernels_ops.cu as one translation unit (warp_sum,
// block_sum/max, block_sum_d, fkey, block_scan, silu, Job in scope).

__device__ __forceinline__ float v4_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// Streams of rows 0..n: S[(i*hc + j)*h + c] = X[i*h + c]. len = n*hc*h.
extern "C" __global__ void v4_hc_expand(const float* X, float* S, int h, int hc, int len) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= len) return;
    int c = idx % h, i = idx / (hc * h);
    S[idx] = X[(size_t)i * h + c];
}

// MIX[i*mix_n + j] = fn_j . (S_i * r_i), r_i = 1 / sqrt(mean(S_i^2) + eps) (the streams of row i,
// hch = hc*h values, unweighted RMSNorm with an f64 sum of squares). Grid: (mix_n, n); block 256.
extern "C" __global__ void v4_hc_mix(const float* S, const float* FN, int mix_n, int hch,
                                     float eps, float* MIX) {
    __shared__ double redd[32];
    __shared__ float red[32];
    int j = blockIdx.x, i = blockIdx.y;
    const float* s = S + (size_t)i * hch;
    double ss = 0.0;
    for (int c = threadIdx.x; c < hch; c += blockDim.x) ss += (double)s[c] * (double)s[c];
    ss = block_sum_d(ss, redd);
    float r = (float)(1.0 / sqrt(ss / hch + (double)eps));
    const float* f = FN + (size_t)j * hch;
    float acc = 0.f;
    for (int c = threadIdx.x; c < hch; c += blockDim.x) acc += f[c] * (s[c] * r);
    acc = block_sum(acc, red);
    if (threadIdx.x == 0) MIX[(size_t)i * mix_n + j] = acc;
}

// One hyper-connection's post and comb weights of each row from its mix (cpu_hc_pre): post =
// 2 sigmoid(mix * s1 + base), comb = row softmax(mix * s2 + base) + eps, then Sinkhorn: columns,
// then (iters - 1) x (rows, columns), each divided by its sum + eps. One thread per row.
extern "C" __global__ void v4_hc_weights(const float* MIX, const float* base, float s1, float s2,
                                         int hc, int iters, float eps, float* POST, float* COMB,
                                         int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int mix_n = (2 + hc) * hc;
    const float* mix = MIX + (size_t)i * mix_n;
    for (int j = 0; j < hc; j++) POST[i * hc + j] = 2.f * v4_sigmoid(mix[hc + j] * s1 + base[hc + j]);
    float c[36];
    for (int a = 0; a < hc; a++) {
        float mx = -INFINITY;
        for (int b = 0; b < hc; b++) {
            int k = 2 * hc + a * hc + b;
            c[a * hc + b] = mix[k] * s2 + base[k];
            mx = fmaxf(mx, c[a * hc + b]);
        }
        float sum = 0.f;
        for (int b = 0; b < hc; b++) {
            c[a * hc + b] = expf(c[a * hc + b] - mx);
            sum += c[a * hc + b];
        }
        for (int b = 0; b < hc; b++) c[a * hc + b] = c[a * hc + b] / sum + eps;
    }
    for (int it = 0; it < iters; it++) {
        if (it > 0)
            for (int a = 0; a < hc; a++) {
                float sum = 0.f;
                for (int b = 0; b < hc; b++) sum += c[a * hc + b];
                for (int b = 0; b < hc; b++) c[a * hc + b] /= sum + eps;
            }
        for (int b = 0; b < hc; b++) {
            float sum = 0.f;
            for (int a = 0; a < hc; a++) sum += c[a * hc + b];
            for (int a = 0; a < hc; a++) c[a * hc + b] /= sum + eps;
        }
    }
    for (int k = 0; k < hc * hc; k++) COMB[(size_t)i * hc * hc + k] = c[k];
}

// OUT[i*h + c] = sum_j p_j S[(i*hc + j)*h + c], p_j = sigmoid(MIX[i*ms + j] * s + base[j]) + eps
// (the pre weights of a hyper-connection, or the head's). Grid: (ceil(h/256), n); block 256.
extern "C" __global__ void v4_hc_collapse(const float* MIX, int ms, const float* base, float s,
                                          float eps, const float* S, int hc, int h, float* OUT) {
    int c = blockIdx.x * blockDim.x + threadIdx.x, i = blockIdx.y;
    if (c >= h) return;
    const float* mix = MIX + (size_t)i * ms;
    float o = 0.f;
    for (int j = 0; j < hc; j++) {
        float p = v4_sigmoid(mix[j] * s + base[j]) + eps;
        o += p * S[((size_t)i * hc + j) * h + c];
    }
    OUT[(size_t)i * h + c] = o;
}

// Streams of row i = post x P_i + comb^T x streams (cpu_hc_post), in place. Grid: (ceil(h/256),
// n); block 256.
extern "C" __global__ void v4_hc_post(float* S, const float* P, const float* POST,
                                      const float* COMB, int hc, int h) {
    int c = blockIdx.x * blockDim.x + threadIdx.x, i = blockIdx.y;
    if (c >= h) return;
    float sv[8];
    for (int j = 0; j < hc; j++) sv[j] = S[((size_t)i * hc + j) * h + c];
    float p = P[(size_t)i * h + c];
    const float* comb = COMB + (size_t)i * hc * hc;
    for (int o = 0; o < hc; o++) {
        float v = POST[i * hc + o] * p;
        for (int j = 0; j < hc; j++) v += comb[j * hc + o] * sv[j];
        S[((size_t)i * hc + o) * h + c] = v;
    }
}

// Interleaved rotation of pairs (2i, 2i+1) of x[0..rd) by pos * freq[i] (scaled by ms; back: the
// opposite angle), as deepseek_v4::rotate. Threads of the block take the pairs.
__device__ __forceinline__ void v4_rotate(float* x, const float* freq, float ms, int rd, int pos,
                                          int back) {
    for (int p = threadIdx.x; p < rd / 2; p += blockDim.x) {
        float a = (float)pos * freq[p];
        float c = cosf(a) * ms, s = sinf(a) * ms;
        if (back) s = -s;
        float x0 = x[2 * p], x1 = x[2 * p + 1];
        x[2 * p] = x0 * c - x1 * s;
        x[2 * p + 1] = x1 * c + x0 * s;
    }
}

// Each `part`-wide piece (blockIdx.x) of row blockIdx.y of X (row stride ld), in place: norm 0
// none, 1 unweighted RMSNorm, 2 RMSNorm times w (f64 sum of squares); then its last rd values
// rotated at position *pp + padd + row (rd 0: no rotation; back: rotated back). Block 128.
extern "C" __global__ void v4_norm_rope(float* X, int ld, int part, int norm, const float* w,
                                        float eps, int rd, const float* freq, float ms,
                                        const int* pp, int padd, int back) {
    __shared__ double redd[32];
    float* x = X + (size_t)blockIdx.y * ld + (size_t)blockIdx.x * part;
    if (norm) {
        double ss = 0.0;
        for (int c = threadIdx.x; c < part; c += blockDim.x) ss += (double)x[c] * (double)x[c];
        ss = block_sum_d(ss, redd);
        float r = (float)(1.0 / sqrt(ss / part + (double)eps));
        for (int c = threadIdx.x; c < part; c += blockDim.x) {
            float v = x[c] * r;
            x[c] = norm == 2 ? v * w[c] : v;
        }
        __syncthreads();
    }
    if (rd > 0) v4_rotate(x + part - rd, freq, ms, rd, *pp + padd + blockIdx.y, back);
}

// Cache rows: D[(*pp + padd + row) * ds + doff + c] = S[row * ss + c], c < width. Grid: rows.
extern "C" __global__ void v4_store(const float* S, int ss, float* D, int ds, int doff, int width,
                                    const int* pp, int padd) {
    int row = blockIdx.x;
    float* d = D + (size_t)(*pp + padd + row) * ds + doff;
    for (int c = threadIdx.x; c < width; c += blockDim.x) d[c] = S[(size_t)row * ss + c];
}

// The pooled entry of the window closing at row's position t (none unless (t+1) % rate == 0;
// deepseek_v4::pool_entry): per channel a softmax over the window's slots (coff 2: the previous
// window's low half, then this one's high half) of gate + position bias weighting kv, from the V
// rows of cache layer VC (row width vw; kv at voff, gate at voff + 2 dim); then RMSNorm (nw) and
// the last rd values rotated at the window's first position; into K row t at koff. Grid: rows;
// block 128; shared: dim floats.
extern "C" __global__ void v4_pool(const float* VC, int vw, float* KC, int kw, int koff,
                                   const float* bias, const float* nw, int rate, int coff,
                                   int dim, int voff, float eps, int rd, const float* freq,
                                   float ms, const int* pp, int padd) {
    __shared__ double redd[32];
    extern __shared__ float pool_sh[];
    int t = *pp + padd + blockIdx.x;
    if ((t + 1) % rate != 0) return;
    int win = t / rate, wd = coff * dim;
    int goff = voff + 2 * dim;
    int hi = coff == 2 ? dim : 0;
    for (int ch = threadIdx.x; ch < dim; ch += blockDim.x) {
        float mx = -INFINITY;
        if (coff == 2 && win > 0)
            for (int r = 0; r < rate; r++) {
                const float* row = VC + (size_t)((win - 1) * rate + r) * vw;
                mx = fmaxf(mx, row[goff + ch] + bias[r * wd + ch]);
            }
        for (int r = 0; r < rate; r++) {
            const float* row = VC + (size_t)(win * rate + r) * vw;
            mx = fmaxf(mx, row[goff + hi + ch] + bias[r * wd + hi + ch]);
        }
        float s = 0.f, acc = 0.f;
        if (coff == 2 && win > 0)
            for (int r = 0; r < rate; r++) {
                const float* row = VC + (size_t)((win - 1) * rate + r) * vw;
                float e = expf(row[goff + ch] + bias[r * wd + ch] - mx);
                s += e;
                acc += e * row[voff + ch];
            }
        for (int r = 0; r < rate; r++) {
            const float* row = VC + (size_t)(win * rate + r) * vw;
            float e = expf(row[goff + hi + ch] + bias[r * wd + hi + ch] - mx);
            s += e;
            acc += e * row[voff + hi + ch];
        }
        pool_sh[ch] = acc / s;
    }
    __syncthreads();
    double ss = 0.0;
    for (int c = threadIdx.x; c < dim; c += blockDim.x)
        ss += (double)pool_sh[c] * (double)pool_sh[c];
    ss = block_sum_d(ss, redd);
    float r = (float)(1.0 / sqrt(ss / dim + (double)eps));
    for (int c = threadIdx.x; c < dim; c += blockDim.x) pool_sh[c] = pool_sh[c] * r * nw[c];
    __syncthreads();
    v4_rotate(pool_sh + dim - rd, freq, ms, rd, win * rate, 0);
    __syncthreads();
    float* out = KC + (size_t)t * kw + koff;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) out[c] = pool_sh[c];
}

// Index scores of row t (position *pp + padd + t) over its closed windows e < (pos + 1) / rate,
// only when there are more than topk of them: SC[t*lds + e] = sum_h relu(q_h . key_e) * sm *
// w_h, key_e at KC + ((e+1)*rate - 1)*kw + koff (the pooled indexer key). One warp per entry.
// Grid: (ceil(entries / 8), rows); block 256.
extern "C" __global__ void v4_idx_scores(const float* IQ, const float* IW, const float* KC,
                                         int kw, int koff, int rate, int nh, int d, float sm,
                                         int topk, const int* pp, int padd, float* SC, int lds) {
    int t = blockIdx.y, lane = threadIdx.x & 31;
    int e = blockIdx.x * 8 + (threadIdx.x >> 5);
    int vis = (*pp + padd + t + 1) / rate;
    if (vis <= topk || e >= vis) return;
    const float* q = IQ + (size_t)t * nh * d;
    const float* w = IW + (size_t)t * nh;
    const float* k = KC + (size_t)((e + 1) * rate - 1) * kw + koff;
    float acc = 0.f;
    for (int hh = 0; hh < nh; hh++) {
        float s = 0.f;
        for (int i = lane; i < d; i += 32) s += q[hh * d + i] * k[i];
        s = warp_sum(s);
        acc += fmaxf(s, 0.f) * sm * w[hh];
    }
    if (lane == 0) SC[(size_t)t * lds + e] = acc;
}

// The topk best-scored entries of row t when it has more than topk closed windows (ties to the
// lower entry, as cpu_attention's selection), ascending into SEL[t*topk ..]; idx_select's radix
// select over the row's vis = (pos + 1) / rate scores. Rows with vis <= topk are left alone (the
// attention takes all their entries). Grid: rows; block 1024.
extern "C" __global__ void v4_idx_select(const float* SC, int lds, int topk, int rate,
                                         const int* pp, int padd, int* SEL) {
    __shared__ int hist[256];
    __shared__ int ws[32];
    __shared__ u32 sh_prefix;
    __shared__ int sh_rem;
    int t = blockIdx.x;
    int len = (*pp + padd + t + 1) / rate;
    if (len <= topk) return;
    int* sel = SEL + (size_t)t * topk;
    const float* sc = SC + (size_t)t * lds;
    u32 prefix = 0, mask = 0;
    int rem = topk;
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
}

// V4 attention of row t (position pos = *pp + padd + t), head hh (cpu_attention): the window's
// K rows (the last `window` positions, kv at offset 0 of each row of KC, kw wide) then, with
// kind 1 (CSA) or 2 (HCA), the pooled entries at ((e+1)*rate - 1)*kw + hd: every closed window
// (HCA, or CSA with at most topk of them), else SEL's topk; logits q.k * scale, softmax with the
// head's sink logit, the output the weighted sum of the same rows (shared KV), its last rd values
// rotated back by pos. SC: nmax floats per (row, head). Grid: (heads, rows); block 128; shared
// hd floats.
extern "C" __global__ void v4_attend(const float* Q, const float* KC, int kw, int hd,
                                     int window, int kind, int rate, int topk, const int* SEL,
                                     const float* sinks, float scale, float* SC, int nmax,
                                     float* O, int rd, const float* freq, float ms, const int* pp,
                                     int padd) {
    __shared__ float red[32];
    extern __shared__ float att_sh[];
    int hh = blockIdx.x, t = blockIdx.y, heads = gridDim.x;
    int pos = *pp + padd + t;
    int first = max(0, pos + 1 - window);
    int nwin = pos + 1 - first;
    int nent = 0;
    const int* sel = nullptr;
    if (kind != 0) {
        int vis = (pos + 1) / rate;
        nent = vis;
        if (kind == 1 && vis > topk) {
            nent = topk;
            sel = SEL + (size_t)t * topk;
        }
    }
    int total = nwin + nent;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const float* q = Q + ((size_t)t * heads + hh) * hd;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) att_sh[i] = q[i];
    __syncthreads();
    float* sc = SC + ((size_t)t * heads + hh) * nmax;
    float sink = sinks[hh];
    float mx = sink;
    for (int j = warp; j < total; j += nw) {
        const float* k;
        if (j < nwin) {
            k = KC + (size_t)(first + j) * kw;
        } else {
            int e = sel ? sel[j - nwin] : j - nwin;
            k = KC + (size_t)((e + 1) * rate - 1) * kw + hd;
        }
        float s = 0.f;
        for (int i = lane; i < hd; i += 32) s += att_sh[i] * k[i];
        s = warp_sum(s) * scale;
        if (lane == 0) sc[j] = s;
        mx = fmaxf(mx, s);
    }
    mx = block_max(mx, red);
    float sum = 0.f;
    for (int j = threadIdx.x; j < total; j += blockDim.x) {
        float e = expf(sc[j] - mx);
        sc[j] = e;
        sum += e;
    }
    sum = block_sum(sum, red);
    float inv = 1.f / (sum + expf(sink - mx));
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0.f;
        for (int j = 0; j < total; j++) {
            const float* k;
            if (j < nwin) {
                k = KC + (size_t)(first + j) * kw;
            } else {
                int e = sel ? sel[j - nwin] : j - nwin;
                k = KC + (size_t)((e + 1) * rate - 1) * kw + hd;
            }
            a += sc[j] * inv * k[d];
        }
        att_sh[d] = a;
    }
    __syncthreads();
    v4_rotate(att_sh + hd - rd, freq, ms, rd, pos, 1);
    __syncthreads();
    float* o = O + ((size_t)t * heads + hh) * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) o[d] = att_sh[d];
}

// V4 routing of row i (cpu_moe): scores from the router logits R (score 0 sqrtsoftplus, 1
// sigmoid, 2 softmax), the k experts from tid2eid[token] (T2E non-null: hash layers) or the top k
// of score + bias (ties to the lower index), weights score / (sum + 1e-20) * rscale. SEL: i32
// experts, SW: weights, (n, k). Grid: n; block 32; shared: e floats.
extern "C" __global__ void v4_route(const float* R, int e, int k, int score, const float* bias,
                                    const int* T2E, const int* tokens, float rscale, int* SEL,
                                    float* SW) {
    extern __shared__ float rsh[];
    int i = blockIdx.x;
    const float* r = R + (size_t)i * e;
    for (int x = threadIdx.x; x < e; x += blockDim.x) {
        float v = r[x];
        if (score == 0) {
            float sp = v > 20.f ? v : log1pf(expf(v));
            v = sqrtf(sp);
        } else if (score == 1) {
            v = v4_sigmoid(v);
        }
        rsh[x] = v;
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    if (score == 2) {
        float m = -INFINITY;
        for (int x = 0; x < e; x++) m = fmaxf(m, rsh[x]);
        float s = 0.f;
        for (int x = 0; x < e; x++) {
            rsh[x] = expf(rsh[x] - m);
            s += rsh[x];
        }
        float inv = 1.f / s;
        for (int x = 0; x < e; x++) rsh[x] *= inv;
    }
    int* sel = SEL + (size_t)i * k;
    if (T2E) {
        const int* t = T2E + (size_t)tokens[i] * k;
        for (int j = 0; j < k; j++) sel[j] = t[j];
    } else {
        for (int j = 0; j < k; j++) {
            int best = -1;
            for (int x = 0; x < e; x++) {
                bool taken = false;
                for (int jj = 0; jj < j; jj++) taken |= sel[jj] == x;
                if (taken) continue;
                if (best < 0 || rsh[x] + bias[x] > rsh[best] + bias[best]) best = x;
            }
            sel[j] = best;
        }
    }
    float sum = 0.f;
    for (int j = 0; j < k; j++) sum += rsh[sel[j]];
    for (int j = 0; j < k; j++) SW[(size_t)i * k + j] = rsh[sel[j]] / (sum + 1e-20f) * rscale;
}

// V4's clamped SwiGLU in place on G: silu(min(g, limit)) * clamp(u, -limit, limit). len values.
extern "C" __global__ void v4_swiglu(float* G, const float* U, int len, float limit) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    float g = fminf(G[i], limit);
    float u = fminf(fmaxf(U[i], -limit), limit);
    G[i] = silu(g) * u;
}

// P[i*h + c] += sum_j SW[i*k + j] * SO[(i*k + j)*h + c], slots in order (P holds the shared
// expert's output, as cpu_moe adds). Grid: (ceil(h/256), n); block 256.
extern "C" __global__ void v4_combine(float* P, const float* SO, const float* SW, int k, int h) {
    int c = blockIdx.x * blockDim.x + threadIdx.x, i = blockIdx.y;
    if (c >= h) return;
    float v = P[(size_t)i * h + c];
    for (int j = 0; j < k; j++) v += SW[(size_t)i * k + j] * SO[((size_t)i * k + j) * h + c];
    P[(size_t)i * h + c] = v;
}
