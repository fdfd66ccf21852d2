// The Delta residual update for one decoded token on the CPU, as one native call (ddl_hf.native); and, below, the
// TC read of a forward with a cache and without autograd (cached_tc_read: a prompt, then each decoded token) and the
// CC read of a forward without autograd (cc_read), also one call each.
//
// The same math as delta_ops.one_token_delta_update (and, with beta and v computed here, as
// DeltaResidual._update_one_token): the gate logit g = w_g . c + b_g, beta = 2 sigmoid(g) clamp(beta_open, 0, 1),
// v = W_v c + b_v (or scale sigmoid(W_v x + b_v) of the un-normalised read x, or a constant), r = 1 / sqrt(|h|^2 + eps^2), s = r beta (v - r h^T X) (+ 1 in additive mode),
// X' = X + h s^T. Decoding one token is all per-call overhead in Python (~14 tensor calls per Delta block); here it
// is one. Sums run in double precision; X' is formed in the tensor dtype, X + s h, so beta == 0 gives X + h
// (additive) or X (paper) bit for bit, as in the Python paths.
#include <ATen/autocast_mode.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

double logistic(double x) {
  if (x >= 0) return 1.0 / (1.0 + std::exp(-x));
  const double z = std::exp(x);
  return z / (1.0 + z);
}

// Sums in double precision; `omp simd` lets the compiler vectorise them (-fopenmp-simd: no OpenMP runtime).
template <typename T>
double dot(const T* __restrict__ a, const T* __restrict__ b, int64_t n) {
  double sum = 0.0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(a[i]) * static_cast<double>(b[i]);
  return sum;
}

template <typename T>
void update(const at::Tensor& state, const at::Tensor& c, const at::Tensor& h, const at::Tensor& gate_weight,
            const c10::optional<at::Tensor>& gate_bias, const c10::optional<at::Tensor>& value_weight,
            const c10::optional<at::Tensor>& value_bias, double rho, double value_constant, double eps, bool additive,
            bool erase, int64_t value_channels, const at::Tensor& value_input, double value_scale, at::Tensor& out,
            double& beta) {
  const int64_t d = h.numel(), dv = value_channels;
  const T* __restrict__ hp = h.data_ptr<T>();
  const T* __restrict__ cp = c.data_ptr<T>();
  const T* __restrict__ vip = value_input.data_ptr<T>();  // c, or the read for the sigmoid value
  const T* __restrict__ xp = state.data_ptr<T>();  // [D] or [D, d_v] row-major
  T* __restrict__ op = out.data_ptr<T>();

  double g = dot(gate_weight.data_ptr<T>(), cp, d);
  if (gate_bias.has_value()) g += static_cast<double>(gate_bias->data_ptr<T>()[0]);
  beta = 2.0 * logistic(g) * rho;
  const double r = 1.0 / std::sqrt(dot(hp, hp, d) + eps * eps);
  const double rb = r * beta;

  // h^T X over the value channels (the erase term)
  std::vector<double> hx(dv, 0.0);
  if (erase) {
    if (dv == 1) {
      hx[0] = dot(hp, xp, d);
    } else {
      for (int64_t i = 0; i < d; ++i) {
        const double hi = static_cast<double>(hp[i]);
        for (int64_t j = 0; j < dv; ++j) hx[j] += hi * static_cast<double>(xp[i * dv + j]);
      }
    }
  }
  // s_j = r beta (v_j - r h^T X_j), + 1 in additive mode
  std::vector<T> s(dv);
  for (int64_t j = 0; j < dv; ++j) {
    double v = static_cast<double>(static_cast<T>(value_constant));  // the constant as the tensors hold it
    if (value_weight.has_value()) {
      v = dot(value_weight->data_ptr<T>() + j * d, vip, d);
      if (value_bias.has_value()) v += static_cast<double>(value_bias->data_ptr<T>()[j]);
      if (value_scale > 0.0) v = value_scale * logistic(v);
    }
    s[j] = static_cast<T>(rb * (v - r * hx[j]) + (additive ? 1.0 : 0.0));
  }
  // X' = X + h s^T
  if (dv == 1) {
    const T s0 = s[0];
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) op[i] = xp[i] + s0 * hp[i];
  } else {
    for (int64_t i = 0; i < d; ++i)
      for (int64_t j = 0; j < dv; ++j) op[i * dv + j] = xp[i * dv + j] + s[j] * hp[i];
  }
}

