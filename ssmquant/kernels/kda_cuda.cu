// Fused KDA decode emulation, one RNE variant with dynamic per-row scales (FP8 E4M3, INT8 or NVFP4) beside the FP32
// reference, all T steps in one launch. Compiled at run time by NVRTC from ssmquant/kernels/kda_cuda.py, which
// prepends the configuration's #defines (FMT, QMAX, BUF, ALWAYS, HAS_S0, DEBUG_STATES, QK_T, QK_F32, V_T, LOAD_QK,
// LOAD_V) and says what the kernel computes and why it is written this way.

#define DK 128
#define HALF 64
#define BLOCK_P 16
// the step's vectors by cp.async straight into shared memory where they need no conversion (fp32 k and q, no
// buffered copy of k), else through registers
#define ASYNC_LOADS (QK_F32 && BUF == 0)

__device__ __forceinline__ float bf16_rne(float x) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return __uint_as_float(((unsigned)h) << 16);
}

__device__ __forceinline__ float fp16_rne(float x) {
    unsigned short h;
    float r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h));
    return r;
}

// 2-byte floats loaded as FP32 (exact)
__device__ __forceinline__ float ld_f32(const float* p) { return *p; }
__device__ __forceinline__ float ld_bf16(const unsigned short* p) { return __uint_as_float(((unsigned)*p) << 16); }
__device__ __forceinline__ float ld_f16(const unsigned short* p) {
    float r;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(*p));
    return r;
}

// the variant's k at key channels i..i+3: the buffered copy in shared memory, or k itself without a buffer dtype
#if BUF != 0
#define BUFFERED_K(name) float name[4]; ld4(kb + i, name)
#else
#define BUFFERED_K(name) const float* name = k_
#endif

#if BUF == 1
#define ROUND_BUF(x) bf16_rne(x)
#elif BUF == 2
#define ROUND_BUF(x) fp16_rne(x)
#else
#define ROUND_BUF(x) (x)
#endif

// four consecutive floats (16-byte aligned) into registers
__device__ __forceinline__ void ld4(const float* p, float (&out)[4]) {
    const float4 x = *reinterpret_cast<const float4*>(p);
    out[0] = x.x;
    out[1] = x.y;
    out[2] = x.z;
    out[3] = x.w;
}

// one step's k and q (4 channels of QK_T) and decays (4 fp32) of this lane, into registers
__device__ __forceinline__ void load_step(const QK_T* kp, const QK_T* qp, const float* ap, float (&pk)[4], float (&pq)[4],
                                          float (&pa)[4]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        pk[j] = LOAD_QK(kp + j);
        pq[j] = LOAD_QK(qp + j);
    }
    ld4(ap, pa);
}

#if ASYNC_LOADS
// one step's k, q (fp32) and decays of this lane (16 bytes each) into buf's rows 0, 1, 2 by cp.async: no registers
// held while they travel (the kernel's state takes nearly all of them); waited for by cp.async.wait_all
__device__ __forceinline__ void copy_step(float* buf, const float* kp, const float* qp, const float* ap, int lane) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(buf + lane * 4);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(s), "l"(kp) : "memory");
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(s + 4 * DK), "l"(qp) : "memory");
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(s + 8 * DK), "l"(ap) : "memory");
    asm volatile("cp.async.commit_group;" ::: "memory");
}
#endif

// dd[c] += (s - r)^2 for two elements, into chain c and c + 1
__device__ __forceinline__ void add_sq_diffs(float (&dd)[4], int c, float s0, float r0, float s1, float r1) {
    const float d0 = __fsub_rn(s0, r0), d1 = __fsub_rn(s1, r1);
    dd[c] = __fmaf_rn(d0, d0, dd[c]);
    dd[c + 1] = __fmaf_rn(d1, d1, dd[c + 1]);
}

