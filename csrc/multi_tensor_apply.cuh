// A multi-tensor launcher: one kernel launch steps many tensors, each cut into chunks.
//
// [Note: multi-tensor launches]
// A ZeRO shard is one tensor per parameter (one master piece each), often hundreds of small
// ones: a launch per tensor would spend more time launching than moving bytes. Instead the
// host packs a table of up to kMaxTensors tensors, each with kSlots named slots (grad, master,
// exp_avg, exp_avg_sq, low-precision out: Slot below), and the blocks of one launch each take
// one chunk of kChunk elements of one tensor (block_tensor / block_chunk). The table is passed
// by value as a kernel argument (constant memory, no copy to the device and no host sync), so
// it must stay under the 4 KiB argument limit every architecture accepts (static_assert below).
// When either part fills up, the table is launched and a new one is started (a tensor may
// continue in the next table).
//
// Blocks per launch matter more than tensors: the launches of one stream run one after another,
// and the last wave of each leaves SMs idle. ptxas gives the kernel 40 registers a thread for
// sm_90 (64 for sm_75), so 3 blocks of 512 threads fit an SM and an H100/H200 (132 SMs) runs
// 396 at once: 320 blocks a launch (ATen's choice) would leave a fifth of the SMs idle for the
// whole launch, 640 are 1.6 waves. So the chunk index is 16 bits (3 bytes a block with the
// tensor index), and the host splits a tensor of more than 65535 chunks (4.3e9 elements) into
// parts the table can index (for_each_part). Measured on a GPU, not here: see
// benchmarks/fused_adam.py.
//
// Everything but the __global__ wrapper is plain C++ marked LZ_HOST_DEVICE: the planner
// (for_each_table) is host code, and the block body a kernel runs can be called on the host
// too, block by block and thread by thread. csrc/fused_adam_host.cpp does that, so the CPU
// test suite runs this file's chunking and the kernel's math (see [Note: the kernel on the
// host] there).

#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#if defined(__CUDACC__)
#define LZ_HOST_DEVICE __host__ __device__
#define LZ_INLINE __forceinline__
#else
#define LZ_HOST_DEVICE
#define LZ_INLINE inline
#endif

namespace lightning_zero {
namespace mta {

// The named tensor-list slots, in the order of the table's rows.
enum Slot : int { kGrad = 0, kMaster = 1, kExpAvg = 2, kExpAvgSq = 3, kOut = 4, kSlots = 5 };

constexpr int kMaxTensors = 36;   // tensors per table
constexpr int kMaxBlocks = 640;   // blocks (chunks) per launch
constexpr int64_t kChunk = 65536; // elements per block: 64K elements is ~1.8 MB of traffic
constexpr int kThreads = 512;     // threads per block
constexpr int kIlp = 4;           // consecutive elements per thread and iteration (one 16-byte fp32 load)

struct TensorTable {
  void* addresses[kSlots][kMaxTensors];  // nullptr in kOut: no low-precision copy
  int64_t numel[kMaxTensors];
  uint8_t block_tensor[kMaxBlocks];      // which tensor block b works on
  uint16_t block_chunk[kMaxBlocks];      // which chunk of it
};
static_assert(kMaxTensors <= 256, "block_tensor is a uint8_t");
constexpr int64_t kMaxChunksPerTensor = 65535;  // what block_chunk can index; longer tensors are split
// The table and the kernel's other arguments (about 100 bytes of constants and two pointers)
// must fit into the 4 KiB of kernel parameters every CUDA architecture accepts.
static_assert(sizeof(TensorTable) + 256 <= 4096, "TensorTable must fit the 4 KiB kernel-argument limit");

// One tensor's slot addresses and size, as the host collects them.
struct TensorRef {
  void* addresses[kSlots];
  int64_t numel;
};

// Packs `tensors` into tables and calls `launch(table, number_of_blocks)` for each full one,
// then for the last. Tensors with no elements are skipped; each must have at most
// kMaxChunksPerTensor chunks (for_each_part makes them so). Host code.
inline void for_each_table(
    const TensorRef* tensors, int64_t count, const std::function<void(const TensorTable&, int)>& launch) {
  TensorTable table{};
  int tensors_in_table = 0;
  int blocks = 0;
  for (int64_t t = 0; t < count; ++t) {
    const TensorRef& ref = tensors[t];
    if (ref.numel == 0) {
      continue;
    }
    const int64_t chunks = (ref.numel + kChunk - 1) / kChunk;
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      if (chunk == 0 || tensors_in_table == 0) {  // the tensor enters this table
        for (int s = 0; s < kSlots; ++s) {
          table.addresses[s][tensors_in_table] = ref.addresses[s];
        }
        table.numel[tensors_in_table] = ref.numel;
        ++tensors_in_table;
      }
      table.block_tensor[blocks] = static_cast<uint8_t>(tensors_in_table - 1);
      table.block_chunk[blocks] = static_cast<uint16_t>(chunk);
      ++blocks;
      const bool tensor_done = chunk == chunks - 1;
      const bool blocks_full = blocks == kMaxBlocks;
      const bool tensors_full = tensors_in_table == kMaxTensors && tensor_done;
      if (blocks_full || tensors_full) {
        launch(table, blocks);
        blocks = 0;
        // A tensor with chunks left continues in the next table, in its slot 0.
        tensors_in_table = 0;
        if (!tensor_done) {
          for (int s = 0; s < kSlots; ++s) {
            table.addresses[s][0] = ref.addresses[s];
          }
          table.numel[0] = ref.numel;
          tensors_in_table = 1;
        }
      }
    }
  }
  if (blocks > 0) {
    launch(table, blocks);
  }
}

// Appends `ref` to `parts`, split into parts of at most `max_part_numel` elements (whole
// chunks), each slot's address advanced by its element size. Host code.
inline void for_each_part(const TensorRef& ref, const int64_t element_size[kSlots], int64_t max_part_numel,
                          std::vector<TensorRef>& parts) {
  for (int64_t start = 0; start < ref.numel; start += max_part_numel) {
    TensorRef part = ref;
    for (int s = 0; s < kSlots; ++s) {
      if (ref.addresses[s] != nullptr) {
        part.addresses[s] = static_cast<char*>(ref.addresses[s]) + start * element_size[s];
      }
    }
    part.numel = ref.numel - start < max_part_numel ? ref.numel - start : max_part_numel;
    parts.push_back(part);
  }
  if (ref.numel == 0) {
    parts.push_back(ref);
  }
}

}  // namespace mta
}  // namespace lightning_zero
