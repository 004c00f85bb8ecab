// The host AdamW update of one chunk range in one pass over memory (optim/native_kernel.py builds
// and loads it; docs/host-optimizer.md says why it exists beside the Inductor-generated kernel).
//
// Per element, in fp32 and in this order (torch.optim.AdamW's math, the same expression as
// optim/host_kernel.py's _adamw; built with -ffp-contract=off, so no multiply-add is fused and the
// vector loop and the scalar tail round every operation alike):
//   g  = grad * c0                      (c0: loss-scale inverse times clip coefficient)
//   m' = m + (g - m) * (1 - b1)
//   v' = v * b2 + (g * g) * (1 - b2)
//   p' = p * c1 - (c2 * m') / (sqrt(v') * c3 + eps)   (c1: 1 - lr * wd, c2: lr / bc1, c3: 1 / sqrt(bc2))
// The gradient is fp32, bf16 or fp16; ``out`` (optional) gets p' (fp32: a param chunk apart from
// its master), or p' cast to bf16 or fp16 with the rounding torch's CPU cast uses (round to nearest even; bf16 NaN -> 0xFFFF); master, m and v are
// updated in place, or written into master_out, m_out and v_out with the inputs left as they were.
// No torch header: the file compiles in about a second. AVX2 + FMA + F16C, or AVX-512 where the
// compiler is told to target it; with AVX512-BF16 the bf16 cast is one instruction wherever it
// gives torch's bits (every normal number).
#include <immintrin.h>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

enum Kind : int { NONE = -1, F32 = 0, BF16 = 1, F16 = 2 };

struct Buffers {
    const void* grad; const float* master; const float* m; const float* v;
    float* master_out; float* m_out; float* v_out; void* out;
};

struct Coef { float c0, c1, c2, c3, omb1, b2, omb2, eps; };

// ---- scalars: the tail, and the exact bf16 rounding ----
inline uint16_t bf16_1(float x) {
    if (std::isnan(x)) return 0xFFFF;
    uint32_t b;
    std::memcpy(&b, &x, 4);
    return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

template <int G> inline float load1(const void* p, int64_t i) {
    if (G == F32) return static_cast<const float*>(p)[i];
    const uint16_t h = static_cast<const uint16_t*>(p)[i];
    if (G == F16) return _cvtsh_ss(h);
    uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

template <int O> inline void store1(void* out, int64_t i, float x) {
    if (O == F32) {
        static_cast<float*>(out)[i] = x;
        return;
    }
    uint16_t* p = static_cast<uint16_t*>(out) + i;
    if (O == BF16) *p = bf16_1(x);
    else if (O == F16) *p = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

constexpr int RN = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// ---- vectors: 8 lanes (AVX2) or 16 (AVX-512, where the compiler targets it: 1.3x the 8-lane
// loop's streaming throughput on bf16, measured on Zen 4) ----
struct V8 {
    using T = __m256;
    static constexpr int W = 8;
    static T set1(float x) { return _mm256_set1_ps(x); }
    static T load(const float* p) { return _mm256_loadu_ps(p); }
    static void store(float* p, T x) { _mm256_storeu_ps(p, x); }
    static T add(T a, T b) { return _mm256_add_ps(a, b); }
    static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
    static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
    static T div(T a, T b) { return _mm256_div_ps(a, b); }
    static T sqrt(T a) { return _mm256_sqrt_ps(a); }
    static T load_bf16(const uint16_t* p) {
        __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    static T load_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
    static void store_f16(uint16_t* p, T x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, RN)); }
    static void store_bf16(uint16_t* p, T x) {      // round to nearest even; NaN -> 0xFFFF (torch's cast)
        __m256i b = _mm256_castps_si256(x);
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
        r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0xFFFF), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                         _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
    }
};

#ifdef __AVX512F__
struct V16 {
    using T = __m512;
    static constexpr int W = 16;
    static T set1(float x) { return _mm512_set1_ps(x); }
    static T load(const float* p) { return _mm512_loadu_ps(p); }
    static void store(float* p, T x) { _mm512_storeu_ps(p, x); }
    static T add(T a, T b) { return _mm512_add_ps(a, b); }
    static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
    static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
    static T div(T a, T b) { return _mm512_div_ps(a, b); }
    static T sqrt(T a) { return _mm512_sqrt_ps(a); }
    static T load_bf16(const uint16_t* p) {
        __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    static T load_f16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
    static void store_f16(uint16_t* p, T x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, RN)); }
    static void store_bf16(uint16_t* p, T x) {
#ifdef __AVX512BF16__
        // one instruction, which flushes subnormals and quiets NaNs: vectors with a lane that is
        // not a normal number (zero included: padding, gradless ranges) take the exact path below
        const __m512 tiny = _mm512_set1_ps(FLT_MIN);
        if (!_mm512_cmp_ps_mask(_mm512_abs_ps(x), tiny, _CMP_NGE_UQ)) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
            return;
        }
#endif
        __m512i b = _mm512_castps_si512(x);
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
        r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0xFFFF));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
    }
};
using Vec = V16;
#else
using Vec = V8;
#endif

template <class V> struct VCoef {
    typename V::T c0, c1, c2, c3, omb1, b2, omb2, eps;
    explicit VCoef(const Coef& k)
        : c0(V::set1(k.c0)), c1(V::set1(k.c1)), c2(V::set1(k.c2)), c3(V::set1(k.c3)),
          omb1(V::set1(k.omb1)), b2(V::set1(k.b2)), omb2(V::set1(k.omb2)), eps(V::set1(k.eps)) {}
};

