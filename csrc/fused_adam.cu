// Fused multi-tensor Adam(W) on CUDA: one launch per table of tensors (see [Note: multi-tensor
// launches] in multi_tensor_apply.cuh), the math of fused_adam.cuh.
//
// Built on first use by lightning_zero/ops/fused_adam.py (torch.utils.cpp_extension.load, with
// --fmad=false: see [Note: the same bits on the host and on the device]). It registers
// lightning_zero::_fused_adam_cuda, which the Python op lightning_zero::fused_adam_ (schema,
// fake implementation and checks in fused_adam.py) calls for CUDA tensors.
//
// Only ATen/core and the CUDA runtime are included, not c10/cuda: the CPU torch wheel ships
// c10/cuda's headers without the generated cuda_cmake_macros.h, and the CI check compiles this
// file there with `nvcc -c` (tests/test_cuda_source.py). So the caller passes the stream
// (torch.cuda.current_stream().cuda_stream) and has made the tensors' device current.

#include <ATen/core/Tensor.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "fused_adam.cuh"
#include "multi_tensor_apply.cuh"

namespace lightning_zero {
namespace fused_adam {
namespace {

template <typename GradT, typename OutT>
__global__ void __launch_bounds__(mta::kThreads) adam_kernel(
    const mta::TensorTable table, const AdamConstants constants, const float* grad_scale, const float* found_inf) {
  adam_block<GradT, OutT>(table, constants, grad_scale, found_inf, blockIdx.x, threadIdx.x, blockDim.x);
}

struct CudaLauncher {
  cudaStream_t stream;

  template <typename GradT, typename OutT>
  void run(const mta::TensorTable& table, int blocks, const AdamConstants& constants, const float* grad_scale,
           const float* found_inf) const {
    adam_kernel<GradT, OutT><<<blocks, mta::kThreads, 0, stream>>>(table, constants, grad_scale, found_inf);
    const cudaError_t error = cudaGetLastError();
    TORCH_CHECK(error == cudaSuccess, "fused_adam: kernel launch failed: ", cudaGetErrorString(error));
  }
};

void fused_adam_cuda(
    const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& masters,
    const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
    const std::vector<at::Tensor>& outs, const std::optional<at::Tensor>& grad_scale,
    const std::optional<at::Tensor>& found_inf, int64_t step, double lr, double beta1, double beta2, double eps,
    double weight_decay, bool adamw_mode, double scale, int64_t stream) {
  if (masters.empty()) {
    return;
  }
  int current = -1;
  TORCH_CHECK(cudaGetDevice(&current) == cudaSuccess && current == masters[0].device().index(),
              "fused_adam: the current CUDA device is ", current, ", the tensors are on ", masters[0].device(),
              "; call it under torch.cuda.device(", masters[0].device(), ")");
  const CudaLauncher launcher{reinterpret_cast<cudaStream_t>(stream)};
  run(grads, masters, exp_avgs, exp_avg_sqs, outs, grad_scale, found_inf, step, lr, beta1, beta2, eps, weight_decay,
      adamw_mode, scale, c10::DeviceType::CUDA, launcher);
}

}  // namespace
}  // namespace fused_adam
}  // namespace lightning_zero

// A fragment: csrc/cpu_adam.cpp and the Python ops add to the same namespace.
TORCH_LIBRARY_FRAGMENT(lightning_zero, m) {
  m.def(
      "_fused_adam_cuda(Tensor[] grads, Tensor(a!)[] masters, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] low_precision_outs, Tensor? grad_scale, Tensor? found_inf, int step, float lr, float beta1, "
      "float beta2, float eps, float weight_decay, bool adamw_mode, float scale, int stream) -> ()");
}

TORCH_LIBRARY_IMPL(lightning_zero, CUDA, m) {
  m.impl("_fused_adam_cuda", &lightning_zero::fused_adam::fused_adam_cuda);
}