bool same_dtype_on_cpu(const at::Tensor& t, at::ScalarType dtype) {
  return t.scalar_type() == dtype && t.device().is_cpu();
}

bool same_dtype_on_cpu(const c10::optional<at::Tensor>& t, at::ScalarType dtype) {
  return !t.has_value() || same_dtype_on_cpu(*t, dtype);
}

// (new state, beta), or None where the one-token update does not apply and the caller keeps the tensor path. This
// is the input-dependent half of DeltaResidual._updates_one_token_on_host (autograd or CPU autocast on, more than
// one row, not every tensor on the CPU in the state's float32 / float64 dtype), for less than Python's cost of it.
py::object one_token_delta_update(const at::Tensor& state, const at::Tensor& c, const at::Tensor& h,
                                  const at::Tensor& gate_weight, const c10::optional<at::Tensor>& gate_bias,
                                  const c10::optional<at::Tensor>& value_weight,
                                  const c10::optional<at::Tensor>& value_bias, const at::Tensor& beta_open,
                                  double value_constant, double eps, bool additive, bool erase,
                                  const at::Tensor& value_input, double value_scale) {
  const auto dtype = state.scalar_type();
  const bool applies = !at::GradMode::is_enabled() && !at::autocast::is_autocast_enabled(at::kCPU) && h.dim() > 0 &&
                       h.numel() == h.size(-1) && (dtype == at::kFloat || dtype == at::kDouble) &&
                       same_dtype_on_cpu(state, dtype) && same_dtype_on_cpu(c, dtype) && same_dtype_on_cpu(h, dtype) &&
                       same_dtype_on_cpu(value_input, dtype) &&
                       same_dtype_on_cpu(gate_weight, dtype) && same_dtype_on_cpu(gate_bias, dtype) &&
                       same_dtype_on_cpu(value_weight, dtype) && same_dtype_on_cpu(value_bias, dtype) &&
                       same_dtype_on_cpu(beta_open, dtype);
  if (!applies) return py::none();
  const int64_t d = h.numel();
  const int64_t value_channels = state.numel() / d;
  TORCH_CHECK(state.numel() == d * value_channels && c.numel() == d && value_input.numel() == d,
              "state / input sizes do not match h");
  TORCH_CHECK(gate_weight.numel() == d, "the gate must be a D -> 1 linear layer");
  TORCH_CHECK(!value_weight.has_value() || value_weight->numel() == d * value_channels,
              "the value projection must be a D -> d_v linear layer");
  TORCH_CHECK(beta_open.numel() == 1, "beta_open must be one number");
  const at::Tensor x = state.contiguous();  // also materialises the first layer's expand view (stride 0)
  const auto cc = c.contiguous(), hc = h.contiguous(), gw = gate_weight.contiguous(), vi = value_input.contiguous();
  const c10::optional<at::Tensor> vw =
      value_weight.has_value() ? c10::optional<at::Tensor>(value_weight->contiguous()) : c10::nullopt;
  at::Tensor out = at::empty(state.sizes(), state.options());
  at::Tensor beta_out = at::empty(h.sizes().slice(0, h.dim() - 1), state.options());  // [1, 1]: the token's beta
  double beta = 0.0;
  if (dtype == at::kFloat) {
    const double rho = std::min(std::max(static_cast<double>(*beta_open.data_ptr<float>()), 0.0), 1.0);
    update<float>(x, cc, hc, gw, gate_bias, vw, value_bias, rho, value_constant, eps, additive, erase,
                  value_channels, vi, value_scale, out, beta);
    *beta_out.data_ptr<float>() = static_cast<float>(beta);
  } else {
    const double rho = std::min(std::max(*beta_open.data_ptr<double>(), 0.0), 1.0);
    update<double>(x, cc, hc, gw, gate_bias, vw, value_bias, rho, value_constant, eps, additive, erase,
                   value_channels, vi, value_scale, out, beta);
    *beta_out.data_ptr<double>() = beta;
  }
  return py::make_tuple(out, beta_out);
}

