// Non-maximum suppression on CPU: hard NMS (torchvision semantics) and soft-NMS (mmcv semantics,
// optionally per class for batched soft-NMS).
//
// Box geometry, the decay weights and the tie order come from csrc/nms_host.h, shared with
// csrc/cuda/nms.cu: IoU = inter / ((area_a + area_b) - inter) with no +1, in float (double for
// float64 inputs), so hard NMS is bit-identical to torchvision's CPU nms. Half and bfloat16
// inputs are computed in float.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "nms_host.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <vector>

namespace accel {
namespace {

using namespace nms_host;

// Whether waking the thread pool pays depends on whether other processes hold the cores, which cannot
// be known in advance: on a busy machine every parallel section waits for a thread the OS has not
// scheduled (gaussian soft-NMS of 20k boxes took 12.5-16 s with the second core busy, 1.8 s on one
// thread). So the loops measure: a RoundTimer times rounds run both ways, runs the cheaper per unit of
// work, and re-times the other way every `retime` rounds, following load that changes while it runs.
class RoundTimer {
 public:
  explicit RoundTimer(int64_t retime) : retime_(retime) {}

  bool parallel_next(int64_t round) const {
    if (samples_[0] < 2 || samples_[1] < 2) return round % 2 == 1;  // try both ways first
    const bool faster = cost_[1] < cost_[0];
    return round % retime_ == 0 ? !faster : faster;
  }

  template <typename F>
  void time(bool parallel, int64_t work, F&& round) {
    const auto t0 = std::chrono::steady_clock::now();
    round();
    const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
    const double per = ns / static_cast<double>(std::max<int64_t>(1, work));
    const int w = parallel ? 1 : 0;
    // A moving average: recent rounds count most, one descheduled round does not decide alone.
    cost_[w] = samples_[w] == 0 ? per : 0.75 * cost_[w] + 0.25 * per;
    ++samples_[w];
  }

