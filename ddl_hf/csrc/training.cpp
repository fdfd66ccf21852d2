// Native kernels (ddl_hf.native.enable_native_kernels): the fused Delta update and the TC read, each in one pass over
// the state, forward and backward; and, at the end, a residual's inference step (residual_step).
//
// The Delta update: the same math as delta_fused._fused_delta_forward and _FusedDeltaUpdate.backward. Per token, with
// X [D, d_v], h [D], beta, v [d_v]: r = 1 / sqrt(|h|^2 + eps^2), s = r beta (v - r h^T X) (+ 1 in additive mode;
// without erase v - r h^T X is v), X' = X + h s^T. The tensor ops pass over X and over its gradient several times
// (h^T X, the multiply-add; h^T g, dX, and two contractions over d_v for dh); here each token's row is read once and
// stays in cache while it is used. Sums run in the dtype's math type (float32: float). beta == 0 gives X + h (additive) or X (paper) bit
// for bit, as in the tensor ops.
//
// The TC read: the same math as delta_fused.temporal_conv_read: out[b, t, d] = sum_j sum_c x(b, t - lag_j)[d, c]
// w[d, c, j], lag_j = K - 1 - j, where rows before x come from `past` (the cached window; zeros when absent) and a
// tap j with same_document[b, t, j] false reads nothing (packed rows). The tensor ops make K in-place multiply-adds
// over the state forward and 3K passes backward; here each (b, t) row of x, grad_out and grad_x is touched once, and
// the last K rows stay in cache for the taps that read them again.
#include <torch/extension.h>

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
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

// The sizes the loops rely on, checked: a mismatch is an error here, not a read out of bounds.
Taps taps_of(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& past,
             const c10::optional<at::Tensor>& same_document) {
  TORCH_CHECK(x.dim() == 4 && weight.dim() == 3, "tc_read: x [B, T, D, d_v] and weight [D, d_v, K]");
  TORCH_CHECK(weight.size(0) == x.size(2) && weight.size(1) == x.size(3), "tc_read: weight does not match x");
  TORCH_CHECK(!past.has_value() || (past->sizes() == at::IntArrayRef{x.size(0), weight.size(2) - 1, x.size(2),
                                                                       x.size(3)} &&
                                     past->scalar_type() == x.scalar_type()),
              "tc_read: past must be [B, K - 1, D, d_v] in x's dtype");
  TORCH_CHECK(!same_document.has_value() ||
                  (same_document->sizes() == at::IntArrayRef{x.size(0), x.size(1), weight.size(2)} &&
                   same_document->scalar_type() == at::kBool),
              "tc_read: same_document must be bool [B, T, K]");
  return {x.size(0), x.size(1), x.size(2), x.size(3), weight.size(2),
          same_document.has_value() ? same_document->data_ptr<bool>() : nullptr};
}

at::Tensor tc_read_forward(const at::Tensor& x_in, const at::Tensor& weight, const c10::optional<at::Tensor>& past_in,
                           const c10::optional<at::Tensor>& same_document_in) {
  const at::Tensor x = x_in.contiguous();
  const c10::optional<at::Tensor> past = past_in.has_value() ? c10::optional<at::Tensor>(past_in->contiguous()) : past_in;
  const c10::optional<at::Tensor> same_document =
      same_document_in.has_value() ? c10::optional<at::Tensor>(same_document_in->contiguous()) : same_document_in;
  const Taps taps = taps_of(x, weight, past, same_document);
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
  TORCH_CHECK(g.dim() == 3 && g.size(0) == x.size(0) && g.size(1) == x.size(1) && g.size(2) == x.size(2),
              "tc_read_backward: grad_out must be [B, T, D]");
  const c10::optional<at::Tensor> past = past_in.has_value() ? c10::optional<at::Tensor>(past_in->contiguous()) : past_in;
  const c10::optional<at::Tensor> same_document =
      same_document_in.has_value() ? c10::optional<at::Tensor>(same_document_in->contiguous()) : same_document_in;
  const Taps taps = taps_of(x, weight, past, same_document);
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

// ---- the Delta update --------------------------------------------------------------------------------------------

struct Update {
  int64_t tokens, dim, channels;
  double eps;
  bool additive, erase;
};

// Sums in the dtype's math type (float for float32, as the tensor ops do), so that the loops vectorise. kV > 0 is the
// number of value channels known at compile time (the inner loops unroll and vectorise); 0 reads it from `u`.
template <typename T, int kV>
void update_forward(const T* x, const T* h, const T* beta, const T* value, const Update& u, T* out, T* r_out,
                    T* hx_out) {
  using acc_t = at::opmath_type<T>;
  const int64_t D = u.dim, V = kV > 0 ? kV : u.channels;
  at::parallel_for(0, u.tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> hx(V), scale(V);
    for (int64_t n = begin; n < end; ++n) {
      const T* __restrict__ hn = h + n * D;
      const T* __restrict__ xn = x + n * D * V;
      acc_t hh = 0;
#pragma omp simd reduction(+ : hh)
      for (int64_t d = 0; d < D; ++d) hh += static_cast<acc_t>(hn[d]) * static_cast<acc_t>(hn[d]);
      const acc_t r = acc_t(1) / std::sqrt(hh + static_cast<acc_t>(u.eps * u.eps));
      acc_t* __restrict__ hxp = hx.data();
      for (int64_t c = 0; c < V; ++c) hxp[c] = 0;
      if (u.erase) {
        for (int64_t d = 0; d < D; ++d) {
          const acc_t hd = hn[d];
          for (int64_t c = 0; c < V; ++c) hxp[c] += hd * static_cast<acc_t>(xn[d * V + c]);
        }
      }
      const acc_t rb = r * static_cast<acc_t>(beta[n]);
      acc_t* __restrict__ sp = scale.data();
      for (int64_t c = 0; c < V; ++c) {
        const acc_t coefficient = static_cast<acc_t>(value[n * V + c]) - (u.erase ? r * hxp[c] : acc_t(0));
        sp[c] = u.additive ? acc_t(1) + rb * coefficient : rb * coefficient;
        if (hx_out != nullptr) hx_out[n * V + c] = static_cast<T>(hxp[c]);
      }
      r_out[n] = static_cast<T>(r);
      T* __restrict__ on = out + n * D * V;
      for (int64_t d = 0; d < D; ++d) {
        const acc_t hd = hn[d];
        for (int64_t c = 0; c < V; ++c) on[d * V + c] = static_cast<T>(static_cast<acc_t>(xn[d * V + c]) + hd * sp[c]);
      }
    }
  });
}

