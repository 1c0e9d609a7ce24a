// Fused multi-tensor Adam(W): the math of one element, the block body, and the host-side driver.
//
// Included by csrc/fused_adam.cu (the CUDA kernel) and by csrc/fused_adam_host.cpp (the same
// block body run on the CPU, for tests). The math it must equal is
// lightning_zero/ops/_reference.py, in the op order of csrc/cpu_adam.cpp's scalar lane
// (torch.optim.AdamW's single-tensor path). Per element, in one pass over memory:
//
//   if *found_inf != 0: nothing (skip the step without a host sync)
//   read   grad (fp32 | bf16 | fp16)         g = grad * scale   (scale: *grad_scale or a constant)
//   read   master, exp_avg, exp_avg_sq       (Adam)  g = fma(p, wd, g)
//                                            (AdamW) p = p * (1 - lr * wd)
//                                            m = lerp(m, g, 1 - beta1)
//                                            v = fma((1 - beta2) * g, g, v * beta2)
//                                            p = p + (-step_size * m) / (sqrt(v) / sqrt(bc2) + eps)
//   write  master, exp_avg, exp_avg_sq
//   write  out (bf16 | fp16) = round-to-nearest-even(p)                   (optional)
//
// [Note: the same bits on the host and on the device]
// Every fma is written out (fmaf) and the CUDA build passes --fmad=false, so nvcc fuses
// nothing on its own, as the host build (-ffp-contract=off) does not; sqrtf and '/' are IEEE
// on the device unless --use_fast_math, which the build never passes. The division by the
// constant sqrt(bias_correction2) is cpu_adam.cpp's correctly rounded one (see [Note: dividing
// by a constant] there). So the kernel run on the host equals the reference bit for bit, and
// on the device it should too; benchmarks/gpu_check.py measures how far it is from it there.

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "adam_constants.h"
#include "multi_tensor_apply.cuh"