 private:
  int64_t retime_;
  double cost_[2] = {0.0, 0.0};
  int64_t samples_[2] = {0, 0};
};

// Runs f(chunk) for every chunk in [0, chunks) on the thread pool, each thread claiming the next chunk
// from a shared counter instead of getting an equal share up front. When another process holds a core,
// the thread the OS left waiting starts late; with a fixed split the whole pass waited for its share,
// here the running threads take it and the pass waits only for that thread to find nothing left.
template <typename F>
void for_each_chunk_claimed(int64_t chunks, F&& f) {
  std::atomic<int64_t> next{0};
  const int64_t tasks = std::min<int64_t>(at::get_num_threads(), chunks);
  at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
    for (int64_t ch; (ch = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) f(ch);
  });
}

// Hard NMS runs in blocks of kBlock boxes (by decreasing score): within a block, serially, each box
// not yet suppressed is kept and suppresses the later boxes of its block; then the block's kept boxes
// suppress every later box in one pass, which may run in parallel when it holds at least kParallelWork
// IoUs (timed both ways by a RoundTimer, the cheaper kept). A box is
// suppressed iff some kept box before it overlaps it by more than the threshold, which is what the
// one-box-at-a-time loop computes; but the thread pool is woken once per block rather than once per
// kept box. Waking it per box made 20k boxes take 17.5 s with the second core busy (1.1 s on one
// thread): every round waited for a thread the OS had not scheduled.
constexpr int64_t kBlock = 1024;
constexpr int64_t kParallelWork = 1 << 22;

// ---------------------------------------------------------------------------------------------
// Hard NMS: visit boxes by decreasing score; a kept box suppresses every later box whose IoU with
// it is > iou_threshold. The comparison is done in double, like torchvision's (float ovr > double).
// ---------------------------------------------------------------------------------------------
at::Tensor nms_cpu(const at::Tensor& boxes_, const at::Tensor& scores_, double iou_threshold) {
  check_boxes_scores(boxes_, scores_, "nms");
  const int64_t n = boxes_.size(0);
  if (n == 0) return at::empty({0}, boxes_.options().dtype(at::kLong));

  const ByScore visit = by_score(boxes_, scores_);
  const at::Tensor &order = visit.order, &sorted = visit.boxes;
  at::Tensor keep = at::empty({n}, boxes_.options().dtype(at::kLong));
  int64_t kept = 0;

  AT_DISPATCH_FLOATING_TYPES(sorted.scalar_type(), "nms_cpu", [&] {
    const scalar_t* b = sorted.const_data_ptr<scalar_t>();
    std::vector<scalar_t> x1(n), y1(n), x2(n), y2(n), area(n);
    for (int64_t i = 0; i < n; ++i) {
      x1[i] = b[4 * i];
      y1[i] = b[4 * i + 1];
      x2[i] = b[4 * i + 2];
      y2[i] = b[4 * i + 3];
      area[i] = box_area(x1[i], y1[i], x2[i], y2[i]);
    }
    std::vector<uint8_t> suppressed(n, 0);
    const int64_t* ord = order.const_data_ptr<int64_t>();
    int64_t* out = keep.mutable_data_ptr<int64_t>();
    auto overlaps = [&](int64_t i, int64_t j) {
      const scalar_t inter = intersection(x1[i], y1[i], x2[i], y2[i], x1[j], y1[j], x2[j], y2[j]);
      return suppresses(inter, area[i], area[j], iou_threshold);
    };
    std::vector<int64_t> block_kept;
    block_kept.reserve(kBlock);
    RoundTimer timer(8);

    for (int64_t start = 0; start < n; start += kBlock) {
      const int64_t end = std::min(n, start + kBlock);
      block_kept.clear();
      for (int64_t i = start; i < end; ++i) {
        if (suppressed[i]) continue;
        out[kept++] = ord[i];
        block_kept.push_back(i);
        for (int64_t j = i + 1; j < end; ++j)
          if (!suppressed[j] && overlaps(i, j)) suppressed[j] = 1;
      }
      // Each j is written by exactly one task, so the bitmap needs no synchronisation.
      auto suppress_rest = [&](int64_t begin, int64_t stop) {
        for (int64_t j = begin; j < stop; ++j) {
          if (suppressed[j]) continue;
          for (const int64_t i : block_kept) {
            if (overlaps(i, j)) {
              suppressed[j] = 1;
              break;
            }
          }
        }
      };
      const int64_t work = (n - end) * static_cast<int64_t>(block_kept.size());
      if (work >= kParallelWork && at::get_num_threads() > 1) {
        const bool parallel = timer.parallel_next(start / kBlock);
        timer.time(parallel, work, [&] {
          if (parallel) {
            // chunks of ~kParallelWork / 16 IoUs: small enough for a late thread's share to be taken over
            const int64_t step = std::max<int64_t>(1, kParallelWork / 16 / static_cast<int64_t>(block_kept.size()));
            for_each_chunk_claimed((n - end + step - 1) / step, [&](int64_t ch) {
              suppress_rest(end + ch * step, std::min(n, end + (ch + 1) * step));
            });
          } else {
            suppress_rest(end, n);
          }
        });
      } else {
        suppress_rest(end, n);
      }
    }
  });
  return keep.narrow(0, 0, kept).clone();
}

// ---------------------------------------------------------------------------------------------
// Soft-NMS. Repeatedly select the live box with the highest current score (ties: lowest input
// index), then decay the score of every other live box:
//   naive:    s = 0            if iou >= iou_threshold
//   linear:   s *= 1 - iou     if iou >= iou_threshold
//   gaussian: s *= exp(-iou^2 / sigma)
// A box whose score is below min_score (initially or after a decay) is dropped. Each round is one
// pass over the candidates that decays them and finds the next round's argmax; large candidate
// sets may be split into chunks decayed in parallel, each with its own argmax, merged afterwards
// (when that is measured to be faster: RoundTimer).
// Dropped boxes are flagged and squeezed out once they are a quarter of the candidates, so a
// round costs O(live boxes) without a serial compaction every round.
// ---------------------------------------------------------------------------------------------

// Below this many candidates a round runs on one thread: a round's work (tens of microseconds per
// 10k candidates) does not pay for waking the pool once per selected box when other processes load
// the cores (measured: benchmarks/nms_contention.py).
constexpr int64_t kParallelSoft = 1 << 16;

template <typename T>
struct SoftNmsCandidates {
  std::vector<T> x1, y1, x2, y2, area, score;
  std::vector<int64_t> id;
  std::vector<uint8_t> dead;
  int64_t size = 0;

  // Larger current score first, then lower input index; -1 is "none".
  bool better(int64_t a, int64_t b) const {
    return b < 0 || ranks_before(score[a], id[a], score[b], id[b]);
  }

