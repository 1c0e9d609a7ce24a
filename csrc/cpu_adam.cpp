// One-pass AdamW / Adam over a flat fp32 shard on the CPU.
//
// Built on first use by lightning_zero/ops/cpu_adam.py (torch.utils.cpp_extension.load); the
// math it must equal is lightning_zero/ops/_reference.py, which mirrors the op order of
// torch.optim.AdamW's single-tensor path. Per element, one pass over memory:
//
//   read   grad (fp32 | bf16 | fp16)         g = grad * grad_scale      (unscale x clip, folded)
//   read   master, exp_avg, exp_avg_sq       (Adam)  g = fma(p, wd, g)
//                                            (AdamW) p = p * (1 - lr * wd)
//                                            m = lerp(m, g, 1 - beta1)
//                                            v = fma((1 - beta2) * g, g, v * beta2)
//                                            p = p + (-step_size * m) / (sqrt(v) / sqrt(bc2) + eps)
//   write  master, exp_avg, exp_avg_sq
//   write  low_precision_out (bf16 | fp16) = round-to-nearest-even(p)      (optional)
//
// That is 28 bytes per element with a bf16 gradient and a bf16 copy, against 48 for torch's
// fused AdamW plus the separate upcast, unscale and copy passes.
//
// [Note: one math, three widths]
// The Adam math is written once (`adam_lanes`) over an `Ops` type that is either 16 lanes of
// AVX-512, 8 lanes of AVX2 or 1 scalar lane. The tail of every chunk runs the scalar `Ops`
// with the same operation order and explicit fma where the vector code uses fma, so a value
// does not depend on where in the buffer (or in which thread's chunk) it sits. The build
// passes -ffp-contract=off for the same reason: the compiler must not fuse a multiply and an
// add on its own in one path and not in another. No -ffast-math: sqrt and division stay IEEE.
//
// [Note: dividing by a constant]
// Per element the kernel needs a sqrt and two divisions, and the divider is the busiest unit:
// with three of them one core computes barely faster than DRAM delivers. The division by the
// step's constant sqrt(bias_correction2) = b is done without the divider, still correctly
// rounded: with y = RN(1/b), q = RN(a * y) is within an ulp of a / b, the residual
// r = a - q * b is exact in one fma, and RN(q + r * y) is then the correctly rounded quotient
// (Markstein's theorem; it needs a, r and the result to stay normal, true here since
// a = sqrt(v) >= 2^-75 or 0, and b is in (0, 1]). An infinite a makes r NaN; q (= inf) is kept,
// as a true division would give. The result is bit-equal to a / b, not merely close.
//
// Which widths exist depends on the flags this file is compiled with (__AVX512F__ etc.);
// `isa` in the op picks among the compiled ones, so tests can check all of them in one build.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>