template <typename T, int kV>
void update_backward(const T* g, const T* x, const T* h, const T* beta, const T* value, const T* r_in,
                     const T* hx_in, const Update& u, T* grad_x, T* grad_h, T* grad_beta, T* grad_value) {
  using acc_t = at::opmath_type<T>;
  const int64_t D = u.dim, V = kV > 0 ? kV : u.channels;
  at::parallel_for(0, u.tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> hg(V), mix(V), erase(V);
    for (int64_t n = begin; n < end; ++n) {
      const T* __restrict__ hn = h + n * D;
      const T* __restrict__ gn = g + n * D * V;
      const T* __restrict__ xn = u.erase ? x + n * D * V : nullptr;
      const acc_t r = r_in[n], b = beta[n];
      acc_t* __restrict__ hgp = hg.data();
      for (int64_t c = 0; c < V; ++c) hgp[c] = 0;
      for (int64_t d = 0; d < D; ++d) {
        const acc_t hd = hn[d];
        for (int64_t c = 0; c < V; ++c) hgp[c] += hd * static_cast<acc_t>(gn[d * V + c]);
      }
      acc_t h_dot_dk = 0, dbeta = 0;
      acc_t* __restrict__ mp = mix.data();
      acc_t* __restrict__ ep = erase.data();
      for (int64_t c = 0; c < V; ++c) {
        const acc_t hx = u.erase ? static_cast<acc_t>(hx_in[n * V + c]) : acc_t(0);
        const acc_t residual = static_cast<acc_t>(value[n * V + c]) - r * hx;  // v - k^T X (hx = 0 without erase)
        const acc_t b_kg = b * r * hgp[c];  // beta k^T g = dL/dv
        const acc_t coefficient = b * residual;
        mp[c] = u.additive ? r * coefficient + acc_t(1) : r * coefficient;
        ep[c] = u.erase ? -r * b_kg : acc_t(0);
        h_dot_dk += hgp[c] * coefficient - hx * b_kg;
        dbeta += r * hgp[c] * residual;
        if (grad_value != nullptr) grad_value[n * V + c] = static_cast<T>(b_kg);
      }
      if (grad_beta != nullptr) grad_beta[n] = static_cast<T>(dbeta);
      const acc_t radial = r * r * r * h_dot_dk;
      T* __restrict__ gxn = grad_x != nullptr ? grad_x + n * D * V : nullptr;
      T* __restrict__ ghn = grad_h != nullptr ? grad_h + n * D : nullptr;
      if (gxn != nullptr) {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) {
          const acc_t hd = hn[d];
          for (int64_t c = 0; c < V; ++c) gxn[d * V + c] = static_cast<T>(static_cast<acc_t>(gn[d * V + c]) + hd * ep[c]);
        }
      }
      if (ghn != nullptr && xn != nullptr) {  // two loops, not a branch per d: each vectorises
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) {
          acc_t dh = -static_cast<acc_t>(hn[d]) * radial;
          for (int64_t c = 0; c < V; ++c)
            dh += static_cast<acc_t>(gn[d * V + c]) * mp[c] + static_cast<acc_t>(xn[d * V + c]) * ep[c];
          ghn[d] = static_cast<T>(dh);
        }
      } else if (ghn != nullptr) {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) {
          acc_t dh = -static_cast<acc_t>(hn[d]) * radial;
          for (int64_t c = 0; c < V; ++c) dh += static_cast<acc_t>(gn[d * V + c]) * mp[c];
          ghn[d] = static_cast<T>(dh);
        }
      }
    }
  });
}

// Calls body<kV>() with kV the number of value channels where it is a common one (compile-time loops), else 0.
template <typename Body>
void with_channels(int64_t channels, Body body) {
  switch (channels) {
    case 1: return body(std::integral_constant<int, 1>{});
    case 2: return body(std::integral_constant<int, 2>{});
    case 4: return body(std::integral_constant<int, 4>{});
    case 8: return body(std::integral_constant<int, 8>{});
    default: return body(std::integral_constant<int, 0>{});
  }
}