// two values to FP8 E4M3 (RNE, saturating at 448) and back to FP32
__device__ __forceinline__ void e4m3_round2(float a, float b, float& ra, float& rb) {
    unsigned short p;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(p) : "f"(a), "f"(b));  // a -> upper byte, b -> lower
    unsigned h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(p));
    const unsigned short lo = (unsigned short)(h2 & 0xffffu), hi = (unsigned short)(h2 >> 16);
    asm("cvt.f32.f16 %0, %1;" : "=f"(ra) : "h"(hi));
    asm("cvt.f32.f16 %0, %1;" : "=f"(rb) : "h"(lo));
}

#define FULL_MASK 0xffffffffu

#if FMT == 5

// --- NVFP4 (FMT 5): the write of formats.codec.encode / rounding.nvfp4_blocks -------------------------------------
// The reference divides each block amax by 6 s2 and each element by its block's decode scale d, correctly rounded.
// Here one correctly rounded reciprocal per lane (of 6 s2) and per block (of d) give the same quotients by
// Markstein's correction (quotient_rn, as rounding.quotient_rn: exact while nothing leaves FP32's normal range),
// and the elements are rounded by e2m1_rne_centred (rounding.rne_centered). Both are exact only where s2 lies in
// [S2_MIN, S2_MAX] and every quotient stays below 6.5 (e2m1_rne_centred needs |v| < 7; the reference clamps at 6;
// a block scale quotient too small to be exact rounds every element of its block to 0 with either scale, see
// rounding.py's _S2_MIN): the per-block and per-row values decide that before any element is
// touched, and where a lane's row or block does not meet it, the warp takes the reference's divisions instead
// (warp-uniform: one vote, no divergence). Rounding.py says where the bounds come from.
#define S2_MIN 0x1p-68f
#define S2_MAX 0x1p90f
#define STASH_STRIDE 68  // floats per lane in the fallback's stash: 64 + 4, so that 8 lanes' 16-byte stores hit distinct banks

// 1 / b correctly rounded, for |b| in [2^-120, 2^120]: the fast path of __frcp_rn without its range check
// (rounding.reciprocal_rn): MUFU.RCP within one ulp, then one Newton-Raphson step with FMAs
__device__ __forceinline__ float reciprocal_rn(float b) {
    float y0;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y0) : "f"(b));
    return __fmaf_rn(-__fmaf_rn(b, y0, -1.f), y0, y0);
}

// a / b correctly rounded from y = RN(1 / b): q = RN(a y), the exact residual a - b q, then q + r y rounded once
__device__ __forceinline__ float quotient_rn(float a, float b, float y) {
    const float q = __fmul_rn(a, y);
    const float r = __fmaf_rn(-q, b, a);
    return __fmaf_rn(r, y, q);
}

// E2M1 RNE (saturating at 6) of v, sign kept: the values of rounding.rne_with_distance(min(|v|, 6), 1, 0) with
// the sign restored, as formats.grids.round_to_grid (exact, for the fallback). p = 2^max(e, 0) (e: a's exponent) is
// twice the spacing; a + 2^22 p (one FMA, the product exact) has an ulp of one spacing, so it rounds a to the grid
// half to even, and subtracting 2^22 p is exact.
__device__ __forceinline__ float e2m1_rne(float v) {
    const float a = fminf(fabsf(v), 6.f);
    const float p = __uint_as_float(__float_as_uint(fmaxf(a, 1.f)) & 0x7f800000u);
    const float out = __fmaf_rn(-p, 0x1p22f, __fmaf_rn(p, 0x1p22f, a));
    return __uint_as_float(__float_as_uint(out) | (__float_as_uint(v) & 0x80000000u));
}

// The fast path's E2M1 RNE of a quotient v with |v| < 7 (6 for v in (6, 7), as the reference's clamp gives):
// rounding.rne_centered. With 2^E <= max(|v|, 1) < 2^(E + 1), c = 1.5 x 2^(E + 22) sits in the middle of a binade
// whose ulp is the spacing 2^(E - 1), and v + c stays in it, so RN(v + c) - c (two FMAs, the second exact) is v
// rounded to the grid, ties to even. A negative v that rounds to zero comes back +0 (the reference: -0, which no
// metric and no nonzero value sees); NaN stays NaN.
__device__ __forceinline__ float e2m1_rne_centred(float v) {
    const float p = __uint_as_float(__float_as_uint(fmaxf(fabsf(v), 1.f)) & 0x7f800000u);
    return __fmaf_rn(-p, 0x1.8p22f, __fmaf_rn(p, 0x1.8p22f, v));
}

