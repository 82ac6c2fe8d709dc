// Fused reads of kvquant's affine INT8/INT4/INT2 pages for attention on the CPU (kvquant.native).
//
// Both functions read the packed codes straight from the page pool through the block table: no gather,
// no unpacked or dequantized (B, H, T, D) tensor. A token's value in channel d of group j is
//     x = A[t, j] * c[d] + Z[t, j]          (c the unsigned code; A, Z per block, fp32)
// so a score is  q . x = sum_j A[t, j] (q_j . c_j) + Z[t, j] sum(q_j)  and a weighted sum of values is
//     sum_t p_t x_t = sum_j (sum_t p_t A[t, j] c_t,j) + sum_t p_t Z[t, j].
// Their pure-PyTorch twins are AffineCodec.score_pages / value_pages with the native op off
// (kvquant/codec.py); tests/test_native.py compares them.
//
// Layouts (all contiguous):
//   q       (B, H, M, D) fp32            queries (the M query rows that share KV head h)
//   p       (B, H, M, L) fp32            weights over the L tokens read
//   codes   (P, H, bs, D * bits / 8) u8  the codes pool: byte k of a token holds codes 8/bits*k .. (low first)
//   table   (B, n_pages) int64           page ids; token r of the region is at page table[b, (offset + r) / bs]
//   a, z    (B, Hf, R, G) fp32           per block row and channel group, for the region's whole pages:
//                                        token r of the region reads row (offset + r) / te (te tokens share
//                                        a row: 1, or N for channel-wise statistics); Hf = 1: every head
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace {

template <int BITS>
inline void unpack_row(const uint8_t* __restrict src, float* __restrict dst, int64_t d) {
  constexpr int PER = 8 / BITS;
  constexpr int MASK = (1 << BITS) - 1;
  const int64_t nbytes = d / PER;
  for (int64_t k = 0; k < nbytes; ++k) {
    const int v = src[k];
#pragma GCC unroll 4
    for (int i = 0; i < PER; ++i) dst[k * PER + i] = static_cast<float>((v >> (BITS * i)) & MASK);
  }
}

inline void unpack_any(int bits, const uint8_t* src, float* dst, int64_t d) {
  if (bits == 8) unpack_row<8>(src, dst, d);
  else if (bits == 4) unpack_row<4>(src, dst, d);
  else unpack_row<2>(src, dst, d);
}

void check(const at::Tensor& t, at::ScalarType dt, int64_t dims, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == dt, name, " has dtype ", t.scalar_type(), ", expected ", dt);
  TORCH_CHECK(t.dim() == dims, name, " must have ", dims, " dimensions, got ", t.dim());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace

// (B, H, M, L) scores q . x over the region's tokens.
at::Tensor affine_scores(const at::Tensor& q, const at::Tensor& codes, const at::Tensor& table,
                         const at::Tensor& a, const at::Tensor& z, int64_t offset, int64_t length,
                         int64_t bits, int64_t te) {
  check(q, at::kFloat, 4, "q");
  check(codes, at::kByte, 4, "codes");
  check(table, at::kLong, 2, "table");
  check(a, at::kFloat, 4, "a");
  check(z, at::kFloat, 4, "z");
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "bits must be 2, 4 or 8");
  const int64_t B = q.size(0), H = q.size(1), M = q.size(2), D = q.size(3);
  const int64_t bs = codes.size(2), row_bytes = codes.size(3), G = a.size(3), Hf = a.size(1);
  TORCH_CHECK(row_bytes * (8 / bits) == D, "codes rows hold ", row_bytes, " bytes, not D * bits / 8");
  TORCH_CHECK(D % G == 0 && z.sizes() == a.sizes(), "a, z must be (B, Hf, rows, G) with G dividing D");
  TORCH_CHECK(te >= 1 && length >= 0 && offset >= 0, "te must be >= 1, offset and length >= 0");
  TORCH_CHECK(length == 0 || (offset + length - 1) / te < a.size(2), "a, z hold fewer rows than the region reads");
  const int64_t gw = D / G, R = a.size(2);  // channels per group, statistic rows
  auto out = at::empty({B, H, M, length}, q.options());
  const float* qp = q.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const float* ap = a.data_ptr<float>();
  const float* zp = z.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t n_pages = table.size(1), P = codes.size(0);
  at::parallel_for(0, B * H, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> c(D), qsum(M * G), qa(M * D), qz(M);
    for (int64_t bh = lo; bh < hi; ++bh) {
      const int64_t b = bh / H, h = bh % H, hf = Hf == 1 ? 0 : h;
      const float* qb = qp + bh * M * D;
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < G; ++j) {
          float s = 0.f;
          for (int64_t k = 0; k < gw; ++k) s += qb[i * D + j * gw + k];
          qsum[i * G + j] = s;
        }
      int64_t row = -1;  // te > 1: the statistic row qa / qz were expanded for
      for (int64_t r = 0; r < length; ++r) {
        const int64_t pos = offset + r, page_i = pos / bs;
        TORCH_CHECK(page_i < n_pages, "region reads past its block table");
        const int64_t page = tp[b * n_pages + page_i];
        TORCH_CHECK(page >= 0 && page < P, "page id ", page, " outside the pool");
        unpack_any(static_cast<int>(bits), cp + ((page * H + h) * bs + pos % bs) * row_bytes, c.data(), D);
        const float* ar = ap + ((b * Hf + hf) * R + pos / te) * G;
        const float* zr = zp + ((b * Hf + hf) * R + pos / te) * G;
        if (te > 1) {  // te tokens share a row: fold A into the query once per row, q_a = q * A, q_z = q . Z
          if (pos / te != row) {
            row = pos / te;
            for (int64_t i = 0; i < M; ++i) {
              float zsum = 0.f;
              for (int64_t d = 0; d < D; ++d) {
                qa[i * D + d] = qb[i * D + d] * ar[d / gw];
                zsum += qb[i * D + d] * zr[d / gw];
              }
              qz[i] = zsum;
            }
          }
          for (int64_t i = 0; i < M; ++i) {
            const float* qi = qa.data() + i * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qi[d] * c[d];
            op[(bh * M + i) * length + r] = dot + qz[i];
          }
          continue;
        }
        for (int64_t i = 0; i < M; ++i) {
          const float* qi = qb + i * D;
          float total = 0.f;
          for (int64_t j = 0; j < G; ++j) {
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t k = 0; k < gw; ++k) dot += qi[j * gw + k] * c[j * gw + k];
            total += ar[j] * dot + zr[j] * qsum[i * G + j];
          }
          op[(bh * M + i) * length + r] = total;
        }
      }
    }
  });
  return out;
}