Update update_of(const at::Tensor& x, const at::Tensor& h, const at::Tensor& beta, const at::Tensor& value, double eps,
                 bool additive, bool erase) {
  TORCH_CHECK(x.dim() == 3 && h.dim() == 2 && beta.dim() == 1 && value.dim() == 2,
              "delta_update: state [N, D, d_v], h [N, D], beta [N], value [N, d_v]");
  TORCH_CHECK(h.size(0) == x.size(0) && h.size(1) == x.size(1) && beta.size(0) == x.size(0) &&
                  value.size(0) == x.size(0) && value.size(1) == x.size(2),
              "delta_update: sizes do not fit together");
  TORCH_CHECK(h.scalar_type() == x.scalar_type() && beta.scalar_type() == x.scalar_type() &&
                  value.scalar_type() == x.scalar_type(),
              "delta_update: state, h, beta and value must share one dtype");
  return {x.size(0), x.size(1), x.size(2), eps, additive, erase};
}

std::vector<at::Tensor> delta_update_forward(const at::Tensor& x_in, const at::Tensor& h_in, const at::Tensor& beta_in,
                                             const at::Tensor& value_in, double eps, bool additive, bool erase) {
  const at::Tensor x = x_in.contiguous(), h = h_in.contiguous(), beta = beta_in.contiguous(),
                   value = value_in.contiguous();
  const Update u = update_of(x, h, beta, value, eps, additive, erase);
  at::Tensor out = at::empty_like(x), r = at::empty({u.tokens}, x.options());
  at::Tensor hx = erase ? at::empty({u.tokens, u.channels}, x.options()) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "delta_update_forward", [&] {
    with_channels(u.channels, [&](auto channels) {
      update_forward<scalar_t, decltype(channels)::value>(
          x.data_ptr<scalar_t>(), h.data_ptr<scalar_t>(), beta.data_ptr<scalar_t>(), value.data_ptr<scalar_t>(), u,
          out.data_ptr<scalar_t>(), r.data_ptr<scalar_t>(), erase ? hx.data_ptr<scalar_t>() : nullptr);
    });
  });
  return {out, r, hx};
}

std::vector<at::Tensor> delta_update_backward(const at::Tensor& grad_out, const c10::optional<at::Tensor>& x_in,
                                              const at::Tensor& h_in, const at::Tensor& beta_in,
                                              const at::Tensor& value_in, const at::Tensor& r_in,
                                              const c10::optional<at::Tensor>& hx_in, double eps, bool additive,
                                              bool erase, std::vector<bool> needs) {
  TORCH_CHECK(!erase || (x_in.has_value() && hx_in.has_value()), "delta_update_backward: erase needs X and h^T X");
  const at::Tensor h = h_in.contiguous(), beta = beta_in.contiguous(), value = value_in.contiguous(),
                   r = r_in.contiguous();
  const at::Tensor g = grad_out.to(h.scalar_type()).contiguous();
  const at::Tensor x = erase ? x_in->contiguous() : g;  // without erase X is not read: g stands in for its shape
  const at::Tensor hx = erase ? hx_in->contiguous() : at::Tensor();
  const Update u = update_of(x, h, beta, value, eps, additive, erase);
  TORCH_CHECK(needs.size() == 4 && g.sizes() == x.sizes() && r.numel() == u.tokens &&
                  (!erase || (hx.numel() == u.tokens * u.channels && hx.scalar_type() == h.scalar_type())) &&
                  r.scalar_type() == h.scalar_type(),
              "delta_update_backward: grad_out, r and h^T X do not fit the forward's sizes");
  at::Tensor grad_x = needs[0] ? at::empty_like(g) : at::Tensor();
  at::Tensor grad_h = needs[1] ? at::empty_like(h) : at::Tensor();
  at::Tensor grad_beta = needs[2] ? at::empty_like(beta) : at::Tensor();
  at::Tensor grad_value = needs[3] ? at::empty_like(value) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES(h.scalar_type(), "delta_update_backward", [&] {
    auto ptr = [](const at::Tensor& t) { return t.defined() ? t.data_ptr<scalar_t>() : nullptr; };
    with_channels(u.channels, [&](auto channels) {
      update_backward<scalar_t, decltype(channels)::value>(
          g.data_ptr<scalar_t>(), erase ? x.data_ptr<scalar_t>() : nullptr, h.data_ptr<scalar_t>(),
          beta.data_ptr<scalar_t>(), value.data_ptr<scalar_t>(), r.data_ptr<scalar_t>(),
          erase ? hx.data_ptr<scalar_t>() : nullptr, u, ptr(grad_x), ptr(grad_h), ptr(grad_beta), ptr(grad_value));
    });
  });
  return {grad_x, grad_h, grad_beta, grad_value};
}

