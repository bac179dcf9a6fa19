// ==== The quant types added for community GGUFs (issue 17) ====
//
// Compiled after kernels.cu as one translation unit (scripts/build-ptx.py): uses its helpers
// (h2f, ld16, ld32, ld2x16, dp4, ONES), its per-type macros and its ksigns_iq2xs table.
//
// Each type has the f32-activation kernels (TYPE_KERNELS: mm_, moe_gate_up_, moe_down_,
// embed_) from a `T*` struct whose deq32 writes the values of one 32-value chunk exactly as the
// CPU's dequantizer (src/kernels/<type>.rs) computes them: the same f32 operations in the same
// order, with __fmul_rn / __fadd_rn so that no multiply-add is fused (the CPU's dequantization
// is bit-identical to the `gguf` package, and so is this). The 32-value types (Q4_1, Q5_0, Q5_1,
// IQ4_NL) and IQ4_XS also have the int8-activation kernels (QTYPE_KERNELS, `Q*` structs, dp4a
// on the weights' integer codes) and the tensor-core prefill GEMM (GEMM_KERNELS, `G*` structs
// that unpack a chunk to int8 codes, scales and a min).
//
// Grids and codebooks are filled by the host at load (driver.rs fill_tables) from the CPU's own
// tables (src/kernels/iq_grids.rs, tables.rs, iq4_nl.rs), so both read the same numbers.

__device__ u64 iq2xs_grid[512];
__device__ u64 iq2s_grid[1024];
__device__ u32 iq3xxs_grid[256];
__device__ u32 iq3s_grid[512];
__device__ u64 iq1s_grid[2048];
__device__ __align__(4) i8 iq4nl_values[16];

__device__ __forceinline__ float rmul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float radd(float a, float b) { return __fadd_rn(a, b); }

// Nibble i (< 32) of a 32-block's 16 code bytes: low nibbles are elements 0..15, high 16..31.
__device__ __forceinline__ int nib32(const u8* qs, int i) {
    return i < 16 ? (qs[i] & 15) : (qs[i - 16] >> 4);
}

// ---- f32-activation dequantizers ---------------------------------------------------------------