// The store and reload of this lane's 64 key channels (4 blocks of 16) of one row, in place; bam: the 4 blocks'
// amax. The row's other 64 channels are on lane ^ 16 (the row amax: one shuffle). stash: this lane's STASH_STRIDE
// floats of shared memory (16-byte aligned), used by the fallback only. Returns whether the warp took it.
__device__ __forceinline__ bool nvfp4_write(float (&S)[HALF], const float (&bam)[4], float* stash) {
    float amax = fmaxf(fmaxf(bam[0], bam[1]), fmaxf(bam[2], bam[3]));
    amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, 16));
    float s2 = __fdiv_rn(amax, QMAX);  // QMAX = 6 x 448
    s2 = s2 == 0.f ? 1.f : s2;
    const float den = __fmul_rn(6.f, s2);
    const float rden = reciprocal_rn(den);
    float d[4], rd[4];
    bool bad = !(s2 >= S2_MIN && s2 <= S2_MAX);  // also NaN
#pragma unroll
    for (int b = 0; b < 4; b += 2) {
        // a zero quotient (zero block, underflow) clamps to 2^-9 where the reference takes 1: its elements are 0
        // either way; above, the clamp at 448 is the conversion's (satfinite: RN(x) > 448 saturates to 448, the
        // reference's RN(min(x, 448)))
        float x0 = fmaxf(quotient_rn(bam[b], den, rden), 0x1p-9f), b0;
        float x1 = fmaxf(quotient_rn(bam[b + 1], den, rden), 0x1p-9f), b1;
        e4m3_round2(x0, x1, b0, b1);
        d[b] = __fmul_rn(b0, s2);
        d[b + 1] = __fmul_rn(b1, s2);
        rd[b] = reciprocal_rn(d[b]);
        rd[b + 1] = reciprocal_rn(d[b + 1]);
        // a quotient above 6.5 (bamax > 6.5 d: the sign of bamax - 6.5 d, exact in one FMA, which need not wait for
        // the reciprocal): only for a block scale in E4M3's subnormal range rounded far down (a block ~3 x 10^4
        // below the row's amax)
        bad |= __fmaf_rn(-6.5f, d[b], bam[b]) > 0.f || __fmaf_rn(-6.5f, d[b + 1], bam[b + 1]) > 0.f;
    }
    if (__any_sync(FULL_MASK, bad)) {
        // rare: the reference's correctly rounded divisions, through the stash (a loop per block: little code)
#pragma unroll
        for (int i = 0; i < HALF; i += 4) *reinterpret_cast<float4*>(stash + i) = make_float4(S[i], S[i + 1], S[i + 2], S[i + 3]);
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            float bs = __fdiv_rn(bam[b], den), unused;
            bs = fminf(fmaxf(bs == 0.f ? 1.f : bs, 0x1p-9f), 448.f);
            e4m3_round2(bs, 0.f, bs, unused);
            const float db = __fmul_rn(bs, s2);
#pragma unroll 1
            for (int e = 0; e < 16; ++e) {
                const float x = stash[16 * b + e];
                stash[16 * b + e] = __fmul_rn(e2m1_rne(__fdiv_rn(x, db)), db);
            }
        }
#pragma unroll
        for (int i = 0; i < HALF; i += 4) {
            float x[4];
            ld4(stash + i, x);
#pragma unroll
            for (int j = 0; j < 4; ++j) S[i + j] = x[j];
        }
        return true;
    }
#pragma unroll
    for (int i = 0; i < HALF; ++i) S[i] = __fmul_rn(e2m1_rne_centred(quotient_rn(S[i], d[i >> 4], rd[i >> 4])), d[i >> 4]);
    return false;
}
#endif  // FMT == 5

__device__ __forceinline__ float round_int(float x) {  // half to even at spacing 1, for |x| < 2^22
    const float M = 12582912.0f;  // 1.5 * 2^23
    return __fsub_rn(__fadd_rn(x, M), M);
}