// One Delta residual after its branch, for inference (DeltaKernels.residual_step; the reference is
// DeltaResidual.update): per token n, the gate logit g = w_g . c + b_g and beta = 2 sigmoid(g) clamp(beta_open, 0, 1);
// the value v = W_v c + b_v, or scale sigmoid(W_v x + b_v) of the un-normalised read x (sigmoid_value), or a
// constant (no W_v); then the update above, X' = X + h s^T with s = r beta (v - r h^T X) (+ 1 in additive mode).
// Decoding a token is per-call overhead in the tensor ops (~20 small calls per residual); here it is one. The sums
// run in double precision; beta == 0 gives X + h (additive) or X (paper) bit for bit.
template <typename T>
void step_rows(const T* X, const T* c, const T* h, const T* xin, const T* wg, double bg, double rho, const T* wv,
               const T* bv, bool sigmoid_value, double value_scale, double value_constant, double eps, bool additive,
               bool erase, int64_t D, int64_t V, int64_t begin, int64_t end, T* out, T* beta_out) {
  std::vector<double> hx(V), s(V);
  for (int64_t n = begin; n < end; ++n) {
    const T* __restrict__ xn = X + n * D * V;
    const T* __restrict__ cn = c + n * D;
    const T* __restrict__ hn = h + n * D;
    const T* __restrict__ in = (sigmoid_value ? xin : c) + n * D;
    double g = bg, hh = 0.0;
#pragma omp simd reduction(+ : g, hh)
    for (int64_t d = 0; d < D; ++d) {
      g += static_cast<double>(wg[d]) * static_cast<double>(cn[d]);
      hh += static_cast<double>(hn[d]) * static_cast<double>(hn[d]);
    }
    const double beta = 2.0 * (g >= 0 ? 1.0 / (1.0 + std::exp(-g)) : std::exp(g) / (1.0 + std::exp(g))) * rho;
    const double r = 1.0 / std::sqrt(hh + eps * eps);
    std::fill(hx.begin(), hx.end(), 0.0);  // h^T X over the value channels (the erase term)
    if (erase && V == 1) {
      double sum = 0.0;
#pragma omp simd reduction(+ : sum)
      for (int64_t d = 0; d < D; ++d) sum += static_cast<double>(hn[d]) * static_cast<double>(xn[d]);
      hx[0] = sum;
    } else if (erase) {
      for (int64_t d = 0; d < D; ++d)
        for (int64_t v = 0; v < V; ++v) hx[v] += static_cast<double>(hn[d]) * static_cast<double>(xn[d * V + v]);
    }
    for (int64_t v = 0; v < V; ++v) {
      double value = static_cast<double>(static_cast<T>(value_constant));  // as a tensor of this dtype holds it
      if (wv != nullptr) {
        const T* __restrict__ wrow = wv + v * D;
        double sum = bv != nullptr ? static_cast<double>(bv[v]) : 0.0;
#pragma omp simd reduction(+ : sum)
        for (int64_t d = 0; d < D; ++d) sum += static_cast<double>(wrow[d]) * static_cast<double>(in[d]);
        value = sigmoid_value ? value_scale / (1.0 + std::exp(-sum)) : sum;
      }
      s[v] = r * beta * (value - r * hx[v]) + (additive ? 1.0 : 0.0);  // exactly 1 (additive) or 0 at beta == 0
    }
    T* __restrict__ on = out + n * D * V;  // X' = X + h s^T, in the state's dtype
    if (V == 1) {
      const T s0 = static_cast<T>(s[0]);
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) on[d] = xn[d] + s0 * hn[d];
    } else {
      for (int64_t d = 0; d < D; ++d)
        for (int64_t v = 0; v < V; ++v) on[d * V + v] = xn[d * V + v] + static_cast<T>(s[v]) * hn[d];
    }
    beta_out[n] = static_cast<T>(beta);
  }
}

bool on_cpu_as(const at::Tensor& t, at::ScalarType dtype) { return t.device().is_cpu() && t.scalar_type() == dtype; }
bool on_cpu_as(const c10::optional<at::Tensor>& t, at::ScalarType dtype) { return !t || on_cpu_as(*t, dtype); }

// (new state, beta [...]), or None where the kernel does not take these tensors (not all on the CPU in the state's
// float32 / float64 dtype); the caller then runs the tensor ops. state [..., D] or [..., D, d_v], c, h and x [..., D];
// the gate weight [1, D], the value weight [d_v, D] (None: the constant value); value_scale None: a linear value.
py::object residual_step(const at::Tensor& state_in, const at::Tensor& c_in, const at::Tensor& h_in,
                         const at::Tensor& x_in, const at::Tensor& gate_weight,
                         const c10::optional<at::Tensor>& gate_bias, const at::Tensor& beta_open,
                         const c10::optional<at::Tensor>& value_weight, const c10::optional<at::Tensor>& value_bias,
                         c10::optional<double> value_scale, double value_constant, double eps, bool additive,
                         bool erase) {
  const auto dtype = state_in.scalar_type();
  if ((dtype != at::kFloat && dtype != at::kDouble) || !on_cpu_as(state_in, dtype) || !on_cpu_as(c_in, dtype) ||
      !on_cpu_as(h_in, dtype) || !on_cpu_as(x_in, dtype) || !on_cpu_as(gate_weight, dtype) ||
      !on_cpu_as(gate_bias, dtype) || !on_cpu_as(beta_open, dtype) || !on_cpu_as(value_weight, dtype) ||
      !on_cpu_as(value_bias, dtype))
    return py::none();
  const int64_t D = h_in.size(-1), N = h_in.numel() / D, V = N > 0 ? state_in.numel() / (N * D) : 1;
  TORCH_CHECK(state_in.numel() == N * D * V && c_in.numel() == N * D && x_in.numel() == N * D,
              "residual_step: the state must be [..., D] or [..., D, d_v] and c, h and x [..., D]");
  TORCH_CHECK(gate_weight.numel() == D && beta_open.numel() == 1 && (!gate_bias || gate_bias->numel() == 1),
              "residual_step: the gate must be a D -> 1 linear layer and beta_open one number");
  TORCH_CHECK(!value_weight || (value_weight->numel() == D * V && (!value_bias || value_bias->numel() == V)),
              "residual_step: the value must be a D -> d_v linear layer");
  TORCH_CHECK(value_weight || !value_scale, "residual_step: a sigmoid value needs its weight");
  const at::Tensor X = state_in.contiguous(), c = c_in.contiguous(), h = h_in.contiguous(), x = x_in.contiguous();
  const at::Tensor wg = gate_weight.contiguous();
  const c10::optional<at::Tensor> wv = value_weight ? c10::optional<at::Tensor>(value_weight->contiguous())
                                                    : c10::nullopt;
  const double scale = value_scale ? *value_scale : 0.0;
  at::Tensor out = at::empty(state_in.sizes(), X.options());
  at::Tensor beta = at::empty(h_in.sizes().slice(0, h_in.dim() - 1), X.options());
  AT_DISPATCH_FLOATING_TYPES(dtype, "residual_step", [&] {
    const double bg = gate_bias ? static_cast<double>(gate_bias->data_ptr<scalar_t>()[0]) : 0.0;
    const double rho = std::min(std::max(static_cast<double>(beta_open.data_ptr<scalar_t>()[0]), 0.0), 1.0);
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      step_rows<scalar_t>(X.data_ptr<scalar_t>(), c.data_ptr<scalar_t>(), h.data_ptr<scalar_t>(),
                          x.data_ptr<scalar_t>(), wg.data_ptr<scalar_t>(), bg, rho,
                          wv ? wv->data_ptr<scalar_t>() : nullptr,
                          value_bias ? value_bias->data_ptr<scalar_t>() : nullptr, value_scale.has_value(), scale,
                          value_constant, eps,
                          additive, erase, D, V, begin, end, out.data_ptr<scalar_t>(), beta.data_ptr<scalar_t>());
    });
  });
  return py::make_tuple(out, beta);
}