struct TQ4_1 {
    enum { BE = 32, BB = 20 };
    static __device__ __forceinline__ void deq32(const u8* b, int, int, float* v) {
        float d = h2f(ld16(b)), m = h2f(ld16(b + 2));
#pragma unroll
        for (int i = 0; i < 32; i++) v[i] = radd(rmul(d, (float)nib32(b + 4, i)), m);
    }
};
struct TQ5_0 {
    enum { BE = 32, BB = 22 };
    static __device__ __forceinline__ void deq32(const u8* b, int, int, float* v) {
        float d = h2f(ld16(b));
        u32 qh = ld32(b + 2);
#pragma unroll
        for (int i = 0; i < 32; i++)
            v[i] = rmul(d, (float)((int)(nib32(b + 6, i) | ((qh >> i) & 1) << 4) - 16));
    }
};
struct TQ5_1 {
    enum { BE = 32, BB = 24 };
    static __device__ __forceinline__ void deq32(const u8* b, int, int, float* v) {
        float d = h2f(ld16(b)), m = h2f(ld16(b + 2));
        u32 qh = ld32(b + 4);
#pragma unroll
        for (int i = 0; i < 32; i++)
            v[i] = radd(rmul(d, (float)(nib32(b + 8, i) | (((qh >> i) & 1) << 4))), m);
    }
};
struct TIQ4_NL {
    enum { BE = 32, BB = 18 };
    static __device__ __forceinline__ void deq32(const u8* b, int, int, float* v) {
        float d = h2f(ld16(b));
#pragma unroll
        for (int i = 0; i < 32; i++) v[i] = rmul(d, (float)iq4nl_values[nib32(b + 2, i)]);
    }
};
// IQ4_XS sub-block j's 6-bit scale, less 32.
__device__ __forceinline__ int iq4xs_scale(const u8* b, int j) {
    int lo = (b[4 + j / 2] >> (4 * (j % 2))) & 15;
    int hi = (ld16(b + 2) >> (2 * j)) & 3;
    return (lo | (hi << 4)) - 32;
}
struct TIQ4_XS {
    enum { BE = 256, BB = 136 };
    static __device__ __forceinline__ void deq32(const u8* b, int j, int, float* v) {
        float dl = rmul(h2f(ld16(b)), (float)iq4xs_scale(b, j));
        const u8* qs = b + 8 + 16 * j;
#pragma unroll
        for (int i = 0; i < 32; i++) v[i] = rmul(dl, (float)iq4nl_values[nib32(qs, i)]);
    }
};
// TQ1_0: digit n (< 5) of byte q, 0..2 (a base-3 fixed-point fraction).
__device__ __forceinline__ int tq1_digit(u32 q, int n) {
    u32 p = n == 0 ? 1u : n == 1 ? 3u : n == 2 ? 9u : n == 3 ? 27u : 81u;
    return (int)((((q * p) & 255) * 3) >> 8);
}
struct TTQ1_0 {
    enum { BE = 256, BB = 54 };
    static __device__ __forceinline__ void deq32(const u8* b, int j, int, float* v) {
        float d = h2f(ld16(b + 52));
#pragma unroll
        for (int l = 0; l < 32; l++) {
            int i = 32 * j + l, q;
            if (i < 160) {
                q = tq1_digit(b[i % 32], i / 32);
            } else if (i < 240) {
                int k = i - 160;
                q = tq1_digit(b[32 + k % 16], k / 16);
            } else {
                int k = i - 240;
                q = tq1_digit(b[48 + k % 4], k / 4);
            }
            v[l] = rmul(d, (float)(q - 1));
        }
    }
};
struct TTQ2_0 {
    enum { BE = 256, BB = 66 };
    static __device__ __forceinline__ void deq32(const u8* b, int j, int, float* v) {
        float d = h2f(ld16(b + 64));
        const u8* q = b + 32 * (j / 4);
        int sh = 2 * (j % 4);
#pragma unroll
        for (int l = 0; l < 32; l++) v[l] = rmul(d, (float)(((q[l] >> sh) & 3) - 1));
    }
};
__device__ __forceinline__ u8 byte_of(u64 w, int c) { return (u8)(w >> (8 * c)); }
__device__ __forceinline__ float sgn(float x, u32 neg) { return neg ? -x : x; }
struct TIQ3_XXS {
    enum { BE = 256, BB = 98 };
    static __device__ __forceinline__ void deq32(const u8* b, int g, int, float* v) {
        float d = h2f(ld16(b));
        u32 aux = ld32(b + 66 + 4 * g);
        float db = rmul(rmul(d, radd(0.5f, (float)(aux >> 28))), 0.5f);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            u32 signs = ksigns_iq2xs[(aux >> (7 * k)) & 0x7f];
            u32 g0 = iq3xxs_grid[b[2 + 8 * g + 2 * k]], g1 = iq3xxs_grid[b[3 + 8 * g + 2 * k]];
#pragma unroll
            for (int c = 0; c < 8; c++) {
                float gv = (float)byte_of(c < 4 ? g0 : g1, c % 4);
                v[8 * k + c] = sgn(rmul(db, gv), (signs >> c) & 1);
            }
        }
    }
};
struct TIQ3_S {
    enum { BE = 256, BB = 110 };
    static __device__ __forceinline__ void deq32(const u8* b, int g, int, float* v) {
        float d = h2f(ld16(b));
        int s = (b[106 + g / 2] >> (4 * (g % 2))) & 15;
        float db = rmul(d, (float)(1 + 2 * s));
        u32 neg = ld32(b + 74 + 4 * g);
#pragma unroll
        for (int r = 0; r < 8; r++) {
            int i = 8 * g + r;  // 4-value row within the block
            int row = b[2 + i] | (((b[66 + i / 8] >> (i % 8)) & 1) << 8);
            u32 gw = iq3s_grid[row];
#pragma unroll
            for (int c = 0; c < 4; c++) {
                int l = 4 * r + c;
                v[l] = sgn(rmul(db, (float)byte_of(gw, c)), (neg >> l) & 1);
            }
        }
    }
};
struct TIQ2_XS {
    enum { BE = 256, BB = 74 };
    static __device__ __forceinline__ void deq32(const u8* b, int g, int, float* v) {
        float d = h2f(ld16(b));
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int i = 4 * g + k;  // 8-value row
            int s = (b[66 + i / 4] >> (4 * ((i / 2) % 2))) & 15;
            float db = rmul(rmul(d, radd(0.5f, (float)s)), 0.25f);
            u32 q = ld16(b + 2 + 2 * i);
            u64 grid = iq2xs_grid[q & 511];
            u32 signs = ksigns_iq2xs[q >> 9];
#pragma unroll
            for (int c = 0; c < 8; c++)
                v[8 * k + c] = sgn(rmul(db, (float)byte_of(grid, c)), (signs >> c) & 1);
        }
    }
};
struct TIQ2_S {
    enum { BE = 256, BB = 82 };
    static __device__ __forceinline__ void deq32(const u8* b, int g, int, float* v) {
        float d = h2f(ld16(b));
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int i = 4 * g + k;
            int s = (b[74 + i / 4] >> (4 * ((i / 2) % 2))) & 15;
            float db = rmul(rmul(d, radd(0.5f, (float)s)), 0.25f);
            int row = b[2 + i] | (((b[66 + i / 4] >> (2 * (i % 4))) & 3) << 8);
            u64 grid = iq2s_grid[row];
            u32 signs = b[34 + i];
#pragma unroll
            for (int c = 0; c < 8; c++)
                v[8 * k + c] = sgn(rmul(db, (float)byte_of(grid, c)), (signs >> c) & 1);
        }
    }
};
struct TIQ1_S {
    enum { BE = 256, BB = 50 };
    static __device__ __forceinline__ void deq32(const u8* b, int g, int, float* v) {
        float d = h2f(ld16(b));
        u32 qh = ld16(b + 34 + 2 * g);
        float dl = rmul(d, (float)(2 * ((qh >> 12) & 7) + 1));
        float delta = (qh & 0x8000) ? -0.125f : 0.125f;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int i = 4 * g + k;
            u64 grid = iq1s_grid[b[2 + i] | (((qh >> (3 * k)) & 7) << 8)];
#pragma unroll
            for (int c = 0; c < 8; c++)
                v[8 * k + c] = rmul(dl, radd((float)(i8)byte_of(grid, c), delta));
        }
    }
};
struct TIQ1_M {
    enum { BE = 256, BB = 56 };
    static __device__ __forceinline__ void deq32(const u8* b, int g, int, float* v) {
        u32 s0 = ld16(b + 48), s1 = ld16(b + 50), s2 = ld16(b + 52), s3 = ld16(b + 54);
        float d = h2f((u16)((s0 >> 12) | ((s1 >> 8) & 0xf0) | ((s2 >> 4) & 0xf00) | (s3 & 0xf000)));
        u32 sw = ld16(b + 48 + 2 * (g / 2));  // half-groups 2g, 2g+1 sit in word g/2
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int i = 4 * g + k;
            int m = i / 2;
            float dl = rmul(d, (float)(2 * ((sw >> (3 * (m % 4))) & 7) + 1));
            int nb = (b[32 + i / 2] >> (4 * (i % 2))) & 15;
            u64 grid = iq1s_grid[b[i] | ((nb & 7) << 8)];
            float delta = (nb & 8) ? -0.125f : 0.125f;
#pragma unroll
            for (int c = 0; c < 8; c++)
                v[8 * k + c] = rmul(dl, radd((float)(i8)byte_of(grid, c), delta));
        }
    }
};