#include "adam_constants.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace lightning_zero {
namespace {

// Kept in sync with _ISA_CODES in lightning_zero/ops/cpu_adam.py.
constexpr int64_t kIsaScalar = 0;
constexpr int64_t kIsaAvx2 = 1;
constexpr int64_t kIsaAvx512 = 2;

// Threads get whole blocks of this many elements, so that no two threads write into the same
// 64-byte cache line (64 fp32 = 4 lines, 64 bf16 = 2 lines, when the buffers are line aligned).
constexpr int64_t kBlock = 64;
// A thread is worth waking for at least this many elements (64K elements = 1.8 MB of traffic);
// smaller tensors run on the calling thread.
constexpr int64_t kGrainElements = 65536;

// ------------------------------------------------------------------------------- scalar lane
struct ScalarOps {
  using V = float;
  static constexpr int64_t kWidth = 1;
  static V set1(float x) { return x; }
  static V load(const float* p) { return *p; }
  static void store(float* p, V v) { *p = v; }
  static V load_grad(const float* p) { return *p; }
  static V load_grad(const c10::BFloat16* p) { return static_cast<float>(*p); }  // exact
  static V load_grad(const c10::Half* p) { return static_cast<float>(*p); }      // exact
  // c10's constructors round to nearest even, as tensor.to(bf16 / fp16) does.
  static void store_low(c10::BFloat16* p, V v) { *p = c10::BFloat16(v); }
  static void store_low(c10::Half* p, V v) { *p = c10::Half(v); }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V mul(V a, V b) { return a * b; }
  static V div(V a, V b) { return a / b; }
  static V sqrt(V a) { return std::sqrt(a); }
  static V fmadd(V a, V b, V c) { return std::fma(a, b, c); }
  static V div_by_constant(V a, V b, V inv_b) {
    const V q = a * inv_b;
    const V r = std::fma(-q, b, a);
    return std::isnan(r) ? q : std::fma(r, inv_b, q);
  }
};

// -------------------------------------------------------------------------------- AVX2 lanes
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LZ_HAVE_AVX2 1
struct Avx2Ops {
  using V = __m256;
  static constexpr int64_t kWidth = 8;
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V load_grad(const float* p) { return _mm256_loadu_ps(p); }
  static V load_grad(const c10::BFloat16* p) {
    // bf16 is the top half of an fp32: widen to 32 bits and shift into place (exact).
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static V load_grad(const c10::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store_low(c10::BFloat16* p, V v) {
    // Round to nearest even on the bits, as c10::BFloat16 does; NaN becomes 0x7FC0 like c10.
    // Not VCVTNEPS2BF16: it flushes denormals, tensor.to(torch.bfloat16) does not.
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF));
    __m256i bits = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    const __m256 is_nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    bits = _mm256_castps_si256(_mm256_blendv_ps(
        _mm256_castsi256_ps(bits), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC0)), is_nan));
    // packus works per 128-bit lane: [a0..3 a0..3 | a4..7 a4..7]; gather the two low quads.
    const __m256i packed = _mm256_packus_epi32(bits, bits);
    const __m256i ordered = _mm256_permute4x64_epi64(packed, 0b11011000);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(ordered));
  }
  static void store_low(c10::Half* p, V v) {
    _mm_storeu_si128(
        reinterpret_cast<__m128i*>(p),
        _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V sqrt(V a) { return _mm256_sqrt_ps(a); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V div_by_constant(V a, V b, V inv_b) {
    const V q = _mm256_mul_ps(a, inv_b);
    const V r = _mm256_fnmadd_ps(q, b, a);
    const V corrected = _mm256_fmadd_ps(r, inv_b, q);
    return _mm256_blendv_ps(corrected, q, _mm256_cmp_ps(r, r, _CMP_UNORD_Q));
  }
};
#endif

// ----------------------------------------------------------------------------- AVX-512 lanes
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define LZ_HAVE_AVX512 1
struct Avx512Ops {
  using V = __m512;
  static constexpr int64_t kWidth = 16;
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V load_grad(const float* p) { return _mm512_loadu_ps(p); }
  static V load_grad(const c10::BFloat16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static V load_grad(const c10::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store_low(c10::BFloat16* p, V v) {
    // Same rounding as Avx2Ops::store_low (see there for why not VCVTNEPS2BF16).
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
    __m512i bits = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    const __mmask16 is_nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    bits = _mm512_mask_mov_epi32(bits, is_nan, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bits));
  }
  static void store_low(c10::Half* p, V v) {
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(p),
        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V sqrt(V a) { return _mm512_sqrt_ps(a); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V div_by_constant(V a, V b, V inv_b) {
    const V q = _mm512_mul_ps(a, inv_b);
    const V r = _mm512_fnmadd_ps(q, b, a);
    const V corrected = _mm512_fmadd_ps(r, inv_b, q);
    return _mm512_mask_mov_ps(corrected, _mm512_cmp_ps_mask(r, r, _CMP_UNORD_Q), q);
  }
};
#endif

// ------------------------------------------------------------------------------- the math
// Pointers into one step's buffers; the lanes at index i are updated by adam_lanes.
template <typename GradT, typename OutT>
struct AdamBuffers {
  float* master;
  const GradT* grad;
  float* exp_avg;
  float* exp_avg_sq;
  OutT* out;  // unused when OutT is NoOut
};

// Ops::kWidth elements starting at i, in torch.optim.AdamW's op order (see _reference.py).
template <typename Ops, typename GradT, typename OutT>
inline void adam_lanes(const AdamBuffers<GradT, OutT>& b, const AdamConstants& c, int64_t i) {
  using V = typename Ops::V;
  V g = Ops::mul(Ops::load_grad(b.grad + i), Ops::set1(c.grad_scale));
  V p = Ops::load(b.master + i);
  if (c.l2) {
    g = Ops::fmadd(p, Ops::set1(c.weight_decay), g);  // grad.add(param, alpha=wd)
  }
  p = Ops::mul(p, Ops::set1(c.decoupled_decay));  // param.mul_(1 - lr * wd)

  V m = Ops::load(b.exp_avg + i);  // exp_avg.lerp_(grad, 1 - beta1)
  m = Ops::fmadd(Ops::set1(c.lerp_coeff), Ops::sub(g, m), c.lerp_from_grad ? g : m);

  V v = Ops::mul(Ops::load(b.exp_avg_sq + i), Ops::set1(c.beta2));  // .mul_(beta2)
  v = Ops::fmadd(Ops::mul(Ops::set1(c.one_minus_beta2), g), g, v);  // .addcmul_(g, g, 1 - beta2)

  // denom = sqrt(v) / sqrt(bc2) + eps;  param.addcdiv_(m, denom, value=-step_size)
  const V scaled_sqrt = Ops::div_by_constant(
      Ops::sqrt(v), Ops::set1(c.bias_correction2_sqrt), Ops::set1(c.inv_bias_correction2_sqrt));
  const V denom = Ops::add(scaled_sqrt, Ops::set1(c.eps));
  p = Ops::add(p, Ops::div(Ops::mul(Ops::set1(c.neg_step_size), m), denom));

  Ops::store(b.exp_avg + i, m);
  Ops::store(b.exp_avg_sq + i, v);
  Ops::store(b.master + i, p);
  if constexpr (!std::is_same_v<OutT, NoOut>) {
    Ops::store_low(b.out + i, p);
  }
}

// Elements [begin, end) of one thread's chunk: full vectors, then the scalar tail.
template <typename Ops, typename GradT, typename OutT>
void adam_range(
    const AdamBuffers<GradT, OutT>& b, const AdamConstants& c, int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + Ops::kWidth <= end; i += Ops::kWidth) {
    adam_lanes<Ops>(b, c, i);
  }
  for (; i < end; ++i) {
    adam_lanes<ScalarOps>(b, c, i);
  }
}

template <typename GradT, typename OutT>
void adam_parallel(
    const AdamBuffers<GradT, OutT>& b, const AdamConstants& c, int64_t numel, int64_t isa) {
  const int64_t num_blocks = (numel + kBlock - 1) / kBlock;
  at::parallel_for(0, num_blocks, kGrainElements / kBlock, [&](int64_t first, int64_t last) {
    const int64_t begin = first * kBlock;
    const int64_t end = std::min(last * kBlock, numel);
#ifdef LZ_HAVE_AVX512
    if (isa >= kIsaAvx512) {
      adam_range<Avx512Ops>(b, c, begin, end);
      return;
    }
#endif
#ifdef LZ_HAVE_AVX2
    if (isa >= kIsaAvx2) {
      adam_range<Avx2Ops>(b, c, begin, end);
      return;
    }
#endif
    adam_range<ScalarOps>(b, c, begin, end);
  });
}

template <typename GradT>
void dispatch_out(
    const at::Tensor& master, const GradT* grad, const at::Tensor& exp_avg,
    const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& out, const AdamConstants& c,
    int64_t isa) {
  float* m = master.data_ptr<float>();
  float* ea = exp_avg.data_ptr<float>();
  float* eas = exp_avg_sq.data_ptr<float>();
  const int64_t n = master.numel();
  if (!out.has_value()) {
    adam_parallel(AdamBuffers<GradT, NoOut>{m, grad, ea, eas, nullptr}, c, n, isa);
  } else if (out->scalar_type() == at::kBFloat16) {
    auto* o = out->data_ptr<c10::BFloat16>();
    adam_parallel(AdamBuffers<GradT, c10::BFloat16>{m, grad, ea, eas, o}, c, n, isa);
  } else {
    auto* o = out->data_ptr<c10::Half>();
    adam_parallel(AdamBuffers<GradT, c10::Half>{m, grad, ea, eas, o}, c, n, isa);
  }
}

// The Python wrapper validates with ValueErrors that name the fix; these checks only keep a
// direct torch.ops call from reading out of bounds.
void check_inputs(
    const at::Tensor& master, const at::Tensor& grad, const at::Tensor& exp_avg,
    const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& out) {
  const int64_t n = master.numel();
  TORCH_CHECK(master.scalar_type() == at::kFloat, "cpu_adam_step: master must be float32");
  TORCH_CHECK(exp_avg.scalar_type() == at::kFloat, "cpu_adam_step: exp_avg must be float32");
  TORCH_CHECK(exp_avg_sq.scalar_type() == at::kFloat, "cpu_adam_step: exp_avg_sq must be float32");
  for (const at::Tensor* t : {&master, &grad, &exp_avg, &exp_avg_sq}) {
    TORCH_CHECK(t->device().is_cpu(), "cpu_adam_step: all tensors must be on the CPU");
    TORCH_CHECK(t->is_contiguous(), "cpu_adam_step: all tensors must be contiguous");
    TORCH_CHECK(t->numel() == n, "cpu_adam_step: all tensors must have master's numel");
  }
  if (out.has_value()) {
    TORCH_CHECK(
        out->scalar_type() == at::kBFloat16 || out->scalar_type() == at::kHalf,
        "cpu_adam_step: low_precision_out must be bfloat16 or float16");
    TORCH_CHECK(out->device().is_cpu() && out->is_contiguous() && out->numel() == n,
                "cpu_adam_step: low_precision_out must be a contiguous CPU tensor of master's numel");
  }
}

void cpu_adam_step(
    at::Tensor master, const at::Tensor& grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
    const std::optional<at::Tensor>& low_precision_out, int64_t step, double lr, double beta1,
    double beta2, double eps, double weight_decay, bool adamw_mode, double grad_scale,
    int64_t isa) {
  check_inputs(master, grad, exp_avg, exp_avg_sq, low_precision_out);
  TORCH_CHECK(step >= 1, "cpu_adam_step: step counts from 1");
  const AdamConstants c =
      make_constants(step, lr, beta1, beta2, eps, weight_decay, adamw_mode, grad_scale);
  switch (grad.scalar_type()) {
    case at::kFloat:
      dispatch_out(master, grad.data_ptr<float>(), exp_avg, exp_avg_sq, low_precision_out, c, isa);
      break;
    case at::kBFloat16:
      dispatch_out(master, grad.data_ptr<c10::BFloat16>(), exp_avg, exp_avg_sq,
                   low_precision_out, c, isa);
      break;
    case at::kHalf:
      dispatch_out(master, grad.data_ptr<c10::Half>(), exp_avg, exp_avg_sq, low_precision_out,
                   c, isa);
      break;
    default:
      TORCH_CHECK(false, "cpu_adam_step: grad must be float32, bfloat16 or float16, got ",
                  grad.scalar_type());
  }
}

// The widest lane type compiled into this build.
int64_t cpu_adam_isa() {
#if defined(LZ_HAVE_AVX512)
  return kIsaAvx512;
#elif defined(LZ_HAVE_AVX2)
  return kIsaAvx2;
#else
  return kIsaScalar;
#endif
}

// A STREAM-like probe with exactly the step's memory traffic (the same five streams, read and
// written once each) and next to no arithmetic: the benchmark's bandwidth bound for one pass.
template <typename Ops>
void stream_probe_range(
    float* master, const c10::BFloat16* grad, float* exp_avg, float* exp_avg_sq,
    c10::BFloat16* out, int64_t begin, int64_t end) {
  int64_t i = begin;
  auto lanes = [&](auto ops, int64_t j) {
    using O = decltype(ops);
    typename O::V g = O::load_grad(grad + j);
    typename O::V p = O::add(O::load(master + j), g);
    O::store(master + j, p);
    O::store(exp_avg + j, O::add(O::load(exp_avg + j), g));
    O::store(exp_avg_sq + j, O::add(O::load(exp_avg_sq + j), g));
    O::store_low(out + j, p);
  };
  for (; i + Ops::kWidth <= end; i += Ops::kWidth) lanes(Ops{}, i);
  for (; i < end; ++i) lanes(ScalarOps{}, i);
}

void cpu_adam_stream_probe(
    at::Tensor master, const at::Tensor& grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
    at::Tensor out) {
  check_inputs(master, grad, exp_avg, exp_avg_sq, out);
  TORCH_CHECK(grad.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "cpu_adam_stream_probe: grad and out must be bfloat16");
  float* m = master.data_ptr<float>();
  const auto* g = grad.data_ptr<c10::BFloat16>();
  float* ea = exp_avg.data_ptr<float>();
  float* eas = exp_avg_sq.data_ptr<float>();
  auto* o = out.data_ptr<c10::BFloat16>();
  const int64_t n = master.numel();
  const int64_t num_blocks = (n + kBlock - 1) / kBlock;
  at::parallel_for(0, num_blocks, kGrainElements / kBlock, [&](int64_t first, int64_t last) {
    const int64_t begin = first * kBlock;
    const int64_t end = std::min(last * kBlock, n);
#if defined(LZ_HAVE_AVX512)
    stream_probe_range<Avx512Ops>(m, g, ea, eas, o, begin, end);
#elif defined(LZ_HAVE_AVX2)
    stream_probe_range<Avx2Ops>(m, g, ea, eas, o, begin, end);
#else
    stream_probe_range<ScalarOps>(m, g, ea, eas, o, begin, end);
#endif
  });
}

}  // namespace
}  // namespace lightning_zero

// A fragment, not TORCH_LIBRARY: other csrc/ files may add ops to the same namespace.
TORCH_LIBRARY_FRAGMENT(lightning_zero, m) {
  m.def(
      "cpu_adam_step(Tensor(a!) master, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!)? low_precision_out, int step, float lr, float beta1, float beta2, float eps, "
      "float weight_decay, bool adamw_mode, float grad_scale, int isa) -> ()");
  m.def("cpu_adam_isa() -> int", &lightning_zero::cpu_adam_isa);
  m.def(
      "cpu_adam_stream_probe(Tensor(a!) master, Tensor grad, Tensor(b!) exp_avg, "
      "Tensor(c!) exp_avg_sq, Tensor(d!) out) -> ()");
}

TORCH_LIBRARY_IMPL(lightning_zero, CPU, m) {
  m.impl("cpu_adam_step", &lightning_zero::cpu_adam_step);
  m.impl("cpu_adam_stream_probe", &lightning_zero::cpu_adam_stream_probe);
}