// ---- a whole Delta residual, with autograd (delta_implementation="native") -----------------------------------------
//
// The same math as triton_delta's _forward_kernel / _backward_kernel (their reference: DeltaResidual's tensor ops),
// per token n: g = w_g . c + b_g, beta = 2 sigmoid(g) clamp(rho, 0, 1); the value v = W_v u + b_v (u = c), or
// scale sigmoid(W_v x + b_v) (u = the read x), or a constant; r = 1 / sqrt(|h|^2 + eps^2); s = r beta (v - r h^T X)
// (+ 1 additive; no h^T X without erase); X' = X + h s^T. The backward recomputes everything from the inputs and
// writes dX, dh, dc (dx for the sigmoid value) and the weights' gradients, summed over blocks of tokens in a fixed
// order (deterministic). Each tensor is read and written in its own dtype (autocast hands a float32 state beside a
// bf16 h and a float32 c), sums run in A (float; double with a double state). Per call a handful of allocations and
// no other ATen op: at the sizes where the host's time is what a step costs, that is the point of one op.

constexpr int64_t kResidualBlock = 32;  // tokens per block of weight-gradient sums
enum ValueMode { kLinear = 0, kSigmoid = 1, kConstant = 2 };

struct Residual {
  int64_t tokens, dim, channels;
  int mode;
  double value_scale, value_constant, eps;
  bool additive, erase;
};

template <typename A>
A logistic(A x) {
  return x >= 0 ? A(1) / (A(1) + std::exp(-x)) : std::exp(x) / (A(1) + std::exp(x));
}

// The weights in A: the model's parameters (float32, or double), converted only where they are another dtype.
template <typename A>
struct Weights {
  std::vector<A> gw, vw, vb;
  A gb, rho;
};

template <typename A>
std::vector<A> values_of(const at::Tensor& t) {
  constexpr at::ScalarType dtype = c10::CppTypeToScalarType<A>::value;
  const at::Tensor c = t.scalar_type() == dtype && t.is_contiguous() ? t : t.to(dtype).contiguous();  // no ATen call
  const A* data = c.data_ptr<A>();                                                                     // in the usual
  return std::vector<A>(data, data + c.numel());                                                       // case
}

// `values` (n sums in A) into a new tensor shaped and typed like `param` (its gradient).
template <typename A>
at::Tensor gradient_like(const at::Tensor& param, const A* values) {
  constexpr at::ScalarType dtype = c10::CppTypeToScalarType<A>::value;
  at::Tensor grad = at::empty(param.sizes(), param.options().dtype(dtype));
  std::copy(values, values + param.numel(), grad.data_ptr<A>());
  return param.scalar_type() == dtype ? grad : grad.to(param.scalar_type());
}

template <typename A>
Weights<A> weights_of(const at::Tensor& gate_weight, const at::Tensor& gate_bias, const at::Tensor& beta_open,
                      const c10::optional<at::Tensor>& value_weight, const c10::optional<at::Tensor>& value_bias) {
  Weights<A> w;
  w.gw = values_of<A>(gate_weight);
  w.gb = values_of<A>(gate_bias)[0];
  w.rho = values_of<A>(beta_open)[0];
  if (value_weight) {
    w.vw = values_of<A>(*value_weight);
    w.vb = values_of<A>(*value_bias);
  }
  return w;
}

// Per token: the gate's pre-activation (no bias), |h|^2, h^T X, W_v u, and with G h^T G.
template <typename S, typename H, typename C, typename A>
void token_sums(const S* xn, const C* un, const C* cn, const H* hn, const Weights<A>& w, const S* gn,
                const Residual& p, A& g, A& hh, A* hx, A* z, A* hg) {
  const int64_t D = p.dim, V = p.channels;
  g = 0;
  hh = 0;
  for (int64_t v = 0; v < V; ++v) hx[v] = z[v] = hg[v] = 0;
  for (int64_t d = 0; d < D; ++d) {
    const A hd = static_cast<A>(hn[d]);
    g += w.gw[d] * static_cast<A>(cn[d]);
    hh += hd * hd;
    const A ud = p.mode != kConstant ? static_cast<A>(un[d]) : A(0);
    for (int64_t v = 0; v < V; ++v) {
      if (p.erase) hx[v] += hd * static_cast<A>(xn[d * V + v]);
      if (gn != nullptr) hg[v] += hd * static_cast<A>(gn[d * V + v]);
      if (p.mode != kConstant) z[v] += w.vw[v * D + d] * ud;
    }
  }
}