TYPE_KERNELS(q4_1, TQ4_1)
TYPE_KERNELS(q5_0, TQ5_0)
TYPE_KERNELS(q5_1, TQ5_1)
TYPE_KERNELS(iq4_nl, TIQ4_NL)
TYPE_KERNELS(iq4_xs, TIQ4_XS)
TYPE_KERNELS(tq1_0, TTQ1_0)
TYPE_KERNELS(tq2_0, TTQ2_0)
TYPE_KERNELS(iq3_xxs, TIQ3_XXS)
TYPE_KERNELS(iq3_s, TIQ3_S)
TYPE_KERNELS(iq2_xs, TIQ2_XS)
TYPE_KERNELS(iq2_s, TIQ2_S)
TYPE_KERNELS(iq1_s, TIQ1_S)
TYPE_KERNELS(iq1_m, TIQ1_M)

// ---- int8 codes of the 32-value types and IQ4_XS (dp4a matvec, tensor-core GEMM) --------------

// Bit k (< 4) of the nibble n as bit 4 of byte k (Q5's fifth bit into four codes at once).
__device__ __forceinline__ u32 bit4_bytes(u32 n) {
    return ((n * 0x00204081u) & 0x01010101u) << 4;
}
// The four codebook values of the four nibbles held one per byte of q (0x0n0n0n0n).
__device__ __forceinline__ u32 iq4_lookup(u32 q, u32 t0, u32 t1, u32 t2, u32 t3) {
    u32 lo3 = q & 0x07070707u;
    u32 sel = (lo3 & 7) | ((lo3 >> 4) & 0x70) | ((lo3 >> 8) & 0x700) | ((lo3 >> 12) & 0x7000);
    u32 a = __byte_perm(t0, t1, sel), b = __byte_perm(t2, t3, sel);
    u32 hi = ((q & 0x08080808u) >> 3) * 0xffu;  // 0xff in the bytes whose nibble is >= 8
    return (a & ~hi) | (b & hi);
}
struct Iq4Table {
    u32 t[4];
    __device__ __forceinline__ Iq4Table() {
        const u32* p = (const u32*)iq4nl_values;
#pragma unroll
        for (int i = 0; i < 4; i++) t[i] = p[i];
    }
    __device__ __forceinline__ u32 operator()(u32 q) const { return iq4_lookup(q, t[0], t[1], t[2], t[3]); }
};

