// Argument checks shared by csrc/cpu/fmha.cpp and csrc/cuda/fmha.cu, so both kernels accept the
// same inputs (the CUDA file adds only its own limits: N <= kMaxN, int32 head and window counts).
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <optional>

namespace accel {
namespace fmha_host {

inline void check_fwd_inputs(const at::Tensor& attn, const at::Tensor& bias, const std::optional<at::Tensor>& mask,
                             int64_t window_num) {
  TORCH_CHECK(attn.dim() == 4 && attn.size(2) == attn.size(3),
              "fmha_swin_fwd: attn must be [B*nW, nH, N, N], got ", attn.sizes());
  const int64_t nH = attn.size(1), N = attn.size(2);
  TORCH_CHECK(bias.dim() == 3 && bias.size(0) == nH && bias.size(1) == N && bias.size(2) == N,
              "fmha_swin_fwd: relative_pos_bias must be [nH, N, N] = [", nH, ", ", N, ", ", N, "], got ",
              bias.sizes());
  TORCH_CHECK(bias.device() == attn.device(), "fmha_swin_fwd: bias must be on ", attn.device());
  TORCH_CHECK(window_num > 0 && attn.size(0) % window_num == 0, "fmha_swin_fwd: window_num=", window_num,
              " must be positive and divide attn.size(0)=", attn.size(0));
  if (mask.has_value()) {
    const auto& m = *mask;
    TORCH_CHECK(m.dim() == 3 && m.size(0) == window_num && m.size(1) == N && m.size(2) == N,
                "fmha_swin_fwd: attn_mask must be [nW, N, N] = [", window_num, ", ", N, ", ", N, "], got ",
                m.sizes());
    TORCH_CHECK(m.device() == attn.device(), "fmha_swin_fwd: attn_mask must be on ", attn.device());
  }
}

inline void check_bwd_inputs(const at::Tensor& grad, const at::Tensor& out) {
  TORCH_CHECK(out.dim() == 4 && out.size(2) == out.size(3),
              "fmha_swin_bwd: out must be [B*nW, nH, N, N], got ", out.sizes());
  TORCH_CHECK(grad.sizes() == out.sizes(), "fmha_swin_bwd: grad ", grad.sizes(), " and out ", out.sizes(),
              " differ in shape");
  TORCH_CHECK(grad.device() == out.device(), "fmha_swin_bwd: grad must be on ", out.device());
}

}  // namespace fmha_host
}  // namespace accel