namespace lightning_zero {
namespace fused_adam {

using lightning_zero::AdamConstants;
using lightning_zero::make_constants;
using lightning_zero::NoOut;

LZ_HOST_DEVICE LZ_INLINE float div_by_constant(float a, float b, float inv_b) {
  const float q = a * inv_b;
  const float r = fmaf(-q, b, a);
  return r != r ? q : fmaf(r, inv_b, q);  // r is NaN when a is infinite: keep q (= inf)
}

// One element, in torch.optim.AdamW's op order; updates p, m and v.
LZ_HOST_DEVICE LZ_INLINE void adam_element(
    const AdamConstants& c, float scale, float grad, float& p, float& m, float& v) {
  float g = grad * scale;
  if (c.l2) {
    g = fmaf(p, c.weight_decay, g);  // grad.add(param, alpha=wd)
  }
  p = p * c.decoupled_decay;  // param.mul_(1 - lr * wd)
  m = fmaf(c.lerp_coeff, g - m, c.lerp_from_grad ? g : m);  // exp_avg.lerp_(grad, 1 - beta1)
  v = fmaf(c.one_minus_beta2 * g, g, v * c.beta2);  // exp_avg_sq.mul_(beta2).addcmul_(g, g, 1 - beta2)
  const float denom = div_by_constant(sqrtf(v), c.bias_correction2_sqrt, c.inv_bias_correction2_sqrt) + c.eps;
  p = p + (c.neg_step_size * m) / denom;  // param.addcdiv_(m, denom, value=-step_size)
}

template <typename T>
LZ_HOST_DEVICE LZ_INLINE float to_float(T x) {
  return static_cast<float>(x);  // bf16 / fp16 -> fp32 is exact
}

// kIlp values of T, loaded and stored as one vector when the address allows it.
template <typename T>
struct alignas(sizeof(T) * mta::kIlp) Pack {
  T v[mta::kIlp];
};

template <typename T>
LZ_HOST_DEVICE LZ_INLINE bool is_aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % sizeof(Pack<T>) == 0;
}

// The work of thread `thread` (of `threads`) in block `block` of one launch: a chunk of one
// tensor, kIlp consecutive elements per iteration. The same code runs as the CUDA kernel's body
// and, for tests, on the host (csrc/fused_adam_host.cpp).
template <typename GradT, typename OutT>
LZ_HOST_DEVICE LZ_INLINE void adam_block(
    const mta::TensorTable& table, const AdamConstants& c, const float* grad_scale, const float* found_inf,
    int block, int thread, int threads) {
  if (found_inf != nullptr && *found_inf != 0.0f) {
    return;
  }
  const float scale = grad_scale != nullptr ? *grad_scale : c.grad_scale;
  const int t = table.block_tensor[block];
  const int64_t start = static_cast<int64_t>(table.block_chunk[block]) * mta::kChunk;
  const int64_t numel = table.numel[t];
  const int64_t end = start + mta::kChunk < numel ? start + mta::kChunk : numel;
  const GradT* grad = static_cast<const GradT*>(table.addresses[mta::kGrad][t]);
  float* master = static_cast<float*>(table.addresses[mta::kMaster][t]);
  float* exp_avg = static_cast<float*>(table.addresses[mta::kExpAvg][t]);
  float* exp_avg_sq = static_cast<float*>(table.addresses[mta::kExpAvgSq][t]);
  OutT* out = nullptr;
  if constexpr (!std::is_same_v<OutT, NoOut>) {
    out = static_cast<OutT*>(table.addresses[mta::kOut][t]);
  }
  // Vector loads when every slot's chunk starts aligned and the chunk is whole vectors; the
  // math is the same per element either way, so the values do not depend on the path.
  bool vector = (end - start) % mta::kIlp == 0 && is_aligned<GradT>(grad + start) &&
      is_aligned<float>(master + start) && is_aligned<float>(exp_avg + start) &&
      is_aligned<float>(exp_avg_sq + start);
  if constexpr (!std::is_same_v<OutT, NoOut>) {
    vector = vector && is_aligned<OutT>(out + start);
  }
  for (int64_t base = start + static_cast<int64_t>(thread) * mta::kIlp; base < end;
       base += static_cast<int64_t>(threads) * mta::kIlp) {
    float g[mta::kIlp], p[mta::kIlp], m[mta::kIlp], v[mta::kIlp];
    const int count = end - base < mta::kIlp ? static_cast<int>(end - base) : mta::kIlp;
    if (vector) {
      const Pack<GradT> grads = *reinterpret_cast<const Pack<GradT>*>(grad + base);
      const Pack<float> ps = *reinterpret_cast<const Pack<float>*>(master + base);
      const Pack<float> ms = *reinterpret_cast<const Pack<float>*>(exp_avg + base);
      const Pack<float> vs = *reinterpret_cast<const Pack<float>*>(exp_avg_sq + base);
#pragma unroll
      for (int i = 0; i < mta::kIlp; ++i) {
        g[i] = to_float(grads.v[i]);
        p[i] = ps.v[i];
        m[i] = ms.v[i];
        v[i] = vs.v[i];
      }
    } else {
#pragma unroll
      for (int i = 0; i < mta::kIlp; ++i) {
        g[i] = i < count ? to_float(grad[base + i]) : 0.0f;
        p[i] = i < count ? master[base + i] : 0.0f;
        m[i] = i < count ? exp_avg[base + i] : 0.0f;
        v[i] = i < count ? exp_avg_sq[base + i] : 0.0f;
      }
    }
#pragma unroll
    for (int i = 0; i < mta::kIlp; ++i) {
      adam_element(c, scale, g[i], p[i], m[i], v[i]);
    }
    if (vector) {
      Pack<float> ps, ms, vs;
#pragma unroll
      for (int i = 0; i < mta::kIlp; ++i) {
        ps.v[i] = p[i];
        ms.v[i] = m[i];
        vs.v[i] = v[i];
      }
      *reinterpret_cast<Pack<float>*>(master + base) = ps;
      *reinterpret_cast<Pack<float>*>(exp_avg + base) = ms;
      *reinterpret_cast<Pack<float>*>(exp_avg_sq + base) = vs;
      if constexpr (!std::is_same_v<OutT, NoOut>) {
        Pack<OutT> os;
#pragma unroll
        for (int i = 0; i < mta::kIlp; ++i) {
          os.v[i] = OutT(p[i]);  // c10's constructors round to nearest even
        }
        *reinterpret_cast<Pack<OutT>*>(out + base) = os;
      }
    } else {
      for (int i = 0; i < count; ++i) {
        master[base + i] = p[i];
        exp_avg[base + i] = m[i];
        exp_avg_sq[base + i] = v[i];
        if constexpr (!std::is_same_v<OutT, NoOut>) {
          out[base + i] = OutT(p[i]);
        }
      }
    }
  }
}


// ------------------------------------------------------------------------------ host driver
// Checks the lists, computes the constants, picks the (grad dtype, out dtype) instantiation and
// hands every table to `launcher.template run<GradT, OutT>(table, blocks, constants, grad_scale,
// found_inf)`. The Python wrapper (lightning_zero/ops/fused_adam.py) checks the same and says
// more; these checks only keep a bad call from reading or writing out of bounds.
inline void check_scalar(const std::optional<at::Tensor>& t, const char* name, c10::DeviceType device) {
  if (!t.has_value()) {
    return;
  }
  TORCH_CHECK(t->numel() == 1, name, " must have one element, got ", t->numel());
  TORCH_CHECK(t->scalar_type() == at::kFloat, name, " must be float32, got ", t->scalar_type());
  TORCH_CHECK(t->device().type() == device, name, " must be on ", device, ", got ", t->device());
}

inline void check_lists(
    const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& masters,
    const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
    const std::vector<at::Tensor>& outs, c10::DeviceType device) {
  const size_t n = masters.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
              "fused_adam: grads, masters, exp_avgs and exp_avg_sqs must have the same length, got ",
              grads.size(), ", ", n, ", ", exp_avgs.size(), ", ", exp_avg_sqs.size());
  TORCH_CHECK(outs.empty() || outs.size() == n,
              "fused_adam: low_precision_outs must be empty or as long as masters, got ", outs.size(), " for ", n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t numel = masters[i].numel();
    auto check = [&](const at::Tensor& t, const char* name, bool fp32) {
      TORCH_CHECK(t.device().type() == device && t.device() == masters[0].device(), "fused_adam: ", name, "[", i,
                  "] is on ", t.device(), ", expected ", device, " (the device of masters[0], ", masters[0].device(),
                  ")");
      TORCH_CHECK(t.is_contiguous(), "fused_adam: ", name, "[", i, "] is not contiguous");
      TORCH_CHECK(t.numel() == numel, "fused_adam: ", name, "[", i, "] has ", t.numel(),
                  " elements, masters[", i, "] has ", numel);
      TORCH_CHECK(!fp32 || t.scalar_type() == at::kFloat, "fused_adam: ", name, "[", i, "] must be float32, got ",
                  t.scalar_type());
    };
    check(masters[i], "masters", true);
    check(exp_avgs[i], "exp_avgs", true);
    check(exp_avg_sqs[i], "exp_avg_sqs", true);
    check(grads[i], "grads", false);
    TORCH_CHECK(grads[i].scalar_type() == grads[0].scalar_type(),
                "fused_adam: every gradient of one call must have one dtype; grads[0] is ", grads[0].scalar_type(),
                ", grads[", i, "] is ", grads[i].scalar_type());
    if (!outs.empty()) {
      check(outs[i], "low_precision_outs", false);
      TORCH_CHECK(outs[i].scalar_type() == outs[0].scalar_type(),
                  "fused_adam: every low-precision out of one call must have one dtype");
    }
  }
}