  // Squeeze out dead entries; returns the new position of `keep_pos` (or -1).
  int64_t compact(int64_t keep_pos) {
    int64_t w = 0, moved = -1;
    for (int64_t r = 0; r < size; ++r) {
      if (dead[r]) continue;
      if (r == keep_pos) moved = w;
      x1[w] = x1[r];
      y1[w] = y1[r];
      x2[w] = x2[r];
      y2[w] = y2[r];
      area[w] = area[r];
      score[w] = score[r];
      id[w] = id[r];
      dead[w] = 0;
      ++w;
    }
    size = w;
    return moved;
  }
};

template <typename T>
int64_t soft_nms_loop(const T* box, const T* score, int64_t n, T thr, T sigma,
                      T min_score, int64_t method, int64_t* out_idx, T* out_score) {
  SoftNmsCandidates<T> c;
  for (auto* v : {&c.x1, &c.y1, &c.x2, &c.y2, &c.area, &c.score}) v->reserve(n);
  c.id.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    if (!(score[i] >= min_score)) continue;  // also drops NaN scores
    const T bx1 = box[4 * i], by1 = box[4 * i + 1], bx2 = box[4 * i + 2], by2 = box[4 * i + 3];
    c.x1.push_back(bx1);
    c.y1.push_back(by1);
    c.x2.push_back(bx2);
    c.y2.push_back(by2);
    c.area.push_back(box_area(bx1, by1, bx2, by2));
    c.score.push_back(score[i]);
    c.id.push_back(i);
  }
  c.size = static_cast<int64_t>(c.id.size());
  c.dead.assign(c.size, 0);
  const T disjoint = disjoint_weight(method, thr);

  // Decay [begin, end) against the selected box; returns the local argmax and counts new deaths.
  auto decay = [&](int64_t begin, int64_t end, T bx1, T by1, T bx2, T by2, T barea, int64_t& died) {
    int64_t best = -1;
    for (int64_t p = begin; p < end; ++p) {
      if (c.dead[p]) continue;
      const T inter = intersection(bx1, by1, bx2, by2, c.x1[p], c.y1[p], c.x2[p], c.y2[p]);
      const T weight = soft_weight(method, inter, barea, c.area[p], thr, sigma, disjoint);
      if (weight != T(1)) {
        c.score[p] = mul_rn(c.score[p], weight);
        if (!(c.score[p] >= min_score)) {  // also drops NaN
          c.dead[p] = 1;
          ++died;
          continue;
        }
      }
      if (c.better(p, best)) best = p;
    }
    return best;
  };

  int64_t best = -1;
  for (int64_t p = 0; p < c.size; ++p)
    if (c.better(p, best)) best = p;
  int64_t live = c.size;  // candidates not dead
  int64_t k = 0;
  const int64_t max_chunks = std::max<int64_t>(1, at::get_num_threads()) * 4;
  std::vector<int64_t> chunk_best(max_chunks), chunk_died(max_chunks);
  RoundTimer timer(64);
  while (best >= 0) {
    out_idx[k] = c.id[best];
    out_score[k] = c.score[best];
    ++k;
    c.dead[best] = 1;
    --live;
    const T bx1 = c.x1[best], by1 = c.y1[best], bx2 = c.x2[best], by2 = c.y2[best], barea = c.area[best];
    int64_t died = 0;
    if (c.size < kParallelSoft || max_chunks == 1) {
      best = decay(0, c.size, bx1, by1, bx2, by2, barea, died);
    } else {
      const bool parallel = timer.parallel_next(k);
      timer.time(parallel, c.size, [&] {
        if (!parallel) {
          best = decay(0, c.size, bx1, by1, bx2, by2, barea, died);
          return;
        }
        const int64_t chunks = std::min<int64_t>(max_chunks, c.size / 4096);
        const int64_t step = (c.size + chunks - 1) / chunks;
        for_each_chunk_claimed(chunks, [&](int64_t ch) {
          int64_t d = 0;
          chunk_best[ch] = decay(ch * step, std::min(c.size, (ch + 1) * step), bx1, by1, bx2, by2, barea, d);
          chunk_died[ch] = d;
        });
        best = -1;
        for (int64_t ch = 0; ch < chunks; ++ch) {
          died += chunk_died[ch];
          if (chunk_best[ch] >= 0 && c.better(chunk_best[ch], best)) best = chunk_best[ch];
        }
      });
    }
    live -= died;
    if (c.size - live > c.size / 4) best = c.compact(best);
  }
  return k;
}