// The TC read (DeltaStateConv, `delta_state_read="temporal_conv"`) of a forward with a cache and without autograd
// (a prompt, then each decoded token): the new window is the last K - 1 cached inputs, then the T inputs x (times
// their token mask, 0 for padding), and the read of token t is out[b, t, d] = sum_c r_c sum_j window[b, t + j, d, c]
// W[d, c, j] (r = 1 at d_v = 1, where the read is the convolution itself), over the taps j that stay in t's document
// in packed rows (same_document [B, T, K]). The same math as
// DeltaConvContext.convolve_read (which folds r into W first), in one call and one pass instead of ~10 tensor calls;
// sums in double precision.
template <typename T>
void cached_read(const T* __restrict__ past, int64_t past_rows, const T* __restrict__ x, const double* mask,
                 const bool* same_document, const T* __restrict__ weight, const T* __restrict__ read, int64_t batch,
                 int64_t steps, int64_t d, int64_t dv, int64_t size, T* __restrict__ window, T* __restrict__ out) {
  const int64_t entries = d * dv, rows = size - 1 + steps;
  for (int64_t b = 0; b < batch; ++b) {
    T* __restrict__ win = window + b * rows * entries;
    if (past == nullptr) {
      std::fill(win, win + (size - 1) * entries, T(0));
    } else {
      const T* last = past + (b * past_rows + past_rows - (size - 1)) * entries;
      std::copy(last, last + (size - 1) * entries, win);
    }
    for (int64_t t = 0; t < steps; ++t) {
      T* __restrict__ token = win + (size - 1 + t) * entries;
      const T* __restrict__ xt = x + (b * steps + t) * entries;
      if (mask == nullptr) {
        std::copy(xt, xt + entries, token);
      } else {
        const T m = static_cast<T>(mask[b * steps + t]);
#pragma omp simd
        for (int64_t e = 0; e < entries; ++e) token[e] = xt[e] * m;
      }
    }
    for (int64_t t = 0; t < steps; ++t) {
      const T* __restrict__ taps = win + t * entries;
      const bool* keep = same_document == nullptr ? nullptr : same_document + (b * steps + t) * size;
      T* __restrict__ ot = out + (b * steps + t) * d;
      for (int64_t i = 0; i < d; ++i) {
        double sum = 0.0;
        for (int64_t c = 0; c < dv; ++c) {
          const int64_t e = i * dv + c;
          const T* __restrict__ w = weight + e * size;
          double tap_sum = 0.0;
          for (int64_t j = 0; j < size; ++j)
            if (keep == nullptr || keep[j])
              tap_sum += static_cast<double>(taps[j * entries + e]) * static_cast<double>(w[j]);
          sum += read == nullptr ? tap_sum : static_cast<double>(read[c]) * tap_sum;
        }
        ot[i] = static_cast<T>(sum);
      }
    }
  }
}

