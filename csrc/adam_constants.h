// The per-step constants of one Adam(W) step, shared by csrc/cpu_adam.cpp and csrc/fused_adam.cuh
// (the CUDA kernel and its host build), so every kernel computes the same fp32 values.

#pragma once

#include <cmath>
#include <cstdint>

namespace lightning_zero {

// Marks "no low-precision copy requested" at compile time, so the loop has no branch for it.
struct NoOut {};

// Per-step constants, computed once in double exactly as torch.optim.AdamW computes its
// Python floats, then rounded to float as torch does when it hands a Python scalar to an
// fp32 kernel.
struct AdamConstants {
  float grad_scale;
  float lerp_coeff;        // weight of (g - m) in the fma of the lerp
  bool lerp_from_grad;     // lerp base is g (weight >= 0.5) instead of m (weight < 0.5)
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;
  float inv_bias_correction2_sqrt;  // RN(1 / bias_correction2_sqrt), see [Note: dividing by a constant] in cpu_adam.cpp
  float eps;
  float neg_step_size;     // -lr / bias_correction1
  float decoupled_decay;   // AdamW: 1 - lr * wd (exactly 1 when wd == 0: p * 1 == p)
  bool l2;                 // Adam with weight decay: g += wd * p
  float weight_decay;
};

inline AdamConstants make_constants(
    int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay,
    bool adamw_mode, double grad_scale) {
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  // torch's lerp: below a weight of 0.5 it is m + w * (g - m), above it g - (1 - w) * (g - m).
  const float weight = static_cast<float>(1.0 - beta1);
  const bool from_grad = !(std::abs(weight) < 0.5f);
  AdamConstants c{};
  c.grad_scale = static_cast<float>(grad_scale);
  c.lerp_coeff = from_grad ? weight - 1.0f : weight;
  c.lerp_from_grad = from_grad;
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  // A float division, so the reciprocal is correctly rounded in float (not double-rounded).
  c.inv_bias_correction2_sqrt = 1.0f / c.bias_correction2_sqrt;
  c.eps = static_cast<float>(eps);
  c.neg_step_size = static_cast<float>(-(lr / bias_correction1));
  c.decoupled_decay = static_cast<float>(adamw_mode ? 1.0 - lr * weight_decay : 1.0);
  c.l2 = !adamw_mode && weight_decay != 0.0;
  c.weight_decay = static_cast<float>(weight_decay);
  return c;
}

}  // namespace lightning_zero
