// Fused reads of kvquant's affine INT8/INT4/INT2 pages for attention on the CPU (kvquant.native).
//
// Both functions read the packed codes straight from the page pool through the block table: no gather,
// no unpacked or dequantized (B, H, T, D) tensor. A token's value in channel d of group j is
//     x = A[t, j] * c[d] + Z[t, j]          (c the unsigned code; A, Z per block, fp32)
// so a score is  q . x = sum_j A[t, j] (q_j . c_j) + Z[t, j] sum(q_j)  and a weighted sum of values is
//     sum_t p_t x_t = sum_j (sum_t p_t A[t, j] c_t,j) + sum_t p_t Z[t, j].
// Their pure-PyTorch twins are AffineCodec.score_pages / value_pages with the native op off
// (kvquant/codecs/base.py); tests/test_native.py compares them.
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

// The codes pool, block table and per-row statistics of one call, checked once: what both ops read.
struct PagedRows {
  const uint8_t* codes;
  const int64_t* table;
  const float* a;
  const float* z;
  int64_t P, H, bs, row_bytes, D, n_pages, Hf, R, G, gw, offset, te, bits;

  PagedRows(const at::Tensor& codes_t, const at::Tensor& table_t, const at::Tensor& a_t, const at::Tensor& z_t,
            int64_t offset_, int64_t length, int64_t bits_, int64_t te_) {
    check(codes_t, at::kByte, 4, "codes");
    check(table_t, at::kLong, 2, "table");
    check(a_t, at::kFloat, 4, "a");
    check(z_t, at::kFloat, 4, "z");
    TORCH_CHECK(bits_ == 2 || bits_ == 4 || bits_ == 8, "bits must be 2, 4 or 8");
    TORCH_CHECK(te_ >= 1 && length >= 0 && offset_ >= 0, "te must be >= 1, offset and length >= 0");
    P = codes_t.size(0), H = codes_t.size(1), bs = codes_t.size(2), row_bytes = codes_t.size(3);
    D = row_bytes * (8 / bits_), n_pages = table_t.size(1);
    Hf = a_t.size(1), R = a_t.size(2), G = a_t.size(3), offset = offset_, te = te_, bits = bits_;
    TORCH_CHECK(D % G == 0 && z_t.sizes() == a_t.sizes(), "a, z must be (B, Hf, rows, G) with G dividing D");
    TORCH_CHECK(length == 0 || (offset + length - 1) / te < R, "a, z hold fewer rows than the region reads");
    gw = D / G;
    codes = codes_t.data_ptr<uint8_t>(), table = table_t.data_ptr<int64_t>();
    a = a_t.data_ptr<float>(), z = z_t.data_ptr<float>();
  }

  // Unpacks token r of sequence b, head h into c (D floats); the statistics row it reads is (offset + r) / te.
  void unpack(int64_t b, int64_t h, int64_t r, float* c) const {
    const int64_t pos = offset + r, page_i = pos / bs;
    TORCH_CHECK(page_i < n_pages, "region reads past its block table");
    const int64_t page = table[b * n_pages + page_i];
    TORCH_CHECK(page >= 0 && page < P, "page id ", page, " outside the pool");
    unpack_any(static_cast<int>(bits), codes + ((page * H + h) * bs + pos % bs) * row_bytes, c, D);
  }

  int64_t stat_row(int64_t r) const { return (offset + r) / te; }
  int64_t stat_at(int64_t b, int64_t h, int64_t row) const { return ((b * Hf + (Hf == 1 ? 0 : h)) * R + row) * G; }
  const float* a_row(int64_t b, int64_t h, int64_t row) const { return a + stat_at(b, h, row); }
  const float* z_row(int64_t b, int64_t h, int64_t row) const { return z + stat_at(b, h, row); }
};

}  // namespace