// The 32 codes of a 32-block's 16 nibble bytes as 8 words: words 0..3 elements 0..15 (low
// nibbles), 4..7 elements 16..31 (high nibbles); `hb`: the fifth bits (Q5), or 0.
__device__ __forceinline__ void codes32(const u8* qs, u32 hb, u32* w) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 v = (u32)ld2x16(qs + 4 * i);
        w[i] = (v & 0x0f0f0f0fu) | bit4_bytes((hb >> (4 * i)) & 15);
        w[i + 4] = ((v >> 4) & 0x0f0f0f0fu) | bit4_bytes((hb >> (16 + 4 * i)) & 15);
    }
}

// Dot of 8 code words with 32 activation codes, and the activation codes' sum.
__device__ __forceinline__ void dot32(const u32* w, const i8* x, int& s, int& u) {
    int4 x0 = *(const int4*)x, x1 = *(const int4*)(x + 16);
    s = dp4(w[3], x0.w, dp4(w[2], x0.z, dp4(w[1], x0.y, dp4(w[0], x0.x, 0))));
    s = dp4(w[7], x1.w, dp4(w[6], x1.z, dp4(w[5], x1.y, dp4(w[4], x1.x, s))));
    u = dp4(ONES, x0.w, dp4(ONES, x0.z, dp4(ONES, x0.y, dp4(ONES, x0.x, 0))));
    u = dp4(ONES, x1.w, dp4(ONES, x1.z, dp4(ONES, x1.y, dp4(ONES, x1.x, u))));
}