// Batched soft-NMS: classes never interact, so each class runs its own loop (classes in parallel,
// O(sum of n_c^2) instead of O(n^2)); the results are merged by decreasing rescored score, ties by
// input index, which is the order one greedy loop over all classes would select them in.
template <typename T>
int64_t batched_soft_nms_loop(const T* box, const T* score, const int64_t* label, int64_t n, T thr, T sigma,
                              T min_score, int64_t method, int64_t* out_idx, T* out_score) {
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return label[a] < label[b]; });
  std::vector<int64_t> starts;  // class c is order[starts[c] .. starts[c + 1])
  for (int64_t i = 0; i < n; ++i)
    if (i == 0 || label[order[i]] != label[order[i - 1]]) starts.push_back(i);
  starts.push_back(n);
  const int64_t classes = static_cast<int64_t>(starts.size()) - 1;

  // Class c gathers its boxes into, and writes its results to, rows starts[c] .. of the buffers.
  std::vector<T> cls_box(4 * n), cls_score(n), kept_score(n);
  std::vector<int64_t> kept_idx(n), kept(classes);
  at::parallel_for(0, classes, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      const int64_t s0 = starts[c], len = starts[c + 1] - s0;
      for (int64_t r = 0; r < len; ++r) {
        const int64_t i = order[s0 + r];
        std::copy(box + 4 * i, box + 4 * i + 4, cls_box.begin() + 4 * (s0 + r));
        cls_score[s0 + r] = score[i];
      }
      kept[c] = soft_nms_loop<T>(cls_box.data() + 4 * s0, cls_score.data() + s0, len, thr, sigma, min_score,
                                 method, kept_idx.data() + s0, kept_score.data() + s0);
      for (int64_t r = 0; r < kept[c]; ++r) kept_idx[s0 + r] = order[s0 + kept_idx[s0 + r]];
    }
  });

  std::vector<int64_t> rows;
  for (int64_t c = 0; c < classes; ++c)
    for (int64_t r = 0; r < kept[c]; ++r) rows.push_back(starts[c] + r);
  std::sort(rows.begin(), rows.end(), [&](int64_t a, int64_t b) {
    return ranks_before(kept_score[a], kept_idx[a], kept_score[b], kept_idx[b]);
  });
  for (size_t k = 0; k < rows.size(); ++k) {
    out_idx[k] = kept_idx[rows[k]];
    out_score[k] = kept_score[rows[k]];
  }
  return static_cast<int64_t>(rows.size());
}

// Returns (inds [K] int64, rescored scores [K] in float, or double for float64 boxes), in selection
// order. labels: optional int64 [N]; boxes with different labels never interact. The caller
// gathers the kept boxes, so the op's outputs do not depend on the boxes' storage dtype.
std::tuple<at::Tensor, at::Tensor> soft_nms_cpu(const at::Tensor& boxes_, const at::Tensor& scores_,
                                                const std::optional<at::Tensor>& labels_, double iou_threshold,
                                                double sigma, double min_score, int64_t method) {
  const SoftNmsInputs in = soft_nms_inputs(boxes_, scores_, labels_, method);
  const int64_t n = in.n;
  const at::Tensor &b = in.boxes, &s = in.scores, &labels = in.labels;
  at::Tensor inds = at::empty({n}, b.options().dtype(at::kLong));
  at::Tensor new_scores = at::empty({n}, b.options());
  int64_t k = 0;
  AT_DISPATCH_FLOATING_TYPES(b.scalar_type(), "soft_nms_cpu", [&] {
    const auto thr = static_cast<scalar_t>(iou_threshold);
    const auto sig = static_cast<scalar_t>(sigma);
    const auto low = static_cast<scalar_t>(min_score);
    if (labels.defined()) {
      k = batched_soft_nms_loop<scalar_t>(b.const_data_ptr<scalar_t>(), s.const_data_ptr<scalar_t>(),
                                          labels.const_data_ptr<int64_t>(), n, thr, sig, low, method,
                                          inds.mutable_data_ptr<int64_t>(), new_scores.mutable_data_ptr<scalar_t>());
    } else {
      k = soft_nms_loop<scalar_t>(b.const_data_ptr<scalar_t>(), s.const_data_ptr<scalar_t>(), n, thr, sig, low,
                                  method, inds.mutable_data_ptr<int64_t>(), new_scores.mutable_data_ptr<scalar_t>());
    }
  });
  return {inds.narrow(0, 0, k).clone(), new_scores.narrow(0, 0, k).clone()};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(accel, m) {
  m.def("nms(Tensor boxes, Tensor scores, float iou_threshold) -> Tensor");
  m.def(
      "nms_soft(Tensor boxes, Tensor scores, Tensor? labels, float iou_threshold, float sigma, "
      "float min_score, int method) -> (Tensor inds, Tensor scores)");
}

TORCH_LIBRARY_IMPL(accel, CPU, m) {
  m.impl("nms", &nms_cpu);
  m.impl("nms_soft", &soft_nms_cpu);
}

}  // namespace accel