// [||dS||^2, ||S||^2, ||dy||^2, ||y||^2] of one step from each lane's partial sums: a reduce-scatter over the warp
// (each level sends the half it does not keep); lanes 0, 8, 16, 24 end with the four sums and store them to
// out[lane / 8] with a predicated store (no branch, so the step stays one block for the scheduler)
__device__ __forceinline__ void store_metrics(float* out, float m0, float m1, float m2, float m3, int lane, bool enabled) {
    const bool hi16 = (lane & 16) != 0, hi8 = (lane & 8) != 0;
    float k0 = hi16 ? m2 : m0, k1 = hi16 ? m3 : m1;
    const float s0 = hi16 ? m0 : m2, s1 = hi16 ? m1 : m3;
    k0 = __fadd_rn(k0, __shfl_xor_sync(0xffffffffu, s0, 16));
    k1 = __fadd_rn(k1, __shfl_xor_sync(0xffffffffu, s1, 16));
    float kv = hi8 ? k1 : k0;
    const float sv = hi8 ? k0 : k1;
    kv = __fadd_rn(kv, __shfl_xor_sync(0xffffffffu, sv, 8));
    kv = __fadd_rn(kv, __shfl_xor_sync(0xffffffffu, kv, 4));
    kv = __fadd_rn(kv, __shfl_xor_sync(0xffffffffu, kv, 2));
    kv = __fadd_rn(kv, __shfl_xor_sync(0xffffffffu, kv, 1));
    const int go = enabled && (lane & 7) == 0;
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p st.global.f32 [%0], %1;\n}"
                 :: "l"(out + (lane >> 3)), "f"(kv), "r"(go) : "memory");
}

extern "C" __global__ void __launch_bounds__(32) round_e4m3_check(const float* x, float* out, int n) {
    const int i = 2 * (blockIdx.x * 32 + threadIdx.x);
    if (i + 1 < n) {
        float a, b;
        e4m3_round2(x[i], x[i + 1], a, b);
        out[i] = a;
        out[i + 1] = b;
    }
}

#if FMT == 5
// The kernel's NVFP4 write alone, for its tests: x, out [rows, DK] fp32 (rows a multiple of 16), one warp per 16
// rows, the main kernel's layout; fallback[warp] = 1 where the warp took the reference's divisions.
extern "C" __global__ void __launch_bounds__(32) nvfp4_write_check(const float* x, float* out, int* fallback) {
    __shared__ __align__(16) float stash[32 * STASH_STRIDE];
    const int lane = threadIdx.x;
    const long long base = ((long long)blockIdx.x * BLOCK_P + (lane & 15)) * DK + (lane >> 4) * HALF;
    float S[HALF], bam[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int i = 0; i < HALF; i += 4) {
        float v[4];
        ld4(x + base + i, v);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            S[i + j] = v[j];
            bam[i >> 4] = fmaxf(bam[i >> 4], fabsf(v[j]));
        }
    }
    const bool fb = nvfp4_write(S, bam, stash + lane * STASH_STRIDE);
#pragma unroll
    for (int i = 0; i < HALF; ++i) out[base + i] = S[i];
    if (lane == 0) fallback[blockIdx.x] = fb;
}
#endif  // FMT == 5

