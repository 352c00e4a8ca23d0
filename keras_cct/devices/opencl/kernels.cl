// keras_cct OpenCL kernels: SGEMM, Type 1 (im2col / col2im) and Type 3 (shift-and-add lifting)
// lowerings of a channels-last float32 convolution, bias and their backward passes.
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
#define RN 32

// ---------------------------------------------------------------------------------------------
// C[g] = A[g] (M x K) * B[g] (K x N) (+ beta * C[g]) (+ bias[g] broadcast over rows), batched
// over groups g = get_global_id(2). A(i, k) is A[i * lda + k] (gemm_nn) or A[k * lda + i]
// (gemm_tn). B(k, j) = B[k * ldb + j]. C(i, j) = C[i * ldc + j].
// Global size: (ceil(M / RM), ceil(N / RN), groups), any local size.
// ---------------------------------------------------------------------------------------------
#define GEMM_KERNEL(NAME, A_AT)                                                                   \
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
            _Pragma("unroll")                                                                      \
            for (int r = 0; r < RM; ++r) {                                                         \
                const float av = A_AT(m0 + r, k);                                                  \
                acc0[r] = fma((float16)(av), b0, acc0[r]);                                         \
                acc1[r] = fma((float16)(av), b1, acc1[r]);                                         \
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
GEMM_KERNEL(gemm_nn, A_NN)
GEMM_KERNEL(gemm_tn, A_TN)

// ---------------------------------------------------------------------------------------------
// Type 1 lowering (im2col) for a batch slice: col[(n, oy, ox), (g, i, j, c)] =
// x[n, oy*sh - pt + i*dh, ox*sw - pl + j*dw, g*cg + c] (0 outside the input).
// Global size: (kh * kw, nb * oh * ow).
// ---------------------------------------------------------------------------------------------
__kernel void im2col(__global const float *x, const long offX, __global float *col,
                     const long offCol, const int H, const int W, const int C, const int groups,
                     const int kh, const int kw, const int sh, const int sw, const int dh,
                     const int dw, const int pt, const int pl, const int oh, const int ow)
{
    const int tap = get_global_id(0);
    const long row = get_global_id(1);
    const int i = tap / kw, j = tap % kw;
    const int ox = row % ow;
    const long t = row / ow;
    const int oy = t % oh;
    const long n = t / oh;
    const int cg = C / groups;
    const int y = oy * sh - pt + i * dh, xx = ox * sw - pl + j * dw;
    const long K = (long)groups * kh * kw * cg;
    __global float *dst = col + offCol + row * K + (long)tap * cg;
    if (y < 0 || y >= H || xx < 0 || xx >= W) {
        for (int g = 0; g < groups; ++g)
            for (int c = 0; c < cg; ++c) dst[(long)g * kh * kw * cg + c] = 0.0f;
        return;
    }
    __global const float *src = x + offX + ((n * H + y) * W + xx) * C;
    for (int g = 0; g < groups; ++g)
        for (int c = 0; c < cg; ++c) dst[(long)g * kh * kw * cg + c] = src[g * cg + c];
}

// ---------------------------------------------------------------------------------------------
// Inverse of im2col (col2im) as a gather, one work-item per input pixel (no atomics):
// dx[n, y, x, g*cg + c] = sum over taps (i, j) hitting (y, x) of dcol[(n, oy, ox), (g, i, j, c)].
// Global size: (nb * H * W).
// ---------------------------------------------------------------------------------------------
__kernel void col2im(__global const float *dcol, const long offCol, __global float *dx,
                     const long offX, const int H, const int W, const int C, const int groups,
                     const int kh, const int kw, const int sh, const int sw, const int dh,
                     const int dw, const int pt, const int pl, const int oh, const int ow)
{
    const long p = get_global_id(0);
    const int xx = p % W;
    const long t = p / W;
    const int y = t % H;
    const long n = t / H;
    const int cg = C / groups;
    const long K = (long)groups * kh * kw * cg;
    __global float *dst = dx + offX + p * C;
    for (int c = 0; c < C; ++c) dst[c] = 0.0f;
    for (int i = 0; i < kh; ++i) {
        const int ty = y + pt - i * dh;
        if (ty < 0 || ty % sh) continue;
        const int oy = ty / sh;
        if (oy >= oh) continue;
        for (int j = 0; j < kw; ++j) {
            const int tx = xx + pl - j * dw;
            if (tx < 0 || tx % sw) continue;
            const int ox = tx / sw;
            if (ox >= ow) continue;
            __global const float *src = dcol + offCol + ((n * oh + oy) * ow + ox) * K
                                        + (long)(i * kw + j) * cg;
            for (int g = 0; g < groups; ++g)
                for (int c = 0; c < cg; ++c) dst[g * cg + c] += src[(long)g * kh * kw * cg + c];
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
    const int o = get_global_id(0);
    float s = 0.0f;
    for (long r = 0; r < rows; ++r) s += dy[offDy + r * F + o];
    db[offDb + o] = beta ? db[offDb + o] + s : s;
}
