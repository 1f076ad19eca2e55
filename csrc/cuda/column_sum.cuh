// Column sums of fp32 (double) partial rows into a parameter gradient, for kernels that reduce over rows in
// two deterministic stages (layer_norm's dweight/dbias, bias_dropout_add's dbias): stage 1 writes one row
// of partial sums per block or row chunk, this is stage 2.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace accel {
namespace column_sum {

constexpr int kCols = 32;
constexpr int kRows = 16;

// out_y[c] = the sum over k < rows of partial[k * row_stride + y * N + c], rounded to P, for y = blockIdx.y
// (out_y null: nothing to do). Thread row ty adds k = ty, ty + kRows, ..., then row 0 adds the kRows sums in
// order: a fixed order (deterministic, no atomics), and hundreds of partial rows are read in parallel rather
// than as one serial chain per column.
// Assumptions: blockDim = (kCols, kRows); gridDim = (ceil(N / kCols), number of outputs <= 2).
template <typename acc_t, typename P>
__global__ void column_sum_kernel(const acc_t* __restrict__ partial, int64_t rows, int64_t row_stride, int64_t N,
                                  P* __restrict__ out0, P* __restrict__ out1) {
  __shared__ acc_t sums[kRows][kCols + 1];
  P* out = blockIdx.y == 0 ? out0 : out1;
  if (out == nullptr) return;  // uniform across the block
  const int64_t col = (int64_t)blockIdx.x * kCols + threadIdx.x;
  const acc_t* part = partial + (int64_t)blockIdx.y * N + col;
  acc_t sum = 0;
  if (col < N)
    for (int64_t k = threadIdx.y; k < rows; k += kRows) sum += part[k * row_stride];
  sums[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y != 0 || col >= N) return;
  for (int i = 1; i < kRows; ++i) sum += sums[i][threadIdx.x];
  out[col] = static_cast<P>(sum);
}

// How stage 1 splits `rows` into chunks (gridDim.y, one partial row each) over `col_tiles` column blocks:
// enough blocks to fill every SM several times over, at least `min_rows` rows a chunk, at most 65535 chunks.
struct RowChunks {
  int64_t chunks, rows_per_chunk;
};

inline RowChunks row_chunks(int64_t rows, int64_t col_tiles, int64_t min_rows) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  int64_t chunks = std::min<int64_t>({(sms * 8 + col_tiles - 1) / col_tiles, (rows + min_rows - 1) / min_rows, 65535});
  chunks = std::max<int64_t>(chunks, 1);
  const int64_t rows_per_chunk = (rows + chunks - 1) / chunks;
  return {(rows + rows_per_chunk - 1) / rows_per_chunk, rows_per_chunk};
}

// out0 (and out1, may be null) from `rows` partial rows of row_stride elements, out_y's N columns at offset y * N.
template <typename acc_t, typename P>
void launch(const acc_t* partial, int64_t rows, int64_t row_stride, int64_t N, P* out0, P* out1,
            cudaStream_t stream) {
  const int64_t col_tiles = (N + kCols - 1) / kCols;
  TORCH_CHECK(col_tiles <= 0x7fffffff, "column_sum: ", N, " columns are too many");
  column_sum_kernel<acc_t, P><<<dim3((unsigned)col_tiles, out1 != nullptr ? 2u : 1u), dim3(kCols, kRows), 0, stream>>>(
      partial, rows, row_stride, N, out0, out1);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace column_sum
}  // namespace accel