template <class V, int G> inline typename V::T load_grad(const void* p, int64_t i) {
    if (G == F32) return V::load(static_cast<const float*>(p) + i);
    if (G == BF16) return V::load_bf16(static_cast<const uint16_t*>(p) + i);
    return V::load_f16(static_cast<const uint16_t*>(p) + i);
}

// ---- the update ----
template <class V, int G, int O, bool SO> inline void step(const Buffers& b, const VCoef<V>& k, int64_t i) {
    using T = typename V::T;
    T g = V::mul(load_grad<V, G>(b.grad, i), k.c0);
    T m = V::load(b.m + i), v = V::load(b.v + i), p = V::load(b.master + i);
    T m2 = V::add(m, V::mul(V::sub(g, m), k.omb1));
    T v2 = V::add(V::mul(v, k.b2), V::mul(V::mul(g, g), k.omb2));
    T d = V::add(V::mul(V::sqrt(v2), k.c3), k.eps);
    T p2 = V::sub(V::mul(p, k.c1), V::div(V::mul(k.c2, m2), d));
    V::store((SO ? b.m_out : const_cast<float*>(b.m)) + i, m2);
    V::store((SO ? b.v_out : const_cast<float*>(b.v)) + i, v2);
    V::store((SO ? b.master_out : const_cast<float*>(b.master)) + i, p2);
    // (the gradient was read above: ``out`` may be the gradient itself)
    if (O == F32) V::store(static_cast<float*>(b.out) + i, p2);
    if (O == BF16) V::store_bf16(static_cast<uint16_t*>(b.out) + i, p2);
    if (O == F16) V::store_f16(static_cast<uint16_t*>(b.out) + i, p2);
}

constexpr int UNROLL = 2 * Vec::W;

template <int G, int O, bool SO> void vector_part(const Buffers& b, const Coef& c, int64_t lo, int64_t hi) {
    const VCoef<Vec> k(c);
    for (int64_t i = lo; i < hi; i += UNROLL) {
        step<Vec, G, O, SO>(b, k, i);
        step<Vec, G, O, SO>(b, k, i + Vec::W);
    }
}

template <int G, int O, bool SO> void scalar_part(const Buffers& b, const Coef& c, int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
        float g = load1<G>(b.grad, i) * c.c0;
        float m = b.m[i], v = b.v[i], p = b.master[i];
        float m2 = m + (g - m) * c.omb1;
        float v2 = v * c.b2 + (g * g) * c.omb2;
        float p2 = p * c.c1 - (c.c2 * m2) / (std::sqrt(v2) * c.c3 + c.eps);
        (SO ? b.m_out : const_cast<float*>(b.m))[i] = m2;
        (SO ? b.v_out : const_cast<float*>(b.v))[i] = v2;
        (SO ? b.master_out : const_cast<float*>(b.master))[i] = p2;
        if (O != NONE) store1<O>(b.out, i, p2);
    }
}

constexpr int64_t BLOCK = 1 << 14;              // elements per parallel work item (a multiple of UNROLL)

template <int G, int O, bool SO> void run(const Buffers& b, const Coef& c, int64_t n, int threads) {
    const int64_t n16 = n - n % UNROLL, blocks = (n16 + BLOCK - 1) / BLOCK;
    if (threads <= 1 || blocks <= 1) {
        vector_part<G, O, SO>(b, c, 0, n16);
    } else {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t j = 0; j < blocks; ++j) {
            const int64_t lo = j * BLOCK, hi = lo + BLOCK < n16 ? lo + BLOCK : n16;
            vector_part<G, O, SO>(b, c, lo, hi);
        }
    }
    scalar_part<G, O, SO>(b, c, n16, n);
}

template <int G, int O> int with_states(const Buffers& b, const Coef& c, int64_t n, int threads) {
    if (b.master_out) run<G, O, true>(b, c, n, threads);
    else run<G, O, false>(b, c, n, threads);
    return 0;
}

template <int G> int with_out(const Buffers& b, const Coef& c, int64_t n, int okind, int threads) {
    switch (okind) {
        case NONE: return with_states<G, NONE>(b, c, n, threads);
        case F32: return with_states<G, F32>(b, c, n, threads);
        case BF16: return with_states<G, BF16>(b, c, n, threads);
        case F16: return with_states<G, F16>(b, c, n, threads);
        default: return 2;
    }
}

}  // namespace

// 0: done; 1: an unknown gradient kind; 2: an unknown out kind. Nothing is written before the check.
extern "C" int pscompile_host_adamw(const void* grad, int gkind, const float* master, const float* m, const float* v,
                                    const float* coef4, float* master_out, float* m_out, float* v_out,
                                    void* out, int okind, int64_t n, float omb1, float b2, float omb2,
                                    float eps, int threads) {
    const Buffers b{grad, master, m, v, master_out, m_out, v_out, out};
    const Coef c{coef4[0], coef4[1], coef4[2], coef4[3], omb1, b2, omb2, eps};
    if (okind != NONE && okind != F32 && okind != BF16 && okind != F16) return 2;
    switch (gkind) {
        case F32: return with_out<F32>(b, c, n, okind, threads);
        case BF16: return with_out<BF16>(b, c, n, okind, threads);
        case F16: return with_out<F16>(b, c, n, okind, threads);
        default: return 1;
    }
}
