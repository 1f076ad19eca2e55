// What csrc/cpu/nms.cpp and csrc/cuda/nms.cu must agree on bit for bit: the method codes, the
// argument checks, the box geometry (area, intersection, IoU), the soft-NMS decay weight and the
// (score, index) order that breaks ties. Both kernels call these same functions with the boxes in
// the same argument order, so the CUDA kernel selects exactly the boxes the tested CPU kernel does.
//
// Conventions: boxes are (x1, y1, x2, y2); area = (x2 - x1) * (y2 - y1), no +1;
// IoU = inter / ((area_a + area_b) - inter), in float (double for float64 boxes), which is
// torchvision's order of operations.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>

#ifdef __CUDACC__
#define ACCEL_NMS_HD __host__ __device__ __forceinline__
#else
#define ACCEL_NMS_HD inline
#endif

namespace accel {
namespace nms_host {

// Method codes shared with accel/runtime/nn/nms.py (METHODS).
constexpr int64_t kNaive = 0;
constexpr int64_t kLinear = 1;
constexpr int64_t kGaussian = 2;

// ------------------------------------------------------------------ arithmetic, same on both sides

// A product rounded on its own. nvcc contracts a product and a following add into one FMA
// (one rounding instead of two), which would move the IoU off the CPU's and torchvision's by an
// ulp; the _rn intrinsics are never contracted. On the host GCC (-ffp-contract=fast in C++) only
// fuses a product whose every use is an add: `inter` is also the IoU's numerator, and the CPU
// kernel stores the areas before adding them, so nothing is fused (no vfmadd in its object code).
template <typename T>
ACCEL_NMS_HD T mul_rn(T a, T b) {
#ifdef __CUDA_ARCH__
  if constexpr (std::is_same<T, double>::value) {
    return __dmul_rn(a, b);
  } else {
    return __fmul_rn(a, b);
  }
#else
  return a * b;
#endif
}

// std::min / std::max semantics on both sides (an unordered comparison returns the first
// argument). The device's min/max are fminf/fmaxf, which return the non-NaN operand instead, so a
// NaN coordinate would give a different intersection on the GPU.
template <typename T>
ACCEL_NMS_HD T min_of(T a, T b) {
  return b < a ? b : a;
}

template <typename T>
ACCEL_NMS_HD T max_of(T a, T b) {
  return a < b ? b : a;
}

// exp in double, rounded once to float. The device's expf (up to 2 ulp off) and the host's libm
// expf can differ in the last bit, enough to swap two nearly equal decayed scores; both double
// exps are within an ulp of double, so after rounding to float they agree except when the exact
// value lies within ~1e-16 (relative) of a float rounding boundary.
ACCEL_NMS_HD float exp_t(float v) { return static_cast<float>(::exp(static_cast<double>(v))); }
ACCEL_NMS_HD double exp_t(double v) { return ::exp(v); }

// ------------------------------------------------------------------ geometry

template <typename T>
ACCEL_NMS_HD T box_area(T x1, T y1, T x2, T y2) {
  return mul_rn(x2 - x1, y2 - y1);
}

// Intersection area of box a (the kept / selected one) with box b. Argument order matters only for
// NaN coordinates, and both kernels pass the selected box first, like torchvision.
template <typename T>
ACCEL_NMS_HD T intersection(T ax1, T ay1, T ax2, T ay2, T bx1, T by1, T bx2, T by2) {
  const T w = max_of(T(0), min_of(ax2, bx2) - max_of(ax1, bx1));
  const T h = max_of(T(0), min_of(ay2, by2) - max_of(ay1, by1));
  return mul_rn(w, h);
}

template <typename T>
ACCEL_NMS_HD T iou(T inter, T area_a, T area_b) {
  return inter / (area_a + area_b - inter);
}

// Hard NMS: does kept box a suppress box b? Compared in double, like torchvision (float > double).
template <typename T>
ACCEL_NMS_HD bool suppresses(T inter, T area_a, T area_b, double iou_threshold) {
  return static_cast<double>(iou(inter, area_a, area_b)) > iou_threshold;
}

// ------------------------------------------------------------------ soft-NMS

// The weight of a box that does not intersect the selected one (IoU 0): 1, except that the naive
// method with iou_threshold <= 0 suppresses even disjoint boxes.
template <typename T>
ACCEL_NMS_HD T disjoint_weight(int64_t method, T iou_threshold) {
  return (method == kNaive && T(0) >= iou_threshold) ? T(0) : T(1);
}

// The factor a box's score is multiplied by once box `sel` (area sel_area) is selected:
//   naive:    0            if iou >= iou_threshold, else 1
//   linear:   1 - iou      if iou >= iou_threshold, else 1
//   gaussian: exp(-iou^2 / sigma)
// `disjoint` is disjoint_weight(method, iou_threshold); the IoU is only computed when the boxes
// intersect. A NaN IoU gives 1 for naive/linear and NaN for gaussian (the box is then dropped).
template <typename T>
ACCEL_NMS_HD T soft_weight(int64_t method, T inter, T sel_area, T area, T iou_threshold, T sigma, T disjoint) {
  if (inter == T(0)) return disjoint;
  const T ovr = iou(inter, sel_area, area);
  if (method == kGaussian) return exp_t(-mul_rn(ovr, ovr) / sigma);
  if (!(ovr >= iou_threshold)) return T(1);
  return method == kLinear ? T(1) - ovr : T(0);
}

// The selection order: larger current score first, then the lower input index.
template <typename T>
ACCEL_NMS_HD bool ranks_before(T score_a, int64_t index_a, T score_b, int64_t index_b) {
  return score_a > score_b || (score_a == score_b && index_a < index_b);
}

// ------------------------------------------------------------------ host side: argument checks, inputs

inline at::ScalarType math_type(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

inline void check_boxes_scores(const at::Tensor& boxes, const at::Tensor& scores, const char* op) {
  TORCH_CHECK(boxes.dim() == 2 && boxes.size(1) == 4, op, ": boxes must be [N, 4], got ", boxes.sizes());
  TORCH_CHECK(scores.dim() == 1 && scores.size(0) == boxes.size(0), op, ": scores must be [N] with N = ",
              boxes.size(0), ", got ", scores.sizes());
  // The dispatcher picks the kernel by the boxes' device; a scores tensor elsewhere would hand the
  // CUDA kernel a host pointer.
  TORCH_CHECK(scores.device() == boxes.device(), op, ": scores must be on ", boxes.device(), ", got ",
              scores.device());
}

// Hard NMS visits the boxes by decreasing score, equal scores in input order (a stable sort, as
// torchvision's CPU nms); gathering the boxes in that order makes each kernel's scan linear.
struct ByScore {
  at::Tensor order;  // int64 [N]: input index of the i-th visited box
  at::Tensor boxes;  // [N, 4] in the math type, contiguous, in visiting order
};

inline ByScore by_score(const at::Tensor& boxes, const at::Tensor& scores) {
  at::Tensor order = std::get<1>(scores.sort(/*stable=*/true, /*dim=*/0, /*descending=*/true));
  at::Tensor sorted = boxes.index_select(0, order).to(math_type(boxes)).contiguous();
  return {order, sorted};
}

// The soft-NMS op's inputs, checked: boxes and scores contiguous in the math type, the optional
// class ids as a contiguous int64 tensor on the boxes' device (undefined when absent).
struct SoftNmsInputs {
  int64_t n;
  at::Tensor boxes, scores, labels;
};

inline SoftNmsInputs soft_nms_inputs(const at::Tensor& boxes, const at::Tensor& scores,
                                     const std::optional<at::Tensor>& labels, int64_t method) {
  check_boxes_scores(boxes, scores, "soft_nms");
  TORCH_CHECK(method == kNaive || method == kLinear || method == kGaussian, "soft_nms: unknown method ", method);
  const int64_t n = boxes.size(0);
  at::Tensor ids;
  if (labels.has_value()) {
    TORCH_CHECK(labels->dim() == 1 && labels->size(0) == n, "soft_nms: labels must be [N] with N = ", n, ", got ",
                labels->sizes());
    TORCH_CHECK(labels->device() == boxes.device(), "soft_nms: labels must be on ", boxes.device(), ", got ",
                labels->device());
    ids = labels->to(at::kLong).contiguous();
  }
  const auto mt = math_type(boxes);
  return {n, boxes.to(mt).contiguous(), scores.to(mt).contiguous(), ids};
}

}  // namespace nms_host
}  // namespace accel