// q, k [B, T, Hk, DK]; v [B, T, Hv, DV]; alpha [B, T, Hv, DK] fp32; beta [B, T, Hv] fp32; s0 [B, Hv, DV, DK] fp32
// (HAS_S0), the reference's initial state; sv0 the same shape (HAS_SV0), the variant's: s0 stored in its format; write [B, T] int8 (not read when ALWAYS); metrics [T, B, Hv, DV / 16, 4]; states [T, 2, B, Hv, DV, DK]
// fp32, the variant's state before and after each step's write (DEBUG_STATES only, for the tests: not read
// otherwise). Grid (DV / 16, B * Hv), 32 threads.
extern "C" __global__ void __launch_bounds__(32) kda_emulate(
    const QK_T* __restrict__ q, const QK_T* __restrict__ k, const V_T* __restrict__ v,
    const float* __restrict__ alpha, const float* __restrict__ beta, const float* __restrict__ s0,
    const float* __restrict__ sv0, const signed char* __restrict__ write, float* __restrict__ metrics, float* __restrict__ states, int B, int T,
    int HV, int HK, int DV)
{
    __shared__ __align__(16) float sm[2][4][DK];  // [step parity][k, q, decay, k rounded to the buffer][DK]
#if FMT == 5
    __shared__ __align__(16) float stash[32 * STASH_STRIDE];  // the state before an NVFP4 write (its fallback)
#endif
    const int lane = threadIdx.x;
    const int col = lane & 15, half = lane >> 4;
    const int pid_p = blockIdx.x, npb = gridDim.x;
    const int bh = blockIdx.y;
    const int b = bh / HV, h = bh % HV, hk = h / (HV / HK);
    const int row = pid_p * BLOCK_P + col;
    float R[HALF], S[HALF];
#if HAS_S0
    {
        const float* sp = s0 + (((long long)b * HV + h) * DV + row) * DK + half * HALF;
#pragma unroll
        for (int i = 0; i < HALF; i += 4) {
            float x[4];
            ld4(sp + i, x);
#pragma unroll
            for (int j = 0; j < 4; ++j) R[i + j] = x[j];
        }
    }
#else
#pragma unroll
    for (int i = 0; i < HALF; ++i) R[i] = 0.f;
#endif
#if HAS_SV0
    {
        const float* sp = sv0 + (((long long)b * HV + h) * DV + row) * DK + half * HALF;
#pragma unroll
        for (int i = 0; i < HALF; i += 4) {
            float x[4];
            ld4(sp + i, x);
#pragma unroll
            for (int j = 0; j < 4; ++j) S[i + j] = x[j];
        }
    }
#else
#pragma unroll
    for (int i = 0; i < HALF; ++i) S[i] = R[i];
#endif
    // per-step pointers, advanced by one step's stride (no 64-bit index arithmetic in the loop)
    const long long qk_step = (long long)HK * DK, a_step = (long long)HV * DK, v_step = (long long)HV * DV;
    const QK_T* kp = k + ((long long)b * T * HK + hk) * DK + lane * 4;
    const QK_T* qp = q + ((long long)b * T * HK + hk) * DK + lane * 4;
    const float* ap = alpha + ((long long)b * T * HV + h) * DK + lane * 4;
    const V_T* vp = v + ((long long)b * T * HV + h) * DV + row;
    const float* bp = beta + (long long)b * T * HV + h;
    const signed char* wp = write + (long long)b * T;
    float* mp = metrics + (((long long)b * HV + h) * npb + pid_p) * 4;
    const long long metric_step = (long long)B * HV * npb * 4;
#if ASYNC_LOADS
    copy_step(&sm[0][0][0], kp, qp, ap, lane);
#else
    float pk[4], pq[4], pa[4];
    load_step(kp, qp, ap, pk, pq, pa);
#endif
    float pm0 = 0.f, pm1 = 0.f, pm2 = 0.f, pm3 = 0.f;  // the previous step's metric partial sums
    float* pmp = mp;
    for (int t = 0; t < T; ++t) {
        float* buf = &sm[t & 1][0][0];
#if ASYNC_LOADS
        asm volatile("cp.async.wait_all;" ::: "memory");  // this lane's copies of this step's vectors
#else
        *reinterpret_cast<float4*>(buf + 0 * DK + lane * 4) = make_float4(pk[0], pk[1], pk[2], pk[3]);
        *reinterpret_cast<float4*>(buf + 1 * DK + lane * 4) = make_float4(pq[0], pq[1], pq[2], pq[3]);
        *reinterpret_cast<float4*>(buf + 2 * DK + lane * 4) = make_float4(pa[0], pa[1], pa[2], pa[3]);
#if BUF != 0
        *reinterpret_cast<float4*>(buf + 3 * DK + lane * 4) =
            make_float4(ROUND_BUF(pk[0]), ROUND_BUF(pk[1]), ROUND_BUF(pk[2]), ROUND_BUF(pk[3]));
#endif
#endif  // ASYNC_LOADS
        const float vv = LOAD_V(vp);
        const float bb = *bp;
#if !ALWAYS
        const signed char w = *wp;
#endif
        vp += v_step;
        bp += HV;
        wp += 1;
#if !ASYNC_LOADS
        if (t + 1 < T) {  // the next step's vectors
            kp += qk_step;
            qp += qk_step;
            ap += a_step;
            load_step(kp, qp, ap, pk, pq, pa);
        }
#endif
        __syncwarp();  // every lane's vectors of this step in shared memory; every lane done with the other buffer
#if ASYNC_LOADS
        if (t + 1 < T) {  // the next step's vectors, into the other buffer
            kp += qk_step;
            qp += qk_step;
            ap += a_step;
            copy_step(&sm[(t + 1) & 1][0][0], kp, qp, ap, lane);
        }
#endif
        store_metrics(pmp, pm0, pm1, pm2, pm3, lane, t > 0);
        const float* kk = buf + 0 * DK + half * HALF;
        const float* qq = buf + 1 * DK + half * HALF;
        const float* aa = buf + 2 * DK + half * HALF;
#if BUF != 0
        const float* kb = buf + 3 * DK + half * HALF;
#endif
        // decay, then S k: four FMA chains per state
        float dr[4] = {0.f, 0.f, 0.f, 0.f}, ds[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int i = 0; i < HALF; i += 4) {
            float a_[4], k_[4];
            ld4(aa + i, a_);
            ld4(kk + i, k_);
            BUFFERED_K(kb_);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                R[i + j] = __fmul_rn(a_[j], R[i + j]);
                S[i + j] = __fmul_rn(a_[j], S[i + j]);
                dr[j] = __fmaf_rn(R[i + j], k_[j], dr[j]);
                ds[j] = __fmaf_rn(S[i + j], kb_[j], ds[j]);
            }
        }
        float dot_r = __fadd_rn(__fadd_rn(dr[0], dr[1]), __fadd_rn(dr[2], dr[3]));
        float dot_s = __fadd_rn(__fadd_rn(ds[0], ds[1]), __fadd_rn(ds[2], ds[3]));
        // the two halves of Dk; a + b == b + a, so both lanes of a row hold the same sum
        dot_r = __fadd_rn(dot_r, __shfl_xor_sync(0xffffffffu, dot_r, 16));
        dot_s = __fadd_rn(dot_s, __shfl_xor_sync(0xffffffffu, dot_s, 16));
        const float u_r = __fmul_rn(bb, __fsub_rn(vv, dot_r));
        const float u_s = ROUND_BUF(__fmul_rn(bb, __fsub_rn(vv, dot_s)));
        // rank-1 update (one FMA), outputs, ||S||^2 and the row amax; several chains each, for latency
        float yr[4] = {0.f, 0.f, 0.f, 0.f}, ys[4] = {0.f, 0.f, 0.f, 0.f}, rr[4] = {0.f, 0.f, 0.f, 0.f};
        float am[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int i = 0; i < HALF; i += 4) {
            float k_[4], q_[4];
            ld4(kk + i, k_);
            ld4(qq + i, q_);
            BUFFERED_K(kb_);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                R[i + j] = __fmaf_rn(k_[j], u_r, R[i + j]);
                S[i + j] = __fmaf_rn(kb_[j], u_s, S[i + j]);
                yr[j] = __fmaf_rn(R[i + j], q_[j], yr[j]);
                ys[j] = __fmaf_rn(S[i + j], q_[j], ys[j]);
                rr[j] = __fmaf_rn(R[i + j], R[i + j], rr[j]);
#if FMT == 5
                am[(i >> 4) * 2 + (j & 1)] = fmaxf(am[(i >> 4) * 2 + (j & 1)], fabsf(S[i + j]));  // 2 chains a block
#else
                am[(i >> 2 & 1) * 4 + j] = fmaxf(am[(i >> 2 & 1) * 4 + j], fabsf(S[i + j]));
#endif
            }
        }
        float y_r = __fadd_rn(__fadd_rn(yr[0], yr[1]), __fadd_rn(yr[2], yr[3]));
        float y_s = __fadd_rn(__fadd_rn(ys[0], ys[1]), __fadd_rn(ys[2], ys[3]));
        y_r = __fadd_rn(y_r, __shfl_xor_sync(0xffffffffu, y_r, 16));
        y_s = __fadd_rn(y_s, __shfl_xor_sync(0xffffffffu, y_s, 16));
        float dd[4] = {0.f, 0.f, 0.f, 0.f};
