// The TC read of an expanded state in one pass over it, forward and backward (ddl_hf.native).
//
// The same math as delta_ops.temporal_conv_read: out[b, t, d] = sum_j sum_c x(b, t - lag_j)[d, c] w[d, c, j],
// lag_j = K - 1 - j, where rows before x come from `past` (the cached window; zeros when absent) and a tap j with
// same_document[b, t, j] false reads nothing (packed rows). The Python one pass makes K in-place multiply-adds over
// the state forward and 3K passes backward; here each (b, t) row of x, grad_out and grad_x is touched once, and the
// last K rows stay in cache for the taps that read them again.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace {

struct Taps {
  int64_t batch, steps, dim, channels, size;
  const bool* same_document;  // [B, T, K] or nullptr
  bool reads(int64_t b, int64_t t, int64_t j) const {
    return same_document == nullptr || same_document[(b * steps + t) * size + j];
  }
};

// Row `s` (may be negative: a past row) of sequence b, as a pointer to its [D, d_v] slab, or nullptr (zeros).
template <typename T>
const T* row(const T* x, const T* past, const Taps& taps, int64_t b, int64_t s) {
  const int64_t slab = taps.dim * taps.channels;
  if (s >= 0) return x + (b * taps.steps + s) * slab;
  if (past == nullptr) return nullptr;
  return past + (b * (taps.size - 1) + (taps.size - 1 + s)) * slab;
}

// The kernels work on i = d * d_v + c, contiguous in x, with the weight as wt [K, D * d_v] (wt[j, i] = w[d, c, j]):
// every inner loop runs over contiguous memory and vectorises (-O3, omp simd).
template <typename T>
void forward(const T* x, const T* wt, const T* past, const Taps& taps, T* out) {
  const int64_t D = taps.dim, V = taps.channels, K = taps.size, slab = D * V;
  at::parallel_for(0, taps.batch * taps.steps, 16, [&](int64_t begin, int64_t end) {
    std::vector<T> products(slab);
    for (int64_t bt = begin; bt < end; ++bt) {
      const int64_t b = bt / taps.steps, t = bt % taps.steps;
      T* __restrict__ p = products.data();
      std::fill(p, p + slab, T(0));
      for (int64_t j = 0; j < K; ++j) {
        const T* __restrict__ s = taps.reads(b, t, j) ? row(x, past, taps, b, t - (K - 1 - j)) : nullptr;
        if (s == nullptr) continue;
        const T* __restrict__ wj = wt + j * slab;
#pragma omp simd
        for (int64_t i = 0; i < slab; ++i) p[i] += s[i] * wj[i];
      }
      T* __restrict__ o = out + bt * D;
      for (int64_t d = 0; d < D; ++d) {
        T sum = 0;
        for (int64_t c = 0; c < V; ++c) sum += p[d * V + c];
        o[d] = sum;
      }
    }
  });
}

// grad_x[b, t - lag_j] += g[b, t] wt[j] and grad_wt[j] += g[b, t] x(b, t - lag_j), for every (b, t, j) whose tap
// reads (g broadcast over the d_v channels of each d). Parallel over blocks of hidden units: each thread owns its
// grad_x and grad_wt entries.
template <typename T>
void backward(const T* g, const T* x, const T* wt, const T* past, const Taps& taps, T* grad_x, T* grad_wt) {
  const int64_t D = taps.dim, V = taps.channels, K = taps.size, slab = D * V;
  at::parallel_for(0, D, 32, [&](int64_t d_begin, int64_t d_end) {
    const int64_t lo = d_begin * V, hi = d_end * V;
    std::vector<T> spread(slab);  // g[b, t, d] at every i of d
    for (int64_t b = 0; b < taps.batch; ++b) {
      for (int64_t t = 0; t < taps.steps; ++t) {
        const T* gt = g + (b * taps.steps + t) * D;
        T* __restrict__ gs = spread.data();
        for (int64_t d = d_begin; d < d_end; ++d)
          for (int64_t c = 0; c < V; ++c) gs[d * V + c] = gt[d];
        for (int64_t j = 0; j < K; ++j) {
          if (!taps.reads(b, t, j)) continue;
          const int64_t s = t - (K - 1 - j);
          const T* __restrict__ wj = wt + j * slab;
          if (grad_x != nullptr && s >= 0) {
            T* __restrict__ gx = grad_x + (b * taps.steps + s) * slab;
#pragma omp simd
            for (int64_t i = lo; i < hi; ++i) gx[i] += gs[i] * wj[i];
          }
          const T* __restrict__ source = row(x, past, taps, b, s);
          if (grad_wt != nullptr && source != nullptr) {
            T* __restrict__ gw = grad_wt + j * slab;
#pragma omp simd
            for (int64_t i = lo; i < hi; ++i) gw[i] += gs[i] * source[i];
          }
        }
      }
    }
  });
}