// (B, H, M, L) scores q . x over the region's tokens.
at::Tensor affine_scores(const at::Tensor& q, const at::Tensor& codes, const at::Tensor& table,
                         const at::Tensor& a, const at::Tensor& z, int64_t offset, int64_t length,
                         int64_t bits, int64_t te) {
  check(q, at::kFloat, 4, "q");
  const PagedRows pg(codes, table, a, z, offset, length, bits, te);
  const int64_t B = q.size(0), H = q.size(1), M = q.size(2), D = q.size(3), G = pg.G, gw = pg.gw;
  TORCH_CHECK(D == pg.D && H == pg.H, "q is (B, ", H, ", M, ", D, "); the pool holds ", pg.H, " heads of ", pg.D);
  TORCH_CHECK(table.size(0) == B && a.size(0) == B, "q, table, a and z must agree on the batch");
  auto out = at::empty({B, H, M, length}, q.options());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> c(D), qsum(M * G), qa(M * D), qz(M);
    for (int64_t bh = lo; bh < hi; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const float* qb = qp + bh * M * D;
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < G; ++j) {
          float s = 0.f;
          for (int64_t k = 0; k < gw; ++k) s += qb[i * D + j * gw + k];
          qsum[i * G + j] = s;
        }
      int64_t row = -1;  // te > 1: the statistic row qa / qz were expanded for
      for (int64_t r = 0; r < length; ++r) {
        pg.unpack(b, h, r, c.data());
        const float* ar = pg.a_row(b, h, pg.stat_row(r));
        const float* zr = pg.z_row(b, h, pg.stat_row(r));
        if (te > 1) {  // te tokens share a row: fold A into the query once per row, q_a = q * A, q_z = q . Z
          if (pg.stat_row(r) != row) {
            row = pg.stat_row(r);
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
        for (int64_t i = 0; i < M; ++i) {  // one row per token: sum_j A_j (q_j . c_j) + Z_j sum(q_j)
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
  const int64_t B = p.size(0), H = p.size(1), M = p.size(2), L = p.size(3);
  const PagedRows pg(codes, table, a, z, offset, L, bits, te);
  const int64_t D = pg.D, G = pg.G, gw = pg.gw;
  TORCH_CHECK(H == pg.H, "p has ", H, " heads; the pool holds ", pg.H);
  TORCH_CHECK(table.size(0) == B && a.size(0) == B, "p, table, a and z must agree on the batch");
  auto out = at::zeros({B, H, M, D}, p.options());
  const float* pp = p.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> c(D), bias(M * G), acc(M * D), sw(M);
    for (int64_t bh = lo; bh < hi; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      std::fill(bias.begin(), bias.end(), 0.f);
      float* ob = op + bh * M * D;
      int64_t row = -1;  // te > 1: the statistic row acc / sw hold sums for
      auto flush = [&]() {  // out += A * sum_t p_t c_t + Z * sum_t p_t over the row's tokens
        if (row < 0) return;
        const float* ar = pg.a_row(b, h, row);
        const float* zr = pg.z_row(b, h, row);
        for (int64_t i = 0; i < M; ++i)
          for (int64_t d = 0; d < D; ++d)
            ob[i * D + d] += ar[d / gw] * acc[i * D + d] + zr[d / gw] * sw[i];
        std::fill(acc.begin(), acc.end(), 0.f);
        std::fill(sw.begin(), sw.end(), 0.f);
      };
      for (int64_t r = 0; r < L; ++r) {
        pg.unpack(b, h, r, c.data());
        if (te > 1) {
          if (pg.stat_row(r) != row) {
            flush();
            row = pg.stat_row(r);
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
        const float* ar = pg.a_row(b, h, pg.stat_row(r));
        const float* zr = pg.z_row(b, h, pg.stat_row(r));
        for (int64_t i = 0; i < M; ++i) {  // one row per token: out_j += (p A_j) c_j, bias_j += p Z_j
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
  m.def("affine_scores(Tensor q, Tensor codes, Tensor table, Tensor a, Tensor z, int offset, int length, "
        "int bits, int te) -> Tensor");
  m.def("affine_values(Tensor p, Tensor codes, Tensor table, Tensor a, Tensor z, int offset, int bits, "
        "int te) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvquant_native, CPU, m) {
  m.impl("affine_scores", &affine_scores);
  m.impl("affine_values", &affine_values);
}