// (B, H, M, D) sum_t p_t x_t over the region's tokens.
at::Tensor affine_values(const at::Tensor& p, const at::Tensor& codes, const at::Tensor& table,
                         const at::Tensor& a, const at::Tensor& z, int64_t offset, int64_t bits,
                         int64_t te) {
  check(p, at::kFloat, 4, "p");
  check(codes, at::kByte, 4, "codes");
  check(table, at::kLong, 2, "table");
  check(a, at::kFloat, 4, "a");
  check(z, at::kFloat, 4, "z");
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "bits must be 2, 4 or 8");
  const int64_t B = p.size(0), H = p.size(1), M = p.size(2), L = p.size(3);
  const int64_t bs = codes.size(2), row_bytes = codes.size(3), D = row_bytes * (8 / bits);
  const int64_t G = a.size(3), Hf = a.size(1);
  TORCH_CHECK(D % G == 0 && z.sizes() == a.sizes(), "a, z must be (B, Hf, rows, G) with G dividing D");
  TORCH_CHECK(te >= 1 && offset >= 0, "te must be >= 1 and offset >= 0");
  TORCH_CHECK(L == 0 || (offset + L - 1) / te < a.size(2), "a, z hold fewer rows than the region reads");
  const int64_t gw = D / G, R = a.size(2);
  auto out = at::zeros({B, H, M, D}, p.options());
  const float* pp = p.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const float* ap = a.data_ptr<float>();
  const float* zp = z.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t n_pages = table.size(1), P = codes.size(0);
  at::parallel_for(0, B * H, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> c(D), bias(M * G), acc(M * D), sw(M);
    for (int64_t bh = lo; bh < hi; ++bh) {
      const int64_t b = bh / H, h = bh % H, hf = Hf == 1 ? 0 : h;
      std::fill(bias.begin(), bias.end(), 0.f);
      float* ob = op + bh * M * D;
      int64_t row = -1;  // te > 1: the statistic row acc / sw hold sums for
      auto flush = [&]() {  // out += A * sum_t p_t c_t + Z * sum_t p_t over the row's tokens
        if (row < 0) return;
        const float* ar = ap + ((b * Hf + hf) * R + row) * G;
        const float* zr = zp + ((b * Hf + hf) * R + row) * G;
        for (int64_t i = 0; i < M; ++i)
          for (int64_t d = 0; d < D; ++d)
            ob[i * D + d] += ar[d / gw] * acc[i * D + d] + zr[d / gw] * sw[i];
        std::fill(acc.begin(), acc.end(), 0.f);
        std::fill(sw.begin(), sw.end(), 0.f);
      };
      for (int64_t r = 0; r < L; ++r) {
        const int64_t pos = offset + r, page_i = pos / bs;
        TORCH_CHECK(page_i < n_pages, "region reads past its block table");
        const int64_t page = tp[b * n_pages + page_i];
        TORCH_CHECK(page >= 0 && page < P, "page id ", page, " outside the pool");
        unpack_any(static_cast<int>(bits), cp + ((page * H + h) * bs + pos % bs) * row_bytes, c.data(), D);
        const float* ar = ap + ((b * Hf + hf) * R + pos / te) * G;
        const float* zr = zp + ((b * Hf + hf) * R + pos / te) * G;
        if (te > 1) {
          if (pos / te != row) {
            flush();
            row = pos / te;
          }
          for (int64_t i = 0; i < M; ++i) {
            const float w = pp[(bh * M + i) * L + r];
            float* ai = acc.data() + i * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ai[d] += w * c[d];
            sw[i] += w;
          }
          continue;
        }
        for (int64_t i = 0; i < M; ++i) {
          const float w = pp[(bh * M + i) * L + r];
          float* oi = ob + i * D;
          for (int64_t j = 0; j < G; ++j) {
            const float coef = w * ar[j];
#pragma omp simd
            for (int64_t k = 0; k < gw; ++k) oi[j * gw + k] += coef * c[j * gw + k];
            bias[i * G + j] += w * zr[j];
          }
        }
      }
      flush();
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < G; ++j)
          for (int64_t k = 0; k < gw; ++k) ob[i * D + j * gw + k] += bias[i * G + j];
    }
  });
  return out;
}

TORCH_LIBRARY(kvquant_native, m) {
  m.def("affine_scores(Tensor q, Tensor codes, Tensor table, Tensor a, Tensor z, int offset, int length, int bits, int te) -> Tensor");
  m.def("affine_values(Tensor p, Tensor codes, Tensor table, Tensor a, Tensor z, int offset, int bits, int te) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvquant_native, CPU, m) {
  m.impl("affine_scores", &affine_scores);
  m.impl("affine_values", &affine_values);
}