// (read [B, T, D], new window [B, K - 1 + T, D(, d_v)]), or None where the tensor path keeps it: autograd or CPU
// autocast on, not every tensor on the CPU in x's float32 / float64 dtype. x `[B, T, D, d_v]` (or `[B, T, D]` at
// d_v = 1), past `[B, P >= K - 1, ...]` or None (zeros), weight `[D, d_v, K]`, read `[d_v]` or None, token_mask
// `[B, >= T]` or None (its last T columns are x's), same_document bool `[B, T, K]` or None (see delta_ops.temporal_conv).
py::object cached_tc_read(const at::Tensor& x, const c10::optional<at::Tensor>& past, const at::Tensor& weight,
                          const c10::optional<at::Tensor>& read, const c10::optional<at::Tensor>& token_mask,
                          const c10::optional<at::Tensor>& same_document) {
  const auto dtype = x.scalar_type();
  const bool applies = !at::GradMode::is_enabled() && !at::autocast::is_autocast_enabled(at::kCPU) &&
                       (x.dim() == 3 || x.dim() == 4) && (dtype == at::kFloat || dtype == at::kDouble) &&
                       same_dtype_on_cpu(x, dtype) && same_dtype_on_cpu(past, dtype) &&
                       same_dtype_on_cpu(weight, dtype) && same_dtype_on_cpu(read, dtype) &&
                       (!token_mask.has_value() || token_mask->device().is_cpu()) &&
                       (!same_document.has_value() || same_document->device().is_cpu());
  if (!applies) return py::none();
  const int64_t batch = x.size(0), steps = x.size(1), d = x.size(2), dv = x.dim() == 4 ? x.size(3) : 1;
  TORCH_CHECK(weight.dim() == 3 && weight.size(0) == d && weight.size(1) == dv,
              "the TC weight must be [D, d_v, K] with the state's D and d_v");
  const int64_t size = weight.size(2);
  TORCH_CHECK(size >= 1, "the TC weight needs at least one tap");
  TORCH_CHECK(read.has_value() == (x.dim() == 4) && (!read.has_value() || read->numel() == dv),
              "a [B, T, D, d_v] state needs a read vector of d_v entries, a [B, T, D] state none");
  TORCH_CHECK(!past.has_value() || (past->dim() == x.dim() && past->size(0) == batch && past->size(1) >= size - 1 &&
                                    past->numel() == batch * past->size(1) * d * dv),
              "the cached window must be [B, >= K - 1, D(, d_v)] like the state");
  TORCH_CHECK(!token_mask.has_value() ||
                  (token_mask->dim() == 2 && token_mask->size(0) == batch && token_mask->size(1) >= steps),
              "the token mask must be [B, >= T]");
  TORCH_CHECK(!same_document.has_value() ||
                  (same_document->scalar_type() == at::kBool && same_document->dim() == 3 &&
                   same_document->size(0) == batch && same_document->size(1) == steps && same_document->size(2) == size),
              "same_document must be bool [B, T, K]");
  const at::Tensor sc = same_document.has_value() ? same_document->contiguous() : at::Tensor();
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const at::Tensor pc = past.has_value() ? past->contiguous() : at::Tensor();
  const at::Tensor rc = read.has_value() ? read->contiguous() : at::Tensor();
  // x's mask columns, as doubles (the Python path multiplies x by them in x's dtype): read in place, no tensor call
  std::vector<double> mask;
  if (token_mask.has_value()) {
    const at::Tensor& tm = *token_mask;
    const int64_t first = tm.size(1) - steps;
    mask.resize(batch * steps);
    AT_DISPATCH_ALL_TYPES_AND3(at::kBool, at::kHalf, at::kBFloat16, tm.scalar_type(), "cached_tc_read", [&] {
      const scalar_t* m = tm.const_data_ptr<scalar_t>();
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t t = 0; t < steps; ++t)
          mask[b * steps + t] = static_cast<double>(m[b * tm.stride(0) + (first + t) * tm.stride(1)]);
    });
  }
  std::vector<int64_t> window_shape{batch, size - 1 + steps, d};
  if (x.dim() == 4) window_shape.push_back(dv);
  at::Tensor window = at::empty(window_shape, x.options());
  at::Tensor out = at::empty({batch, steps, d}, x.options());
  const int64_t past_rows = pc.defined() ? pc.size(1) : 0;
  const double* mp = mask.empty() ? nullptr : mask.data();
  AT_DISPATCH_FLOATING_TYPES(dtype, "cached_tc_read", [&] {
    cached_read<scalar_t>(pc.defined() ? pc.const_data_ptr<scalar_t>() : nullptr, past_rows,
                          xc.const_data_ptr<scalar_t>(), mp, sc.defined() ? sc.const_data_ptr<bool>() : nullptr,
                          wc.const_data_ptr<scalar_t>(),
                          rc.defined() ? rc.const_data_ptr<scalar_t>() : nullptr, batch, steps, d, dv, size,
                          window.mutable_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>());
  });
  return py::make_tuple(out, window);
}