template <typename S, typename H, typename C, typename A>
void residual_forward_rows(const S* X, const C* xr, const C* c, const H* h, const Weights<A>& w, const Residual& p,
                           int64_t begin, int64_t end, S* out, A* beta_out) {
  const int64_t D = p.dim, V = p.channels;
  std::vector<A> hx(V), z(V), hg(V), s(V);
  const A open = std::min(std::max(w.rho, A(0)), A(1));
  for (int64_t n = begin; n < end; ++n) {
    const S* xn = X + n * D * V;
    const C* cn = c + n * D;
    const C* un = p.mode == kSigmoid ? xr + n * D : cn;
    const H* hn = h + n * D;
    A g, hh;
    token_sums<S, H, C, A>(xn, un, cn, hn, w, nullptr, p, g, hh, hx.data(), z.data(), hg.data());
    const A beta = A(2) * logistic(g + w.gb) * open;
    const A r = A(1) / std::sqrt(hh + static_cast<A>(p.eps * p.eps));
    for (int64_t v = 0; v < V; ++v) {
      A value = static_cast<A>(p.value_constant);
      if (p.mode != kConstant) value = z[v] + w.vb[v];
      if (p.mode == kSigmoid) value = static_cast<A>(p.value_scale) * logistic(value);
      const A coefficient = p.erase ? value - r * hx[v] : value;
      s[v] = p.additive ? r * beta * coefficient + A(1) : r * beta * coefficient;  // exactly 1 at beta = 0
    }
    S* on = out + n * D * V;
    for (int64_t d = 0; d < D; ++d) {
      const A hd = static_cast<A>(hn[d]);
      for (int64_t v = 0; v < V; ++v) on[d * V + v] = static_cast<S>(static_cast<A>(xn[d * V + v]) + hd * s[v]);
    }
    beta_out[n] = beta;
  }
}

// One block of tokens; `sums` (this block's own, zeroed): [dw_g (D) | db_g | drho | dW_v (V x D) | db_v (V)].
template <typename S, typename H, typename C, typename A>
void residual_backward_rows(const S* X, const C* xr, const C* c, const H* h, const Weights<A>& w, const S* G,
                            const A* gbeta, const Residual& p, int64_t begin, int64_t end, S* dX, C* dxr, C* dc,
                            H* dh, A* sums) {
  const int64_t D = p.dim, V = p.channels;
  std::vector<A> hx(V), z(V), hg(V), scale(V), erase_coef(V), dz(V);
  const A open = std::min(std::max(w.rho, A(0)), A(1));
  A* d_gw = sums;
  A* d_vw = sums + D + 2;
  A* d_vb = d_vw + V * D;
  for (int64_t n = begin; n < end; ++n) {
    const S* xn = p.erase ? X + n * D * V : nullptr;
    const S* gn = G + n * D * V;
    const C* cn = c + n * D;
    const C* un = p.mode == kSigmoid ? xr + n * D : cn;
    const H* hn = h + n * D;
    A g, hh;
    token_sums<S, H, C, A>(xn, un, cn, hn, w, gn, p, g, hh, hx.data(), z.data(), hg.data());
    const A sigma = logistic(g + w.gb);
    const A beta = A(2) * sigma * open;
    const A r = A(1) / std::sqrt(hh + static_cast<A>(p.eps * p.eps));
    A h_dot_dk = 0, d_beta = gbeta != nullptr ? gbeta[n] : A(0);
    for (int64_t v = 0; v < V; ++v) {
      A value = static_cast<A>(p.value_constant), sigma_v = 0;
      if (p.mode != kConstant) value = z[v] + w.vb[v];
      if (p.mode == kSigmoid) {
        sigma_v = logistic(value);
        value = static_cast<A>(p.value_scale) * sigma_v;
      }
      const A residual = p.erase ? value - r * hx[v] : value;  // v - k^T X
      const A b_kg = beta * r * hg[v];                          // beta k^T G = dL/dv
      const A coef = beta * residual;
      scale[v] = p.additive ? r * coef + A(1) : r * coef;
      h_dot_dk += p.erase ? hg[v] * coef - hx[v] * b_kg : hg[v] * coef;
      d_beta += r * hg[v] * residual;
      dz[v] = p.mode == kSigmoid ? b_kg * static_cast<A>(p.value_scale) * sigma_v * (A(1) - sigma_v) : b_kg;
      erase_coef[v] = -r * b_kg;  // the erase term's weight on X in dh and on h in dX
    }
    const A cube = r * r * r * h_dot_dk;
    const A d_logit = d_beta * A(2) * open * sigma * (A(1) - sigma);
    sums[D] += d_logit;
    sums[D + 1] += d_beta * A(2) * sigma;  // straight through the clamp, as the tensor ops' rho
    S* dxn = dX + n * D * V;
    for (int64_t d = 0; d < D; ++d) {
      const A hd = static_cast<A>(hn[d]);
      const A ud = p.mode != kConstant ? static_cast<A>(un[d]) : A(0);
      A d_h = -hd * cube, d_u = 0;
      for (int64_t v = 0; v < V; ++v) {
        const A grad = static_cast<A>(gn[d * V + v]);
        d_h += grad * scale[v];
        A d_x = grad;
        if (p.erase) {
          d_h += static_cast<A>(xn[d * V + v]) * erase_coef[v];
          d_x += hd * erase_coef[v];
        }
        dxn[d * V + v] = static_cast<S>(d_x);
        if (p.mode != kConstant) {
          d_u += dz[v] * w.vw[v * D + d];
          d_vw[v * D + d] += dz[v] * ud;
        }
      }
      dh[n * D + d] = static_cast<H>(d_h);
      d_gw[d] += d_logit * static_cast<A>(cn[d]);
      dc[n * D + d] = static_cast<C>(d_logit * w.gw[d] + (p.mode == kLinear ? d_u : A(0)));
      if (dxr != nullptr) dxr[n * D + d] = static_cast<C>(d_u);
    }
    if (p.mode != kConstant)
      for (int64_t v = 0; v < V; ++v) d_vb[v] += dz[v];
  }
}

