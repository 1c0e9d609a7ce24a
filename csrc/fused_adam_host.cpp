// The CUDA kernel's code run on the CPU, for tests: lightning_zero::_fused_adam_host.
//
// [Note: the kernel on the host]
// fused_adam.cu's kernel is a thin __global__ wrapper around adam_block (fused_adam.cuh), and
// the tables it is launched with come from mta::for_each_table (multi_tensor_apply.cuh); both
// are plain C++. This file runs exactly that code on CPU tensors: the same planner packs the
// same tables, and each "launch" calls adam_block for every block and every thread index, one
// after another. A CUDA block's threads never talk to each other in this kernel (no shared
// memory, no barriers), so running them in sequence computes what the device computes. The
// default test suite, which has no GPU, thereby checks the chunking (tensors split across
// tables, chunk tails, the vector and the scalar paths) and the math bit for bit against
// lightning_zero/ops/_reference.py. What it cannot check is the device's own arithmetic,
// which benchmarks/gpu_check.sh compares with the reference when a GPU is at hand.
//
// Built with -ffp-contract=off, as cpu_adam.cpp (see [Note: the same bits on the host and on
// the device] in fused_adam.cuh). It is not fast and is never used for training.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "fused_adam.cuh"
#include "multi_tensor_apply.cuh"

namespace lightning_zero {
namespace fused_adam {
namespace {

struct HostLauncher {
  int threads;  // threads per emulated block: the kernel's kThreads, or fewer to test the loop
  int64_t* launches;  // counts the tables launched (tests check the planner splits)

  template <typename GradT, typename OutT>
  void run(const mta::TensorTable& table, int blocks, const AdamConstants& constants, const float* grad_scale,
           const float* found_inf) const {
    ++*launches;
    for (int block = 0; block < blocks; ++block) {
      for (int thread = 0; thread < threads; ++thread) {
        adam_block<GradT, OutT>(table, constants, grad_scale, found_inf, block, thread, threads);
      }
    }
  }
};

// `threads`: per emulated block (fewer than the kernel's kThreads tests its strided loop);
// `max_part_numel`: tensors are split into parts of this many elements (0: the kernel's own
// limit, see [Note: multi-tensor launches]), so tests can check the split on small tensors.
// Returns the number of tables launched.
int64_t fused_adam_host(
    const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& masters,
    const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
    const std::vector<at::Tensor>& outs, const std::optional<at::Tensor>& grad_scale,
    const std::optional<at::Tensor>& found_inf, int64_t step, double lr, double beta1, double beta2, double eps,
    double weight_decay, bool adamw_mode, double scale, int64_t threads, int64_t max_part_numel) {
  TORCH_CHECK(threads >= 1 && threads <= mta::kThreads, "threads must be in [1, ", mta::kThreads, "], got ", threads);
  int64_t launches = 0;
  const HostLauncher launcher{static_cast<int>(threads), &launches};
  run(grads, masters, exp_avgs, exp_avg_sqs, outs, grad_scale, found_inf, step, lr, beta1, beta2, eps, weight_decay,
      adamw_mode, scale, c10::DeviceType::CPU, launcher, max_part_numel);
  return launches;
}

}  // namespace
}  // namespace fused_adam
}  // namespace lightning_zero

TORCH_LIBRARY_FRAGMENT(lightning_zero, m) {
  m.def(
      "_fused_adam_host(Tensor[] grads, Tensor(a!)[] masters, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] low_precision_outs, Tensor? grad_scale, Tensor? found_inf, int step, float lr, float beta1, "
      "float beta2, float eps, float weight_decay, bool adamw_mode, float scale, int threads, "
      "int max_part_numel) -> int");
}

TORCH_LIBRARY_IMPL(lightning_zero, CPU, m) {
  m.impl("_fused_adam_host", &lightning_zero::fused_adam::fused_adam_host);
}