// The CC read (DeltaStateConv, `delta_state_read="channel_conv"`) of a forward without autograd: the convolution
// across the value channels folded into the read vector, w[d, c] = sum_j W[d, j] r[c + p - j] (zero outside
// [0, d_v), p = (K - 1) / 2), then out[n, d] = sum_c x[n, d, c] w[d, c]. The same math as
// delta_ops.channel_conv_read_weight and the multiply-sum after it, in one call instead of ~10 tensor calls; sums
// in double precision. (read [..., D]), or None where the tensor path keeps it (autograd or CPU autocast on, not
// every tensor on the CPU in x's float32 / float64 dtype).
py::object cc_read(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& read) {
  const auto dtype = x.scalar_type();
  const bool applies = !at::GradMode::is_enabled() && !at::autocast::is_autocast_enabled(at::kCPU) && x.dim() >= 2 &&
                       (dtype == at::kFloat || dtype == at::kDouble) && same_dtype_on_cpu(x, dtype) &&
                       same_dtype_on_cpu(weight, dtype) && same_dtype_on_cpu(read, dtype);
  if (!applies) return py::none();
  const int64_t d = x.size(-2), dv = x.size(-1);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == d && weight.size(1) >= 1 && weight.size(1) <= dv,
              "the CC weight must be [D, K] with the state's D and 1 <= K <= d_v");
  TORCH_CHECK(read.numel() == dv, "the read vector must have d_v entries");
  const int64_t size = weight.size(1), left = (size - 1) / 2, rows = x.numel() / (d * dv);
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous(), rc = read.contiguous();
  at::Tensor out = at::empty(x.sizes().slice(0, x.dim() - 1), x.options());
  AT_DISPATCH_FLOATING_TYPES(dtype, "cc_read", [&] {
    const scalar_t* w = wc.const_data_ptr<scalar_t>();
    const scalar_t* r = rc.const_data_ptr<scalar_t>();
    std::vector<double> folded(d * dv, 0.0);  // w[d, c]: each input channel collects the read weights it reaches
    for (int64_t i = 0; i < d; ++i)
      for (int64_t c = 0; c < dv; ++c)
        for (int64_t j = 0; j < size; ++j) {
          const int64_t o = c + left - j;  // the output channel that tap j of input channel c feeds
          if (o >= 0 && o < dv) folded[i * dv + c] += static_cast<double>(w[i * size + j]) * static_cast<double>(r[o]);
        }
    const scalar_t* xp = xc.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    for (int64_t n = 0; n < rows; ++n)
      for (int64_t i = 0; i < d; ++i) {
        const scalar_t* xi = xp + (n * d + i) * dv;
        double sum = 0.0;
        for (int64_t c = 0; c < dv; ++c) sum += static_cast<double>(xi[c]) * folded[i * dv + c];
        op[n * d + i] = static_cast<scalar_t>(sum);
      }
  });
  return py::cast(out);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("one_token_delta_update", &one_token_delta_update,
        "The Delta residual update for one decoded token: (new state, beta), or None where it does not apply.");
  m.def("cached_tc_read", &cached_tc_read,
        "The TC read of a forward with a cache and without autograd: (read, new window), or None where it does not "
        "apply.");
  m.def("cc_read", &cc_read, "The CC read of a forward without autograd, or None where it does not apply.");
}