Residual residual_of(const at::Tensor& state, const c10::optional<at::Tensor>& read, const at::Tensor& c,
                     const at::Tensor& h, const at::Tensor& gate_weight, const at::Tensor& gate_bias,
                     const at::Tensor& beta_open, const c10::optional<at::Tensor>& value_weight,
                     const c10::optional<at::Tensor>& value_bias, int64_t mode, double value_scale,
                     double value_constant, double eps, bool additive, bool erase) {
  const int64_t D = h.size(-1), N = D > 0 ? h.numel() / D : 0, V = state.dim() == h.dim() ? 1 : state.size(-1);
  TORCH_CHECK(state.numel() == N * D * V && c.numel() == N * D, "residual: state [..., D(, d_v)], c and h [..., D]");
  TORCH_CHECK(mode != kSigmoid || (read && read->numel() == N * D), "residual: the sigmoid value reads x [..., D]");
  TORCH_CHECK(mode == kConstant || (value_weight && value_weight->numel() == V * D && value_bias &&
                                    value_bias->numel() == V),
              "residual: the value must be a D -> d_v linear layer");
  TORCH_CHECK(gate_weight.numel() == D && gate_bias.numel() == 1 && beta_open.numel() == 1,
              "residual: the gate must be a D -> 1 linear layer and beta_open one number");
  return {N, D, V, static_cast<int>(mode), value_scale, value_constant, eps, additive, erase};
}

// The x read by the sigmoid value, in c's dtype (they agree under autocast and without it; converted otherwise).
at::Tensor read_like(const c10::optional<at::Tensor>& read, const at::Tensor& c) {
  if (!read) return at::Tensor();
  return read->scalar_type() == c.scalar_type() ? read->contiguous() : read->to(c.scalar_type()).contiguous();
}

// Calls body(S{}, H{}, C{}) for the dtypes of the state, h and c: float / double states, h and c in float, double,
// bf16 or fp16 (with a double state: double only).
template <typename Body>
void with_dtypes(at::ScalarType state, at::ScalarType h, at::ScalarType c, Body body) {
  auto with_c = [&](auto s, auto hh) {
    switch (c) {
      case at::kFloat: return body(s, hh, float{});
      case at::kBFloat16: return body(s, hh, at::BFloat16{});
      case at::kHalf: return body(s, hh, at::Half{});
      default: TORCH_CHECK(false, "residual: c must be float32, bf16 or fp16 beside a float32 state");
    }
  };
  if (state == at::kDouble) {
    TORCH_CHECK(h == at::kDouble && c == at::kDouble, "residual: a float64 state takes float64 h and c");
    return body(double{}, double{}, double{});
  }
  TORCH_CHECK(state == at::kFloat, "residual: the state must be float32 or float64");
  switch (h) {
    case at::kFloat: return with_c(float{}, float{});
    case at::kBFloat16: return with_c(float{}, at::BFloat16{});
    case at::kHalf: return with_c(float{}, at::Half{});
    default: TORCH_CHECK(false, "residual: h must be float32, bf16 or fp16 beside a float32 state");
  }
}

std::vector<at::Tensor> residual_forward(const at::Tensor& state_in, const c10::optional<at::Tensor>& read_in,
                                         const at::Tensor& c_in, const at::Tensor& h_in,
                                         const at::Tensor& gate_weight, const at::Tensor& gate_bias,
                                         const at::Tensor& beta_open, const c10::optional<at::Tensor>& value_weight,
                                         const c10::optional<at::Tensor>& value_bias, int64_t mode,
                                         double value_scale, double value_constant, double eps, bool additive,
                                         bool erase) {
  const Residual p = residual_of(state_in, read_in, c_in, h_in, gate_weight, gate_bias, beta_open, value_weight,
                                 value_bias, mode, value_scale, value_constant, eps, additive, erase);
  const at::Tensor X = state_in.contiguous(), c = c_in.contiguous(), h = h_in.contiguous(), xr = read_like(read_in, c);
  at::Tensor out = at::empty(state_in.sizes(), X.options());
  at::Tensor beta = at::empty(h_in.sizes().slice(0, h_in.dim() - 1), X.options());
  with_dtypes(X.scalar_type(), h.scalar_type(), c.scalar_type(), [&](auto s, auto hh, auto cc) {
    using S = decltype(s);
    using H = decltype(hh);
    using C = decltype(cc);
    using A = S;  // float or double
    const Weights<A> w = weights_of<A>(gate_weight, gate_bias, beta_open, value_weight, value_bias);
    at::parallel_for(0, p.tokens, 16, [&](int64_t begin, int64_t end) {
      residual_forward_rows<S, H, C, A>(X.data_ptr<S>(), xr.defined() ? xr.data_ptr<C>() : nullptr,
                                        c.data_ptr<C>(), h.data_ptr<H>(), w, p, begin, end, out.data_ptr<S>(),
                                        beta.data_ptr<A>());
    });
  });
  return {out, beta};
}