template <typename Launcher>
void run(
    const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& masters,
    const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
    const std::vector<at::Tensor>& outs, const std::optional<at::Tensor>& grad_scale,
    const std::optional<at::Tensor>& found_inf, int64_t step, double lr, double beta1, double beta2, double eps,
    double weight_decay, bool adamw_mode, double scale, c10::DeviceType device, const Launcher& launcher,
    int64_t max_part_numel = 0) {
  check_lists(grads, masters, exp_avgs, exp_avg_sqs, outs, device);
  check_scalar(grad_scale, "grad_scale", device);
  check_scalar(found_inf, "found_inf", device);
  TORCH_CHECK(step >= 1, "fused_adam: step must be >= 1 (the step number after the increment), got ", step);
  if (masters.empty()) {
    return;
  }
  const AdamConstants c = make_constants(step, lr, beta1, beta2, eps, weight_decay, adamw_mode, scale);
  const float* scale_ptr = grad_scale.has_value() ? grad_scale->data_ptr<float>() : nullptr;
  const float* inf_ptr = found_inf.has_value() ? found_inf->data_ptr<float>() : nullptr;
  TORCH_CHECK(max_part_numel >= 0 && max_part_numel % mta::kChunk == 0,
              "fused_adam: max_part_numel must be a multiple of ", mta::kChunk, ", got ", max_part_numel);
  const int64_t part_limit = max_part_numel > 0 ? max_part_numel : mta::kMaxChunksPerTensor * mta::kChunk;
  const int64_t element_size[mta::kSlots] = {
      grads[0].element_size(), 4, 4, 4, outs.empty() ? 0 : outs[0].element_size()};
  std::vector<mta::TensorRef> refs;
  refs.reserve(masters.size());
  for (size_t i = 0; i < masters.size(); ++i) {
    mta::TensorRef ref{};
    ref.addresses[mta::kGrad] = grads[i].data_ptr();
    ref.addresses[mta::kMaster] = masters[i].data_ptr();
    ref.addresses[mta::kExpAvg] = exp_avgs[i].data_ptr();
    ref.addresses[mta::kExpAvgSq] = exp_avg_sqs[i].data_ptr();
    ref.addresses[mta::kOut] = outs.empty() ? nullptr : outs[i].data_ptr();
    ref.numel = masters[i].numel();
    mta::for_each_part(ref, element_size, part_limit, refs);
  }
  auto with_types = [&](auto grad_tag, auto out_tag) {
    using GradT = decltype(grad_tag);
    using OutT = decltype(out_tag);
    mta::for_each_table(refs.data(), static_cast<int64_t>(refs.size()),
                        [&](const mta::TensorTable& table, int blocks) {
                          launcher.template run<GradT, OutT>(table, blocks, c, scale_ptr, inf_ptr);
                        });
  };
  auto with_grad = [&](auto grad_tag) {
    if (outs.empty()) {
      with_types(grad_tag, NoOut{});
    } else if (outs[0].scalar_type() == at::kBFloat16) {
      with_types(grad_tag, c10::BFloat16{});
    } else if (outs[0].scalar_type() == at::kHalf) {
      with_types(grad_tag, c10::Half{});
    } else {
      TORCH_CHECK(false, "fused_adam: low_precision_outs must be bfloat16 or float16, got ", outs[0].scalar_type());
    }
  };
  switch (grads[0].scalar_type()) {
    case at::kFloat:
      with_grad(float{});
      break;
    case at::kBFloat16:
      with_grad(c10::BFloat16{});
      break;
    case at::kHalf:
      with_grad(c10::Half{});
      break;
    default:
      TORCH_CHECK(false, "fused_adam: grads must be float32, bfloat16 or float16, got ", grads[0].scalar_type());
  }
}

}  // namespace fused_adam
}  // namespace lightning_zero
