// keras_cct OpenCL kernels: SGEMM, Type 1 (im2col / col2im) and Type 3 (shift-and-add lifting)
// lowerings of a channels-last float32 convolution, bias and their backward passes. Type 2
// (lowered along the height, lifted along the width) reuses im2col/col2im and lift3/unlift3 on
// one axis each (see worker.py).
//
// All buffers are passed as (pointer, element offset) so that one buffer over the worker's
// shared-memory arena can hold every input and output. Matrices are row-major.
// Tensors are NHWC; a convolution kernel is HWIO (Keras' Conv2D layout).
//
// The GEMM is register-blocked for CPU OpenCL (PoCL): each work-item computes an RM x RN block of C
// with float16 accumulators held in registers and no local memory; a GPU runs it too.

#ifndef RM
#define RM 8
#endif
#if RM != 8
#error "gemm_tn loads RM = 8 values of A at once"
#endif
#define RN 32

// ---------------------------------------------------------------------------------------------
// C[g] = A[g] (M x K) * B[g] (K x N) (+ beta * C[g]) (+ bias[g] broadcast over rows), batched
// over groups g = get_global_id(2). A(i, k) is A[i * lda + k] (gemm_nn) or A[k * lda + i]
// (gemm_tn). B(k, j) = B[k * ldb + j]. C(i, j) = C[i * ldc + j].
// Global size: (ceil(M / RM), ceil(N / RN), groups), any local size.
// ---------------------------------------------------------------------------------------------
#define GEMM_KERNEL(NAME, A_AT, A_LOAD)                                                                   \
__kernel void NAME(const int M, const int N, const int K,                                         \
                   __global const float *A, const long offA, const int lda, const long sAg,       \
                   __global const float *B, const long offB, const int ldb, const long sBg,       \
                   __global float *C, const long offC, const int ldc, const long sCg,             \
                   __global const float *bias, const long offBias, const long sBiasg,             \
                   const int use_bias, const int beta)                                            \
{                                                                                                  \
    const int m0 = get_global_id(0) * RM;                                                          \
    const int n0 = get_global_id(1) * RN;                                                          \
    const int g = get_global_id(2);                                                                \
    if (m0 >= M || n0 >= N) return;                                                                \
    __global const float *a = A + offA + g * sAg;                                                  \
    __global const float *b = B + offB + g * sBg;                                                  \
    __global float *c = C + offC + g * sCg;                                                        \
    if (m0 + RM <= M && n0 + RN <= N) {                                                            \
        float16 acc0[RM], acc1[RM];                                                                \
        _Pragma("unroll")                                                                          \
        for (int r = 0; r < RM; ++r) { acc0[r] = (float16)(0.0f); acc1[r] = (float16)(0.0f); }    \
        for (int k = 0; k < K; ++k) {                                                              \
            const float16 b0 = vload16(0, b + (long)k * ldb + n0);                                 \
            const float16 b1 = vload16(0, b + (long)k * ldb + n0 + 16);                            \
            float av[RM];                                                                          \
            A_LOAD(av, k);                                                                         \
            _Pragma("unroll")                                                                      \
            for (int r = 0; r < RM; ++r) {                                                         \
                acc0[r] = fma((float16)(av[r]), b0, acc0[r]);                                      \
                acc1[r] = fma((float16)(av[r]), b1, acc1[r]);                                      \
            }                                                                                      \
        }                                                                                          \
        float16 bb0 = (float16)(0.0f), bb1 = (float16)(0.0f);                                      \
        if (use_bias) {                                                                            \
            bb0 = vload16(0, bias + offBias + g * sBiasg + n0);                                    \
            bb1 = vload16(0, bias + offBias + g * sBiasg + n0 + 16);                               \
        }                                                                                          \
        _Pragma("unroll")                                                                          \
        for (int r = 0; r < RM; ++r) {                                                             \
            __global float *cr = c + (long)(m0 + r) * ldc + n0;                                    \
            float16 v0 = acc0[r] + bb0, v1 = acc1[r] + bb1;                                        \
            if (beta) { v0 += vload16(0, cr); v1 += vload16(0, cr + 16); }                        \
            vstore16(v0, 0, cr);                                                                   \
            vstore16(v1, 0, cr + 16);                                                              \
        }                                                                                          \
    } else {                                                                                       \
        const int mr = min(RM, M - m0), nr = min(RN, N - n0);                                      \
        float acc[RM][RN];                                                                         \
        for (int r = 0; r < RM; ++r) for (int j = 0; j < RN; ++j) acc[r][j] = 0.0f;               \
        for (int k = 0; k < K; ++k) {                                                              \
            for (int r = 0; r < mr; ++r) {                                                         \
                const float av = A_AT(m0 + r, k);                                                  \
                for (int j = 0; j < nr; ++j)                                                       \
                    acc[r][j] = fma(av, b[(long)k * ldb + n0 + j], acc[r][j]);                     \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < mr; ++r) {                                                             \
            for (int j = 0; j < nr; ++j) {                                                         \
                float v = acc[r][j];                                                               \
                if (use_bias) v += bias[offBias + g * sBiasg + n0 + j];                            \
                __global float *cp = c + (long)(m0 + r) * ldc + n0 + j;                            \
                if (beta) v += *cp;                                                                \
                *cp = v;                                                                           \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
}

#define A_NN(i, k) a[(long)(i) * lda + (k)]
#define A_TN(i, k) a[(long)(k) * lda + (i)]
// RM values of column k of A: RM strided loads (gemm_nn) or one vector load (gemm_tn, RM = 8).
#define LOAD_NN(av, k) _Pragma("unroll") for (int r = 0; r < RM; ++r) av[r] = A_NN(m0 + r, k)
#define LOAD_TN(av, k) vstore8(vload8(0, a + (long)(k) * lda + m0), 0, av)
GEMM_KERNEL(gemm_nn, A_NN, LOAD_NN)
GEMM_KERNEL(gemm_tn, A_TN, LOAD_TN)

// ---------------------------------------------------------------------------------------------
// Type 1 lowering (im2col) for a batch slice: col[(n, oy, ox), (g, i, j, c)] =
// x[n, oy*sh - pt + i*dh, ox*sw - pl + j*dw, g*cg + c] (0 outside the input).
// One work-item per (kernel row i, output row (n, oy)); it fills that row's ow * kw * C values
// (few, long work-items: what a CPU device wants). Global size: (kh, nb * oh).
// ---------------------------------------------------------------------------------------------
__kernel void im2col(__global const float *x, const long offX, __global float *col,
                     const long offCol, const int H, const int W, const int C, const int groups,
                     const int kh, const int kw, const int sh, const int sw, const int dh,
                     const int dw, const int pt, const int pl, const int oh, const int ow)
{
    const int i = get_global_id(0);
    const long r = get_global_id(1);          // n * oh + oy
    const int oy = r % oh;
    const long n = r / oh;
    const int cg = C / groups;
    const int y = oy * sh - pt + i * dh;
    const long K = (long)groups * kh * kw * cg;
    const long gstride = (long)kh * kw * cg;
    const int yin = y >= 0 && y < H;
    __global const float *src = x + offX + (n * H + (yin ? y : 0)) * (long)W * C;
    for (int ox = 0; ox < ow; ++ox) {
        __global float *dst = col + offCol + (r * ow + ox) * K + (long)i * kw * cg;
        for (int j = 0; j < kw; ++j) {
            const int xx = ox * sw - pl + j * dw;
            if (!yin || xx < 0 || xx >= W) {
                for (int g = 0; g < groups; ++g)
                    for (int c = 0; c < cg; ++c) dst[g * gstride + j * cg + c] = 0.0f;
            } else {
                __global const float *s = src + (long)xx * C;
                for (int g = 0; g < groups; ++g)
                    for (int c = 0; c < cg; ++c) dst[g * gstride + j * cg + c] = s[g * cg + c];
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Transposed Type 1 lowering for the kernel gradient: colT[(g, i, j, c), q] with q = (n, oy, ox)
// the output pixel of the batch slice (R of them), so that dW = colT * dy is a gemm_nn whose A
// rows are contiguous (gemm_tn on col would stride by a whole col row per step).
// One work-item per (kernel row i, output row (n, oy)). Global size: (kh, nb * oh).
// ---------------------------------------------------------------------------------------------
__kernel void im2colT(__global const float *x, const long offX, __global float *colT,
                      const long offCol, const long R, const int H, const int W, const int C,
                      const int groups, const int kh, const int kw, const int sh, const int sw,
                      const int dh, const int dw, const int pt, const int pl, const int oh,
                      const int ow)
{
    const int i = get_global_id(0);
    const long r = get_global_id(1);          // n * oh + oy
    const int oy = r % oh;
    const long n = r / oh;
    const int cg = C / groups;
    const int y = oy * sh - pt + i * dh;
    const int yin = y >= 0 && y < H;
    __global const float *src = x + offX + (n * H + (yin ? y : 0)) * (long)W * C;
    for (int g = 0; g < groups; ++g) {
        for (int j = 0; j < kw; ++j) {
            for (int c = 0; c < cg; ++c) {
                __global float *dst = colT + offCol
                    + ((((long)g * kh + i) * kw + j) * cg + c) * R + r * ow;
                __global const float *s = src + g * cg + c;
                for (int ox = 0; ox < ow; ++ox) {
                    const int xx = ox * sw - pl + j * dw;
                    dst[ox] = (yin && xx >= 0 && xx < W) ? s[(long)xx * C] : 0.0f;
                }
            }
        }
    }
}

// The output rows (or columns) o whose window covers the padded input position p satisfy
// p - o*s = k*d with 0 <= k < taps; this is the smallest candidate o.
inline int out_lo(int p, int taps, int s, int d)
{
    const int top = p - (taps - 1) * d;   // o*s >= top
    return top <= 0 ? 0 : (top + s - 1) / s;
}

// ---------------------------------------------------------------------------------------------
// Inverse of im2col (col2im) as a gather (no atomics), one work-item per input row (n, y):
// dx[n, y, x, g*cg + c] = sum over taps (i, j) hitting (y, x) of dcol[(n, oy, ox), (g, i, j, c)].
// Only the taps that hit are visited (about (kh/sh) * (kw/sw) of them). Global size: (nb * H).
// ---------------------------------------------------------------------------------------------
__kernel void col2im(__global const float *dcol, const long offCol, __global float *dx,
                     const long offX, const int H, const int W, const int C, const int groups,
                     const int kh, const int kw, const int sh, const int sw, const int dh,
                     const int dw, const int pt, const int pl, const int oh, const int ow)
{
    const long r = get_global_id(0);          // n * H + y
    const int y = r % H;
    const long n = r / H;
    const int cg = C / groups;
    const long K = (long)groups * kh * kw * cg;
    const long gstride = (long)kh * kw * cg;
    __global float *row = dx + offX + r * W * C;
    for (long q = 0; q < (long)W * C; ++q) row[q] = 0.0f;
    const int py = y + pt;
    const int oy1 = min(oh - 1, py / sh);
    for (int oy = out_lo(py, kh, sh, dh); oy <= oy1; ++oy) {
        const int ry = py - oy * sh;
        int i = ry;
        if (dh != 1) {   // integer division is slow: skip it for the usual dilation 1
            if (ry % dh) continue;
            i = ry / dh;
        }
        __global const float *srow = dcol + offCol + (n * oh + oy) * (long)ow * K
                                     + (long)i * kw * cg;
        for (int xx = 0; xx < W; ++xx) {
            __global float *dst = row + (long)xx * C;
            const int px = xx + pl;
            const int ox1 = min(ow - 1, px / sw);
            for (int ox = out_lo(px, kw, sw, dw); ox <= ox1; ++ox) {
                const int rx = px - ox * sw;
                int j = rx;
                if (dw != 1) {
                    if (rx % dw) continue;
                    j = rx / dw;
                }
                __global const float *src = srow + (long)ox * K + (long)j * cg;
                for (int g = 0; g < groups; ++g)
                    for (int c = 0; c < cg; ++c) dst[g * cg + c] += src[g * gstride + c];
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Type 3 lifting (shift-and-add): T[(n, y, x), (g, i, j, o)] is the GEMM of the input pixels with
// the kernel rearranged to (g, c, (i, j, o)). out[n, oy, ox, g*og + o] = bias + sum over (i, j)
// of T[(n, oy*sh - pt + i*dh, ox*sw - pl + j*dw), (g, i, j, o)] inside the input.
// Global size: (nb * oh * ow).
// ---------------------------------------------------------------------------------------------
__kernel void lift3(__global const float *T, const long offT, __global float *out,
                    const long offOut, __global const float *bias, const long offBias,
                    const int use_bias, const int H, const int W, const int F, const int groups,
                    const int kh, const int kw, const int sh, const int sw, const int dh,
                    const int dw, const int pt, const int pl, const int oh, const int ow)
{
    const long p = get_global_id(0);
    const int ox = p % ow;
    const long t = p / ow;
    const int oy = t % oh;
    const long n = t / oh;
    const int og = F / groups;
    const long L = (long)groups * kh * kw * og;
    __global float *dst = out + offOut + p * F;
    for (int o = 0; o < F; ++o) dst[o] = use_bias ? bias[offBias + o] : 0.0f;
    for (int i = 0; i < kh; ++i) {
        const int y = oy * sh - pt + i * dh;
        if (y < 0 || y >= H) continue;
        for (int j = 0; j < kw; ++j) {
            const int xx = ox * sw - pl + j * dw;
            if (xx < 0 || xx >= W) continue;
            __global const float *src = T + offT + ((n * H + y) * W + xx) * L
                                        + (long)(i * kw + j) * og;
            for (int g = 0; g < groups; ++g)
                for (int o = 0; o < og; ++o) dst[g * og + o] += src[(long)g * kh * kw * og + o];
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Inverse Type 3 lifting: dT[(n, y, x), (g, i, j, o)] = dy[n, oy, ox, g*og + o] where
// y = oy*sh - pt + i*dh and x = ox*sw - pl + j*dw, else 0. Global size: (kh * kw, nb * H * W).
// ---------------------------------------------------------------------------------------------
__kernel void unlift3(__global const float *dy, const long offDy, __global float *dT,
                      const long offT, const int H, const int W, const int F, const int groups,
                      const int kh, const int kw, const int sh, const int sw, const int dh,
                      const int dw, const int pt, const int pl, const int oh, const int ow)
{
    const int tap = get_global_id(0);
    const long p = get_global_id(1);
    const int i = tap / kw, j = tap % kw;
    const int xx = p % W;
    const long t = p / W;
    const int y = t % H;
    const long n = t / H;
    const int og = F / groups;
    const long L = (long)groups * kh * kw * og;
    __global float *dst = dT + offT + p * L + (long)tap * og;
    const int ty = y + pt - i * dh, tx = xx + pl - j * dw;
    int ok = ty >= 0 && tx >= 0 && ty % sh == 0 && tx % sw == 0;
    const int oy = ok ? ty / sh : 0, ox = ok ? tx / sw : 0;
    ok = ok && oy < oh && ox < ow;
    if (!ok) {
        for (int g = 0; g < groups; ++g)
            for (int o = 0; o < og; ++o) dst[(long)g * kh * kw * og + o] = 0.0f;
        return;
    }
    __global const float *src = dy + offDy + ((n * oh + oy) * ow + ox) * F;
    for (int g = 0; g < groups; ++g)
        for (int o = 0; o < og; ++o) dst[(long)g * kh * kw * og + o] = src[g * og + o];
}

// ---------------------------------------------------------------------------------------------
// Bias gradient: db[o] (+)= sum over rows of dy (rows x F). Global size: (F).
// ---------------------------------------------------------------------------------------------
__kernel void colsum(__global const float *dy, const long offDy, const long rows, const int F,
                     __global float *db, const long offDb, const int beta)
{
    // One work-item per 16 columns (one vector load per row) when F is a multiple of 16.
    const int o = get_global_id(0);
    if (F % 16 == 0) {
        if (o * 16 >= F) return;
        float16 s = (float16)(0.0f);
        for (long r = 0; r < rows; ++r) s += vload16(0, dy + offDy + r * F + o * 16);
        if (beta) s += vload16(0, db + offDb + o * 16);
        vstore16(s, 0, db + offDb + o * 16);
        return;
    }
    float s = 0.0f;
    for (long r = 0; r < rows; ++r) s += dy[offDy + r * F + o];
    db[offDb + o] = beta ? db[offDb + o] + s : s;
}

// ---------------------------------------------------------------------------------------------
// C rows = bias (+ C rows): prepares C for a library GEMM with beta = 1. Global size: (rows).
// ---------------------------------------------------------------------------------------------
__kernel void add_bias_rows(__global float *C, const long offC, const int ldc, const int N,
                            __global const float *bias, const long offBias, const int beta)
{
    __global float *c = C + offC + (long)get_global_id(0) * ldc;
    __global const float *b = bias + offBias;
    for (int j = 0; j < N; ++j) c[j] = beta ? c[j] + b[j] : b[j];
}