// The 32-value types: item = one block. `OFF`: where the nibbles start; `QH`: where the fifth
// bits are (0: none); `MIN`: an f16 m follows d (value d * c + m); `SUB`: subtracted from codes.
template <int BB_, int OFF, int QH, bool MIN, int SUB, bool NL>
struct QB32 {
    enum { BE = 32, BB = BB_, IPB = 1 };
    static __device__ __forceinline__ void codes(const u8* blk, u32* w) {
        codes32(blk + OFF, QH ? (u32)ld2x16(blk + QH) : 0u, w);
        if (NL) {
            Iq4Table tab;
#pragma unroll
            for (int i = 0; i < 8; i++) w[i] = tab(w[i]);
        }
    }
    static __device__ __forceinline__ void dot(const u8* row, int it, const i8* const* xq,
                                               const float* const* xd, int nt, float* acc) {
        const u8* blk = row + (size_t)it * BB;
        float d = h2f(ld16(blk)), m = MIN ? h2f(ld16(blk + 2)) : 0.f;
        u32 w[8];
        codes(blk, w);
        int off = 32 * it;
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                int s, u;
                dot32(w, xq[t] + off, s, u);
                float c = MIN ? d * (float)s + m * (float)u : d * (float)(s - SUB * u);
                acc[t] += xd[t][it] * c;
            }
        }
    }
    // The GEMM's view (value = d * code - m), codes signed.
    static __device__ __forceinline__ void unpack(const u8* b, int, u32* q, float* d, float& m) {
        codes(b, q);
        if (SUB) {
#pragma unroll
            for (int i = 0; i < 8; i++) q[i] = __vsub4(q[i], SUB * 0x01010101u);
        }
        d[0] = d[1] = h2f(ld16(b));
        m = MIN ? -h2f(ld16(b + 2)) : 0.f;
    }
};
typedef QB32<20, 4, 0, true, 0, false> QQ4_1;
typedef QB32<22, 6, 2, false, 16, false> QQ5_0;
typedef QB32<24, 8, 4, true, 0, false> QQ5_1;
typedef QB32<18, 2, 0, false, 0, true> QIQ4_NL;
struct GB32Half {
    enum { HALF = 0 };
};
struct GQ4_1 : QQ4_1, GB32Half {};
struct GQ5_0 : QQ5_0, GB32Half {};
struct GQ5_1 : QQ5_1, GB32Half {};
struct GIQ4_NL : QIQ4_NL, GB32Half {};

// IQ4_XS: item = one 32-value sub-block (16 code bytes), 8 per block.
struct QIQ4_XS {
    enum { BE = 256, BB = 136, IPB = 8, HALF = 0 };
    static __device__ __forceinline__ void codes(const u8* blk, int j, u32* w) {
        codes32(blk + 8 + 16 * j, 0u, w);
        Iq4Table tab;
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = tab(w[i]);
    }
    static __device__ __forceinline__ void dot(const u8* row, int it, const i8* const* xq,
                                               const float* const* xd, int nt, float* acc) {
        int b = it >> 3, j = it & 7;
        const u8* blk = row + (size_t)b * BB;
        float dl = h2f(ld16(blk)) * (float)iq4xs_scale(blk, j);
        u32 w[8];
        codes(blk, j, w);
        int off = 256 * b + 32 * j;
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                int s, u;
                dot32(w, xq[t] + off, s, u);
                acc[t] += xd[t][off >> 5] * dl * (float)s;
            }
        }
    }
    static __device__ __forceinline__ void unpack(const u8* b, int j, u32* q, float* d, float& m) {
        codes(b, j, q);
        d[0] = d[1] = h2f(ld16(b)) * (float)iq4xs_scale(b, j);
        m = 0.f;
    }
};
typedef QIQ4_XS GIQ4_XS;

QTYPE_KERNELS(q4_1, QQ4_1)
QTYPE_KERNELS(q5_0, QQ5_0)
QTYPE_KERNELS(q5_1, QQ5_1)
QTYPE_KERNELS(iq4_nl, QIQ4_NL)
QTYPE_KERNELS(iq4_xs, QIQ4_XS)

GEMM_KERNELS(q4_1, GQ4_1)
GEMM_KERNELS(q5_0, GQ5_0)
GEMM_KERNELS(q5_1, GQ5_1)
GEMM_KERNELS(iq4_nl, GIQ4_NL)
GEMM_KERNELS(iq4_xs, GIQ4_XS)

// The fused decode path's kernels (kernels_fused.cu: three matrices in one launch, the expert
// down product that quantizes its own rows) for these 8-bit-activation types too.
MMQ3_KERNEL(q4_1, QQ4_1)
MMQ3_KERNEL(q5_0, QQ5_0)
MMQ3_KERNEL(q5_1, QQ5_1)
MMQ3_KERNEL(iq4_nl, QIQ4_NL)
MMQ3_KERNEL(iq4_xs, QIQ4_XS)
DOWN_QS_KERNEL(q4_1, QQ4_1)
DOWN_QS_KERNEL(q5_0, QQ5_0)
DOWN_QS_KERNEL(q5_1, QQ5_1)
DOWN_QS_KERNEL(iq4_nl, QIQ4_NL)
DOWN_QS_KERNEL(iq4_xs, QIQ4_XS)