#if DEBUG_STATES
        float* st = states + ((((long long)t * 2 * B + b) * HV + h) * DV + row) * DK + half * HALF;
        const long long st_post = (long long)B * HV * DV * DK;
#pragma unroll
        for (int i = 0; i < HALF; ++i) st[i] = S[i];
#endif
#if FMT == 5
#if ALWAYS
        {
#else
        if (w != 0) {
#endif
            const float bam[4] = {fmaxf(am[0], am[1]), fmaxf(am[2], am[3]), fmaxf(am[4], am[5]), fmaxf(am[6], am[7])};
            nvfp4_write(S, bam, stash + lane * STASH_STRIDE);
        }
#pragma unroll
        for (int i = 0; i < HALF; i += 2) add_sq_diffs(dd, (i >> 1 & 1) * 2, S[i], R[i], S[i + 1], R[i + 1]);
#else
        float amax = fmaxf(fmaxf(fmaxf(am[0], am[1]), fmaxf(am[2], am[3])), fmaxf(fmaxf(am[4], am[5]), fmaxf(am[6], am[7])));
#if ALWAYS
        {
#else
        if (w != 0) {
#endif
            // the store and reload: the scales of rounding.fake_quant_tile (same guards), then per element
            // s * mult rounded on its own, rounded to the grid, times dec
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 16));
            float mult = __fdiv_rn(QMAX, amax == 0.f ? 1.f : amax);
            if (amax == 0.f || mult > 3.4028234663852886e38f) mult = 1.f;
            const float dec = __fdiv_rn(1.f, mult);
#pragma unroll
            for (int i = 0; i < HALF; i += 2) {
                const float x0 = __fmul_rn(S[i], mult), x1 = __fmul_rn(S[i + 1], mult);
                float r0, r1;
#if FMT == 3
                e4m3_round2(x0, x1, r0, r1);
#else
                r0 = round_int(x0);
                r1 = round_int(x1);
#endif
                S[i] = __fmul_rn(r0, dec);
                S[i + 1] = __fmul_rn(r1, dec);
                add_sq_diffs(dd, (i >> 1 & 1) * 2, S[i], R[i], S[i + 1], R[i + 1]);
            }
        }
#if !ALWAYS
        else {
#pragma unroll
            for (int i = 0; i < HALF; i += 2) add_sq_diffs(dd, (i >> 1 & 1) * 2, S[i], R[i], S[i + 1], R[i + 1]);
        }
#endif
#endif  // FMT == 5
#if DEBUG_STATES
#pragma unroll
        for (int i = 0; i < HALF; ++i) st[st_post + i] = S[i];
#endif
        // this step's partial sums, reduced over the warp at the top of the next step (their shuffles then overlap
        // that step's arithmetic); each row's y counted once (lanes of the first half)
        const float dy = __fsub_rn(y_s, y_r);
        pm0 = __fadd_rn(__fadd_rn(dd[0], dd[1]), __fadd_rn(dd[2], dd[3]));
        pm1 = __fadd_rn(__fadd_rn(rr[0], rr[1]), __fadd_rn(rr[2], rr[3]));
        pm2 = half == 0 ? __fmul_rn(dy, dy) : 0.f;
        pm3 = half == 0 ? __fmul_rn(y_r, y_r) : 0.f;
        pmp = mp;
        mp += metric_step;
    }
    store_metrics(pmp, pm0, pm1, pm2, pm3, lane, T > 0);
}