Taps taps_of(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& same_document) {
  TORCH_CHECK(x.dim() == 4 && weight.dim() == 3, "tc_read: x [B, T, D, d_v] and weight [D, d_v, K]");
  TORCH_CHECK(weight.size(0) == x.size(2) && weight.size(1) == x.size(3), "tc_read: weight does not match x");
  return {x.size(0), x.size(1), x.size(2), x.size(3), weight.size(2),
          same_document.has_value() ? same_document->data_ptr<bool>() : nullptr};
}

at::Tensor tc_read_forward(const at::Tensor& x_in, const at::Tensor& weight, const c10::optional<at::Tensor>& past_in,
                           const c10::optional<at::Tensor>& same_document_in) {
  const at::Tensor x = x_in.contiguous();
  const c10::optional<at::Tensor> past = past_in.has_value() ? c10::optional<at::Tensor>(past_in->contiguous()) : past_in;
  const c10::optional<at::Tensor> same_document =
      same_document_in.has_value() ? c10::optional<at::Tensor>(same_document_in->contiguous()) : same_document_in;
  const Taps taps = taps_of(x, weight, same_document);
  const at::Tensor wt = weight.to(x.scalar_type()).permute({2, 0, 1}).contiguous();
  at::Tensor out = at::empty({taps.batch, taps.steps, taps.dim}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "tc_read_forward", [&] {
    forward<scalar_t>(x.data_ptr<scalar_t>(), wt.data_ptr<scalar_t>(),
                      past.has_value() ? past->data_ptr<scalar_t>() : nullptr, taps, out.data_ptr<scalar_t>());
  });
  return out;
}

std::vector<at::Tensor> tc_read_backward(const at::Tensor& grad_out, const at::Tensor& x_in, const at::Tensor& weight,
                                         const c10::optional<at::Tensor>& past_in,
                                         const c10::optional<at::Tensor>& same_document_in, bool need_x, bool need_w) {
  const at::Tensor x = x_in.contiguous();
  const at::Tensor g = grad_out.to(x.scalar_type()).contiguous();
  const c10::optional<at::Tensor> past = past_in.has_value() ? c10::optional<at::Tensor>(past_in->contiguous()) : past_in;
  const c10::optional<at::Tensor> same_document =
      same_document_in.has_value() ? c10::optional<at::Tensor>(same_document_in->contiguous()) : same_document_in;
  const Taps taps = taps_of(x, weight, same_document);
  const at::Tensor wt = weight.to(x.scalar_type()).permute({2, 0, 1}).contiguous();
  at::Tensor grad_x = need_x ? at::zeros_like(x) : at::Tensor();
  at::Tensor grad_wt = need_w ? at::zeros_like(wt) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "tc_read_backward", [&] {
    backward<scalar_t>(g.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), wt.data_ptr<scalar_t>(),
                       past.has_value() ? past->data_ptr<scalar_t>() : nullptr, taps,
                       need_x ? grad_x.data_ptr<scalar_t>() : nullptr, need_w ? grad_wt.data_ptr<scalar_t>() : nullptr);
  });
  return {grad_x, need_w ? grad_wt.permute({1, 2, 0}).contiguous() : grad_wt};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tc_read_forward", &tc_read_forward, "TC read, forward (one pass over the state)");
  m.def("tc_read_backward", &tc_read_backward, "TC read, backward (one pass over the state)");
}
