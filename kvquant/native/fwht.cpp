// The orthonormal fast Walsh-Hadamard transform of kvquant's rotations on the CPU (kvquant.native).
//
//     y = s_out * ((H_n (s_in * x)) / sqrt(n))      over the last dim, in blocks of n channels
//
// with the same butterflies, in the same order, as the PyTorch path of kvquant.codecs.transforms.fwht:
// stage h = 1, 2, 4, ... pairs channels (i, i + h) within each run of 2h and writes (a + b, a - b). Rows go
// 16 at a time into a small channel-major buffer for all log2(n) stages, each butterfly a vector over the
// rows (the PyTorch path makes a pass over memory per stage).
// Every butterfly is one IEEE add or subtract, the signs are +-1 (exact), and the scale is the float
// 1/sqrt(n) applied once at the end, so the bits equal the PyTorch path's (tests/test_native.py checks it).
//
// Layouts: x (N, D) contiguous fp32 or fp64; s_in, s_out (D,) of x's dtype, or empty (no signs).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t L = 16;  // rows transformed together: each butterfly is a vector over them

// All log2(n) stages of every block of n channels of up to L rows held channel-major, t[c * L + l] (channel c
// of row l): the pair (i, i + h) of all L rows is one vector add and one vector subtract.
template <typename T>
inline void butterflies(T* __restrict t, int64_t d, int64_t n) {
  for (int64_t h = 1; h < n; h *= 2) {
    for (int64_t i = 0; i < d; i += 2 * h) {
      for (int64_t j = i; j < i + h; ++j) {
        T* __restrict lo = t + j * L;
        T* __restrict hi = t + (j + h) * L;
#pragma omp simd
        for (int64_t l = 0; l < L; ++l) {
          const T a = lo[l], b = hi[l];
          lo[l] = a + b;
          hi[l] = a - b;
        }
      }
    }
  }
}

template <typename T>
void fwht_rows(const T* __restrict x, T* __restrict y, const T* s_in, const T* s_out, int64_t rows,
               int64_t d, int64_t n, T scale) {
  const int64_t tiles = (rows + L - 1) / L;
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    std::vector<T> buf(d * L, T(0));
    T* t = buf.data();
    for (int64_t tile = t0; tile < t1; ++tile) {
      const int64_t r0 = tile * L, m = std::min(L, rows - r0);  // a short last tile computes zeros beyond m
      for (int64_t l = 0; l < m; ++l) {
        const T* xr = x + (r0 + l) * d;
        for (int64_t c = 0; c < d; ++c) t[c * L + l] = s_in ? xr[c] * s_in[c] : xr[c];
      }
      butterflies(t, d, n);
      for (int64_t l = 0; l < m; ++l) {
        T* yr = y + (r0 + l) * d;
        for (int64_t c = 0; c < d; ++c) yr[c] = s_out ? (t[c * L + l] * scale) * s_out[c] : t[c * L + l] * scale;
      }
    }
  });
}

at::Tensor fwht(const at::Tensor& x, int64_t block, const at::Tensor& s_in, const at::Tensor& s_out) {
  TORCH_CHECK(x.device().is_cpu(), "x must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous (N, D) tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble, "x must be fp32 or fp64");
  const int64_t rows = x.size(0), d = x.size(1);
  TORCH_CHECK(block > 0 && (block & (block - 1)) == 0 && d % block == 0,
              "Walsh-Hadamard blocks of ", block, " do not tile ", d, " channels");
  for (const at::Tensor* s : {&s_in, &s_out}) {
    if (s->numel() == 0) continue;
    TORCH_CHECK(s->scalar_type() == x.scalar_type() && s->dim() == 1 && s->size(0) == d && s->is_contiguous(),
                "signs must be a contiguous (D,) tensor of x's dtype");
  }
  at::Tensor y = at::empty({rows, d}, x.options());
  if (x.scalar_type() == at::kFloat) {
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(block)));
    fwht_rows<float>(x.data_ptr<float>(), y.data_ptr<float>(),
                     s_in.numel() ? s_in.data_ptr<float>() : nullptr,
                     s_out.numel() ? s_out.data_ptr<float>() : nullptr, rows, d, block, scale);
  } else {
    const double scale = 1.0 / std::sqrt(static_cast<double>(block));
    fwht_rows<double>(x.data_ptr<double>(), y.data_ptr<double>(),
                      s_in.numel() ? s_in.data_ptr<double>() : nullptr,
                      s_out.numel() ? s_out.data_ptr<double>() : nullptr, rows, d, block, scale);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvquant_native, m) {
  m.def("fwht(Tensor x, int block, Tensor s_in, Tensor s_out) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvquant_native, CPU, m) { m.impl("fwht", &fwht); }