// (dX, dx (the sigmoid value's read; undefined otherwise), dc, dh, d gate weight, d gate bias, d beta_open,
// d value weight, d value bias (undefined for the constant value)), each in its tensor's dtype and shape.
std::vector<at::Tensor> residual_backward(const at::Tensor& grad_state, const c10::optional<at::Tensor>& grad_beta,
                                          const c10::optional<at::Tensor>& state_in,
                                          const c10::optional<at::Tensor>& read_in, const at::Tensor& c_in,
                                          const at::Tensor& h_in, const at::Tensor& gate_weight,
                                          const at::Tensor& gate_bias, const at::Tensor& beta_open,
                                          const c10::optional<at::Tensor>& value_weight,
                                          const c10::optional<at::Tensor>& value_bias, int64_t mode,
                                          double value_scale, double value_constant, double eps, bool additive,
                                          bool erase) {
  TORCH_CHECK(!erase || state_in.has_value(), "residual_backward: erase reads the state");
  const at::Tensor& shape_of = erase ? *state_in : grad_state;  // without erase X is never read
  const Residual p = residual_of(shape_of, read_in, c_in, h_in, gate_weight, gate_bias, beta_open, value_weight,
                                 value_bias, mode, value_scale, value_constant, eps, additive, erase);
  const at::ScalarType state_dtype = shape_of.scalar_type();
  const at::Tensor G = grad_state.scalar_type() == state_dtype ? grad_state.contiguous()
                                                               : grad_state.to(state_dtype).contiguous();
  const at::Tensor X = erase ? state_in->contiguous() : G;
  const at::Tensor c = c_in.contiguous(), h = h_in.contiguous(), xr = read_like(read_in, c);
  const at::ScalarType acc = state_dtype == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor gbeta = !grad_beta ? at::Tensor()
                           : grad_beta->scalar_type() == acc ? grad_beta->contiguous()
                                                            : grad_beta->to(acc).contiguous();
  at::Tensor dX = at::empty(grad_state.sizes(), G.options());
  at::Tensor dc = at::empty(c_in.sizes(), c.options()), dh = at::empty(h_in.sizes(), h.options());
  at::Tensor dxr = xr.defined() ? at::empty(read_in->sizes(), xr.options()) : at::Tensor();
  const int64_t D = p.dim, V = p.channels, width = D + 2 + (mode == kConstant ? 0 : V * (D + 1));
  at::Tensor d_gw, d_gb, d_rho, d_vw, d_vb;
  with_dtypes(state_dtype, h.scalar_type(), c.scalar_type(), [&](auto s, auto hh, auto cc) {
    using S = decltype(s);
    using H = decltype(hh);
    using C = decltype(cc);
    using A = S;
    const Weights<A> w = weights_of<A>(gate_weight, gate_bias, beta_open, value_weight, value_bias);
    const int64_t blocks = (p.tokens + kResidualBlock - 1) / kResidualBlock;
    std::vector<A> partial(std::max<int64_t>(blocks, 1) * width, A(0));
    at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
      for (int64_t b = first; b < last; ++b) {
        const int64_t begin = b * kResidualBlock, end = std::min(begin + kResidualBlock, p.tokens);
        residual_backward_rows<S, H, C, A>(
            erase ? X.data_ptr<S>() : nullptr, xr.defined() ? xr.data_ptr<C>() : nullptr, c.data_ptr<C>(),
            h.data_ptr<H>(), w, G.data_ptr<S>(), gbeta.defined() ? gbeta.data_ptr<A>() : nullptr, p, begin, end,
            dX.data_ptr<S>(), dxr.defined() ? dxr.data_ptr<C>() : nullptr, dc.data_ptr<C>(), dh.data_ptr<H>(),
            partial.data() + b * width);
      }
    });
    std::vector<A> total(width, A(0));
    for (int64_t b = 0; b < blocks; ++b)  // in block order: the same sums whatever the threads
      for (int64_t i = 0; i < width; ++i) total[i] += partial[b * width + i];
    d_gw = gradient_like(gate_weight, total.data());
    d_gb = gradient_like(gate_bias, total.data() + D);
    d_rho = gradient_like(beta_open, total.data() + D + 1);
    if (mode != kConstant) {
      d_vw = gradient_like(*value_weight, total.data() + D + 2);
      d_vb = gradient_like(*value_bias, total.data() + D + 2 + V * D);
    }
  });
  return {dX, dxr.defined() && dxr.scalar_type() != read_in->scalar_type() ? dxr.to(read_in->scalar_type()) : dxr,
          dc, dh, d_gw, d_gb, d_rho, d_vw, d_vb};
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("delta_update_forward", &delta_update_forward, "The fused Delta update, forward (one pass over the state)");
  m.def("delta_update_backward", &delta_update_backward, "The fused Delta update, backward (one pass over the state)");
  m.def("tc_read_forward", &tc_read_forward, "TC read, forward (one pass over the state)");
  m.def("tc_read_backward", &tc_read_backward, "TC read, backward (one pass over the state)");
  m.def("residual_step", &residual_step, "A Delta residual's gate, value and update, inference (one call)");
  m.def("residual_forward", &residual_forward, "A whole Delta residual, forward (gate, value, write; one pass)");
  m.def("residual_backward", &residual_backward, "A whole Delta residual, backward (one pass, weight sums per block)");
}
