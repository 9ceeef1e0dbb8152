// Products of float32 activations with int8 or 16-bit weights stored (out, in), for the CPU
// linear methods of quantized checkpoints (layers/linear_methods.py), where MindSpore's CPU
// backend has no kernel that reads such weights without a float32 copy.
//
//   W8A8Matmul          x_q = clamp(round(x / input_scale + input_offset)), per tensor;
//                       y = float(x_q @ W_q.T + quant_bias) * deq_scale
//   W8A8DynamicMatmul   x_q = clamp(round(x / s_t)), s_t one per row (given);
//                       y = float(x_q @ W_q.T) * s_t * weight_scale
//   W8A16Matmul         y = sum over groups of (x_g @ W_q,g.T - rowsum(x_g) * offset_g) * scale_g
//   F16WeightMatmul(T), BF16WeightMatmul(T): y = x @ W.T ((out, rows) for T), W 16-bit,
//                       upcast exactly
//   F16Rows, BF16Rows   rows of a 16-bit table (an embedding) as float32
//
// Rounding is to nearest even (MindSpore's Round), the clamp [-128, 127]. The int8 x int8
// sums are exact int32: AVX512-VNNI vpdpbusd multiplies unsigned by signed bytes, so the
// weight byte is read as w + 128 (its top bit flipped) and 128 * rowsum(x_q) taken off.
// OpenMP splits the outputs over SetThreads' count (MindSpore's CPU pool's, so ranks that
// share a host do not oversubscribe it).
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

class AotExtra;

namespace {

int g_threads = 0;

int threads() { return g_threads > 0 ? g_threads : omp_get_max_threads(); }

int64_t leading(int ndims, const int64_t *shape) {
  int64_t rows = 1;
  for (int i = 0; i < ndims - 1; i++) rows *= shape[i];
  return rows;
}

constexpr int RB = 4;  // rows per register block (few rows: dot products)
constexpr int NB = 4;  // outputs per register block

// ---- int8 x int8, exact ---------------------------------------------------------------

// acc[r][n] = sum_k (w[n][k] + 128) * xq[r][k] over the padded k (xq's padding is zero).
template <int R, int N>
inline void int8_block(const int8_t *xq, int64_t ldx, const int8_t *w, int64_t k,
                       int32_t *acc, int64_t ldacc) {
  __m512i sum[R][N];
  for (int r = 0; r < R; r++)
    for (int n = 0; n < N; n++) sum[r][n] = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  int64_t kk = 0;
  for (; kk + 64 <= k; kk += 64) {
    __m512i wv[N];
    for (int n = 0; n < N; n++)
      wv[n] = _mm512_xor_si512(_mm512_loadu_si512(w + n * k + kk), flip);
    for (int r = 0; r < R; r++) {
      const __m512i xv = _mm512_loadu_si512(xq + r * ldx + kk);
      for (int n = 0; n < N; n++) sum[r][n] = _mm512_dpbusd_epi32(sum[r][n], wv[n], xv);
    }
  }
  if (kk < k) {  // the tail: x's padding is zero, so the masked weight bytes add nothing
    const __mmask64 mask = (~0ULL) >> (64 - (k - kk));
    __m512i wv[N];
    for (int n = 0; n < N; n++)
      wv[n] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, w + n * k + kk), flip);
    for (int r = 0; r < R; r++) {
      const __m512i xv = _mm512_loadu_si512(xq + r * ldx + kk);
      for (int n = 0; n < N; n++) sum[r][n] = _mm512_dpbusd_epi32(sum[r][n], wv[n], xv);
    }
  }
  for (int r = 0; r < R; r++)
    for (int n = 0; n < N; n++) acc[r * ldacc + n] = _mm512_reduce_add_epi32(sum[r][n]);
}

template <int R>
inline void int8_rows(const int8_t *xq, int64_t ldx, const int8_t *w, int64_t k, int64_t n,
                      int32_t *acc, int64_t ldacc) {
  switch (n) {
    case 1: int8_block<R, 1>(xq, ldx, w, k, acc, ldacc); break;
    case 2: int8_block<R, 2>(xq, ldx, w, k, acc, ldacc); break;
    case 3: int8_block<R, 3>(xq, ldx, w, k, acc, ldacc); break;
    default: int8_block<R, NB>(xq, ldx, w, k, acc, ldacc);
  }
}

inline void int8_tile(const int8_t *xq, int64_t ldx, int64_t rows, const int8_t *w, int64_t k,
                      int64_t n, int32_t *acc, int64_t ldacc) {
  switch (rows) {
    case 1: int8_rows<1>(xq, ldx, w, k, n, acc, ldacc); break;
    case 2: int8_rows<2>(xq, ldx, w, k, n, acc, ldacc); break;
    case 3: int8_rows<3>(xq, ldx, w, k, n, acc, ldacc); break;
    default: int8_rows<RB>(xq, ldx, w, k, n, acc, ldacc);
  }
}

// x quantized to int8 rows padded to a multiple of 64 with zeros, and each row's sum.
struct Quantized {
  std::vector<int8_t> q;
  std::vector<int32_t> sum;
  int64_t ld;
};

// x_q = clamp(round(x / divisor[r] + offset)); divisor per row (stride 1) or one (stride 0).
Quantized quantize(const float *x, int64_t rows, int64_t k, const float *divisor,
                   int64_t divisor_stride, float offset) {
  Quantized out;
  out.ld = (k + 63) / 64 * 64;
  out.q.assign(rows * out.ld, 0);
  out.sum.assign(rows, 0);
  const __m512 lo = _mm512_set1_ps(-128.0f), hi = _mm512_set1_ps(127.0f);
  const __m512 off = _mm512_set1_ps(offset);
#pragma omp parallel for num_threads(threads()) schedule(static) if (rows * k > (1 << 16))
  for (int64_t r = 0; r < rows; r++) {
    const __m512 d = _mm512_set1_ps(divisor[r * divisor_stride]);
    const float *xr = x + r * k;
    int8_t *qr = out.q.data() + r * out.ld;
    __m512i total = _mm512_setzero_si512();
    for (int64_t kk = 0; kk < k; kk += 16) {
      const __mmask16 mask = k - kk >= 16 ? 0xFFFF : (1u << (k - kk)) - 1;
      __m512 v = _mm512_add_ps(_mm512_div_ps(_mm512_maskz_loadu_ps(mask, xr + kk), d), off);
      v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
      const __m512i iv = _mm512_maskz_mov_epi32(mask, _mm512_cvtps_epi32(v));
      total = _mm512_add_epi32(total, iv);
      _mm_mask_storeu_epi8(qr + kk, mask, _mm512_cvtepi32_epi8(iv));
    }
    out.sum[r] = _mm512_reduce_add_epi32(total);
  }
  return out;
}

// Many rows: each thread lays its block of PN outputs' weights out as [k / 4][PN] groups of
// 4 bytes (top bits flipped), so one vpdpbusd sums 4 inputs for 16 outputs of a row, the
// row's 4 bytes broadcast: no horizontal sums, each weight read once per block of rows.
constexpr int PN = 32;         // outputs per packed block (two vectors)
constexpr int PR = 8;          // rows per packed register block
constexpr int64_t PACK_ROWS = 32;  // from this many rows the packing pays (measured)

void pack_int8(const int8_t *w, int64_t k, int64_t kp, int64_t outputs, int32_t *packed) {
  const int32_t flip = static_cast<int32_t>(0x80808080u);
  const int64_t whole = outputs == PN ? k / 4 : 0;  // groups read as one word each
  for (int64_t kg = 0; kg < whole; kg++)
    for (int64_t j = 0; j < PN; j++) {
      int32_t word;
      std::memcpy(&word, w + j * k + kg * 4, 4);
      packed[kg * PN + j] = word ^ flip;
    }
  for (int64_t kg = whole; kg < kp / 4; kg++)
    for (int64_t j = 0; j < PN; j++) {
      uint8_t bytes[4] = {0, 0, 0, 0};  // past the weights: x's padding is zero there
      if (j < outputs)
        for (int64_t b = 0; b < 4 && kg * 4 + b < k; b++) bytes[b] = w[j * k + kg * 4 + b];
      int32_t word;
      std::memcpy(&word, bytes, 4);
      packed[kg * PN + j] = word ^ flip;
    }
}

template <int R>
inline void packed_int8_block(const int8_t *xq, int64_t ldx, const int32_t *packed,
                              int64_t kp, int32_t *acc) {
  __m512i sum[R][2];
  for (int r = 0; r < R; r++) sum[r][0] = sum[r][1] = _mm512_setzero_si512();
  for (int64_t kg = 0; kg < kp / 4; kg++) {
    const __m512i w0 = _mm512_loadu_si512(packed + kg * PN);
    const __m512i w1 = _mm512_loadu_si512(packed + kg * PN + 16);
    for (int r = 0; r < R; r++) {
      int32_t word;
      std::memcpy(&word, xq + r * ldx + kg * 4, 4);
      const __m512i xv = _mm512_set1_epi32(word);
      sum[r][0] = _mm512_dpbusd_epi32(sum[r][0], w0, xv);
      sum[r][1] = _mm512_dpbusd_epi32(sum[r][1], w1, xv);
    }
  }
  for (int r = 0; r < R; r++) {
    _mm512_storeu_si512(acc + r * PN, sum[r][0]);
    _mm512_storeu_si512(acc + r * PN + 16, sum[r][1]);
  }
}

template <int R = PR>
inline void packed_int8_rows(int64_t rows, const int8_t *xq, int64_t ldx,
                             const int32_t *packed, int64_t kp, int32_t *acc) {
  if constexpr (R > 1) {
    if (rows < R) return packed_int8_rows<R - 1>(rows, xq, ldx, packed, kp, acc);
  }
  packed_int8_block<R>(xq, ldx, packed, kp, acc);
}

template <class Epilogue>
void packed_int8_matmul(const Quantized &x, int64_t rows, const int8_t *w, int64_t k,
                        int64_t out, Epilogue epilogue) {
  const int64_t blocks = (out + PN - 1) / PN;
#pragma omp parallel num_threads(threads())
  {
    std::vector<int32_t> packed(x.ld / 4 * PN);
    int32_t acc[PR * PN];
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
      const int64_t n0 = b * PN, nn = std::min<int64_t>(PN, out - n0);
      pack_int8(w + n0 * k, k, x.ld, nn, packed.data());
      for (int64_t r = 0; r < rows; r += PR) {
        const int64_t rr = std::min<int64_t>(PR, rows - r);
        packed_int8_rows(rr, x.q.data() + r * x.ld, x.ld, packed.data(), x.ld, acc);
        for (int64_t i = 0; i < rr; i++)
          for (int64_t j = 0; j < nn; j++)
            epilogue(r + i, n0 + j, acc[i * PN + j] - 128 * x.sum[r + i]);
      }
    }
  }
}

// Calls epilogue(r, n, exact int32 x_q[r] . W_q[n]) for every row and output.
template <class Epilogue>
void int8_matmul(const Quantized &x, int64_t rows, const int8_t *w, int64_t k, int64_t out,
                 Epilogue epilogue) {
  if (rows >= PACK_ROWS) return packed_int8_matmul(x, rows, w, k, out, epilogue);
  const int64_t blocks = (out + NB - 1) / NB;
#pragma omp parallel for num_threads(threads()) schedule(static)
  for (int64_t b = 0; b < blocks; b++) {
    const int64_t n0 = b * NB, nn = std::min<int64_t>(NB, out - n0);
    int32_t acc[RB * NB];
    for (int64_t r = 0; r < rows; r += RB) {
      const int64_t rr = std::min<int64_t>(RB, rows - r);
      int8_tile(x.q.data() + r * x.ld, x.ld, rr, w + n0 * k, k, nn, acc, NB);
      for (int64_t i = 0; i < rr; i++)
        for (int64_t j = 0; j < nn; j++)
          epilogue(r + i, n0 + j, acc[i * NB + j] - 128 * x.sum[r + i]);
    }
  }
}

// ---- float activations x int8 / 16-bit weights ------------------------------------------

struct Int8Weights {
  using T = int8_t;
  static __m512 load(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i *>(p))));
  }
  static __m512 load(const int8_t *p, __mmask16 m) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
  }
};

struct F16Weights {
  using T = uint16_t;
  static __m512 load(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)));
  }
  static __m512 load(const uint16_t *p, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
  }
};

struct BF16Weights {
  using T = uint16_t;
  static __m512 widen(__m256i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
  }
  static __m512 load(const uint16_t *p) {
    return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)));
  }
  static __m512 load(const uint16_t *p, __mmask16 m) {
    return widen(_mm256_maskz_loadu_epi16(m, p));
  }
};

// dot[r * ld + n] += sum over k in [k0, k1) of x[r][k] * w[n][k]. Each weight vector is
// widened once for the R rows (2 uops on the FMA ports, against R FMAs).
template <class L, int R, int N>
inline void float_block(const float *x, int64_t ldx, const typename L::T *w, int64_t ldw,
                        int64_t k0, int64_t k1, float *dot, int64_t ld) {
  __m512 sum[R][N];
  for (int r = 0; r < R; r++)
    for (int n = 0; n < N; n++) sum[r][n] = _mm512_setzero_ps();
  int64_t kk = k0;
  for (; kk + 16 <= k1; kk += 16) {
    __m512 wv[N];
    for (int n = 0; n < N; n++) {
      wv[n] = L::load(w + n * ldw + kk);
      // the next block's weights: each block's rows are short streams the hardware
      // prefetcher starts late on (prefetches do not fault past the end)
      _mm_prefetch(reinterpret_cast<const char *>(w + (N + n) * ldw + kk), _MM_HINT_T0);
    }
    for (int r = 0; r < R; r++) {
      const __m512 xv = _mm512_loadu_ps(x + r * ldx + kk);
      for (int n = 0; n < N; n++) sum[r][n] = _mm512_fmadd_ps(xv, wv[n], sum[r][n]);
    }
  }
  if (kk < k1) {
    const __mmask16 mask = (1u << (k1 - kk)) - 1;
    __m512 wv[N];
    for (int n = 0; n < N; n++) wv[n] = L::load(w + n * ldw + kk, mask);
    for (int r = 0; r < R; r++) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + r * ldx + kk);
      for (int n = 0; n < N; n++) sum[r][n] = _mm512_fmadd_ps(xv, wv[n], sum[r][n]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int n = 0; n < N; n++) dot[r * ld + n] += _mm512_reduce_add_ps(sum[r][n]);
}

// float_block for `rows` <= R rows and `n` <= N outputs.
template <class L, int R, int N>
inline void float_tile(int64_t rows, int64_t n, const float *x, int64_t ldx,
                       const typename L::T *w, int64_t ldw, int64_t k0, int64_t k1, float *dot,
                       int64_t ld) {
  if constexpr (R > 1) {
    if (rows < R) return float_tile<L, R - 1, N>(rows, n, x, ldx, w, ldw, k0, k1, dot, ld);
  }
  if constexpr (N > 1) {
    if (n < N) return float_tile<L, R, N - 1>(rows, n, x, ldx, w, ldw, k0, k1, dot, ld);
  }
  float_block<L, R, N>(x, ldx, w, ldw, k0, k1, dot, ld);
}

// Many rows: as packed_int8_matmul, each thread widens its block of PN outputs' weights once
// into float32 [k][PN], and a row's x[k] is broadcast against them.
template <class L>
void pack_float(const typename L::T *w, int64_t k, int64_t outputs, float *packed) {
  alignas(64) float block[PN][16];  // 16 inputs of each output, transposed in L1
  for (int64_t kk = 0; kk < k; kk += 16) {
    const int64_t n = std::min<int64_t>(16, k - kk);
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
    for (int64_t j = 0; j < PN; j++)
      _mm512_store_ps(block[j], j < outputs ? L::load(w + j * k + kk, mask)
                                            : _mm512_setzero_ps());
    const __m512i lanes = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7,
                                                              6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(16));
    for (int64_t i = 0; i < n; i++) {
      _mm512_storeu_ps(packed + (kk + i) * PN, _mm512_i32gather_ps(lanes, &block[0][i], 4));
      _mm512_storeu_ps(packed + (kk + i) * PN + 16,
                       _mm512_i32gather_ps(lanes, &block[16][i], 4));
    }
  }
}

template <int R>
inline void packed_float_block(const float *x, int64_t ldx, const float *packed, int64_t k0,
                               int64_t k1, float *dot) {
  __m512 sum[R][2];
  for (int r = 0; r < R; r++) sum[r][0] = sum[r][1] = _mm512_setzero_ps();
  for (int64_t kk = k0; kk < k1; kk++) {
    const __m512 w0 = _mm512_loadu_ps(packed + kk * PN);
    const __m512 w1 = _mm512_loadu_ps(packed + kk * PN + 16);
    for (int r = 0; r < R; r++) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + kk]);
      sum[r][0] = _mm512_fmadd_ps(xv, w0, sum[r][0]);
      sum[r][1] = _mm512_fmadd_ps(xv, w1, sum[r][1]);
    }
  }
  for (int r = 0; r < R; r++) {
    _mm512_storeu_ps(dot + r * PN, sum[r][0]);
    _mm512_storeu_ps(dot + r * PN + 16, sum[r][1]);
  }
}

template <int R = PR>
inline void packed_float_rows(int64_t rows, const float *x, int64_t ldx, const float *packed,
                              int64_t k0, int64_t k1, float *dot) {
  if constexpr (R > 1) {
    if (rows < R) return packed_float_rows<R - 1>(rows, x, ldx, packed, k0, k1, dot);
  }
  packed_float_block<R>(x, ldx, packed, k0, k1, dot);
}

template <class L, class Epilogue>
void packed_float_matmul(const float *x, int64_t rows, const typename L::T *w, int64_t k,
                         int64_t out, int64_t groups, Epilogue epilogue) {
  const int64_t blocks = (out + PN - 1) / PN, size = k / groups;
#pragma omp parallel num_threads(threads())
  {
    std::vector<float> packed(k * PN);
    float dot[PR * PN];
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
      const int64_t n0 = b * PN, nn = std::min<int64_t>(PN, out - n0);
      pack_float<L>(w + n0 * k, k, nn, packed.data());
      for (int64_t r = 0; r < rows; r += PR) {
        const int64_t rr = std::min<int64_t>(PR, rows - r);
        for (int64_t g = 0; g < groups; g++) {
          packed_float_rows(rr, x + r * k, k, packed.data(), g * size, (g + 1) * size, dot);
          for (int64_t i = 0; i < rr; i++) epilogue(r + i, n0, n0 + nn, g, dot + i * PN);
        }
      }
    }
  }
}

// Up to 4 rows the product is memory-bound: tiles of 4 x 4. From 5 rows, 8 rows x 3 outputs
// (24 accumulators + 3 weights + x: 28 of the 32 registers) widen each weight once per 8
// rows, not per 4.
constexpr int TALL_R = 8;
constexpr int TALL_N = 3;
constexpr int64_t X_BYTES = 32 << 10;  // a tile's rows of x in one sweep: kept in L1

// Calls epilogue(r, n0, n1, g, dot) with dot[n - n0] = x[r, group g] . w[n, group g] for
// every row and group, over runs [n0, n1) of the outputs, by tiles of R rows x N outputs.
// Each thread takes a run of blocks of N outputs and sweeps them tile of rows by tile of
// rows, X_BYTES of the tile's x at a time, so x is read from L1 and each weight once per
// tile (block by block over all rows, x came from L2 and the tall tile gained nothing).
template <class L, int R, int N, class Epilogue>
void tiled_float_matmul(const float *x, int64_t rows, const typename L::T *w, int64_t k,
                        int64_t out, int64_t groups, Epilogue epilogue) {
  const int64_t blocks = (out + N - 1) / N, size = k / groups;
#pragma omp parallel num_threads(threads())
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t n0 = std::min(out, blocks * t / nt * N);
    const int64_t n1 = std::min(out, blocks * (t + 1) / nt * N), width = n1 - n0;
    std::vector<float> dot(std::min<int64_t>(R, rows) * width);
    for (int64_t r = 0; r < rows;) {
      const int64_t tiles = (rows - r + R - 1) / R, rr = (rows - r + tiles - 1) / tiles;
      const int64_t pass = X_BYTES / 4 / rr / 16 * 16;  // inputs per sweep
      for (int64_t g = 0; g < groups; g++) {
        std::fill(dot.begin(), dot.begin() + rr * width, 0.0f);
        for (int64_t k0 = g * size; k0 < (g + 1) * size; k0 += pass) {
          const int64_t k1 = std::min(k0 + pass, (g + 1) * size);
          for (int64_t n = n0; n < n1; n += N)
            float_tile<L, R, N>(rr, std::min<int64_t>(N, n1 - n), x + r * k, k, w + n * k, k,
                                k0, k1, dot.data() + n - n0, width);
        }
        for (int64_t i = 0; i < rr; i++) epilogue(r + i, n0, n1, g, dot.data() + i * width);
      }
      r += rr;
    }
  }
}

template <class L, class Epilogue>
void float_matmul(const float *x, int64_t rows, const typename L::T *w, int64_t k, int64_t out,
                  int64_t groups, Epilogue epilogue) {
  if (rows >= PACK_ROWS)
    return packed_float_matmul<L>(x, rows, w, k, out, groups, epilogue);
  if (rows <= RB) return tiled_float_matmul<L, RB, NB>(x, rows, w, k, out, groups, epilogue);
  tiled_float_matmul<L, TALL_R, TALL_N>(x, rows, w, k, out, groups, epilogue);
}

template <class L>
int half_weight_matmul(void **params, int *ndims, int64_t **shapes, bool transposed) {
  const float *x = static_cast<const float *>(params[0]);
  const auto *w = static_cast<const uint16_t *>(params[1]);
  float *y = static_cast<float *>(params[2]);
  const int64_t rows = leading(ndims[0], shapes[0]), k = shapes[0][ndims[0] - 1];
  const int64_t out = shapes[1][0];
  if (transposed)
    float_matmul<L>(x, rows, w, k, out, 1,
                    [&](int64_t r, int64_t n0, int64_t n1, int64_t, const float *dot) {
      for (int64_t n = n0; n < n1; n++) y[n * rows + r] = dot[n - n0];
    });
  else
    float_matmul<L>(x, rows, w, k, out, 1,
                    [&](int64_t r, int64_t n0, int64_t n1, int64_t, const float *dot) {
      std::copy(dot, dot + (n1 - n0), y + r * out + n0);
    });
  return 0;
}

template <class T>
int rows_of(void **params, int64_t **shapes, int *ndims, float (*widen)(T)) {
  const auto *table = static_cast<const T *>(params[0]);
  const auto *ids = static_cast<const int32_t *>(params[1]);
  float *y = static_cast<float *>(params[2]);
  const int64_t width = shapes[0][1];
  int64_t count = 1;
  for (int i = 0; i < ndims[1]; i++) count *= shapes[1][i];
  for (int64_t i = 0; i < count; i++)
    if (ids[i] < 0 || ids[i] >= shapes[0][0]) return 1;  // MindSpore raises: not a row
  for (int64_t i = 0; i < count; i++) {
    const T *row = table + static_cast<int64_t>(ids[i]) * width;
    for (int64_t c = 0; c < width; c++) y[i * width + c] = widen(row[c]);
  }
  return 0;
}

float f16_to_float(uint16_t h) { return _cvtsh_ss(h); }

float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

std::vector<int64_t> matmul_shape(int *ndims, int64_t **shapes) {
  std::vector<int64_t> shape(shapes[0], shapes[0] + ndims[0] - 1);
  shape.push_back(shapes[1][0]);
  return shape;
}

std::vector<int64_t> transposed_shape(int *ndims, int64_t **shapes) {
  return {shapes[1][0], leading(ndims[0], shapes[0])};
}

std::vector<int64_t> rows_shape(int *ndims, int64_t **shapes) {
  std::vector<int64_t> shape(shapes[1], shapes[1] + ndims[1]);
  shape.push_back(shapes[0][1]);
  return shape;
}

}  // namespace

extern "C" void SetThreads(int n) { g_threads = n; }

extern "C" std::vector<int64_t> W8A8MatmulInferShape(int *ndims, int64_t **shapes, AotExtra *) {
  return matmul_shape(ndims, shapes);
}

// x (rows, in) f32, weight (out, in) i8, deq_scale (out) f32, quant_bias (out) i32,
// input_scale (1) f32, input_offset (1) f32 -> (rows, out) f32
extern "C" int W8A8Matmul(int, void **params, int *ndims, int64_t **shapes, const char **,
                          void *, void *) {
  const float *x = static_cast<const float *>(params[0]);
  const auto *w = static_cast<const int8_t *>(params[1]);
  const float *deq = static_cast<const float *>(params[2]);
  const auto *bias = static_cast<const int32_t *>(params[3]);
  const float *scale = static_cast<const float *>(params[4]);
  const float offset = *static_cast<const float *>(params[5]);
  float *y = static_cast<float *>(params[6]);
  const int64_t rows = leading(ndims[0], shapes[0]), k = shapes[0][ndims[0] - 1];
  const int64_t out = shapes[1][0];
  const Quantized xq = quantize(x, rows, k, scale, 0, offset);
  int8_matmul(xq, rows, w, k, out, [&](int64_t r, int64_t n, int32_t acc) {
    y[r * out + n] = static_cast<float>(acc + bias[n]) * deq[n];
  });
  return 0;
}

extern "C" std::vector<int64_t> W8A8DynamicMatmulInferShape(int *ndims, int64_t **shapes,
                                                            AotExtra *) {
  return matmul_shape(ndims, shapes);
}

// x (rows, in) f32, weight (out, in) i8, row_scale (rows, 1) f32, weight_scale (out) f32
// -> (rows, out) f32
extern "C" int W8A8DynamicMatmul(int, void **params, int *ndims, int64_t **shapes,
                                 const char **, void *, void *) {
  const float *x = static_cast<const float *>(params[0]);
  const auto *w = static_cast<const int8_t *>(params[1]);
  const float *row_scale = static_cast<const float *>(params[2]);
  const float *weight_scale = static_cast<const float *>(params[3]);
  float *y = static_cast<float *>(params[4]);
  const int64_t rows = leading(ndims[0], shapes[0]), k = shapes[0][ndims[0] - 1];
  const int64_t out = shapes[1][0];
  const Quantized xq = quantize(x, rows, k, row_scale, 1, 0.0f);
  int8_matmul(xq, rows, w, k, out, [&](int64_t r, int64_t n, int32_t acc) {
    y[r * out + n] = static_cast<float>(acc) * row_scale[r] * weight_scale[n];
  });
  return 0;
}

extern "C" std::vector<int64_t> W8A16MatmulInferShape(int *ndims, int64_t **shapes, AotExtra *) {
  return matmul_shape(ndims, shapes);
}

// x (rows, in) f32, weight (out, in) i8, weight_scale (out, groups) f32, weight_offset
// (out, groups) f32 -> (rows, out) f32
extern "C" int W8A16Matmul(int, void **params, int *ndims, int64_t **shapes, const char **,
                           void *, void *) {
  const float *x = static_cast<const float *>(params[0]);
  const auto *w = static_cast<const int8_t *>(params[1]);
  const float *scale = static_cast<const float *>(params[2]);
  const float *offset = static_cast<const float *>(params[3]);
  float *y = static_cast<float *>(params[4]);
  const int64_t rows = leading(ndims[0], shapes[0]), k = shapes[0][ndims[0] - 1];
  const int64_t out = shapes[1][0], groups = shapes[2][1], size = k / groups;
  std::vector<float> sums(rows * groups);  // rowsum(x_g)
  for (int64_t r = 0; r < rows; r++)
    for (int64_t g = 0; g < groups; g++) {
      float s = 0;
      for (int64_t c = g * size; c < (g + 1) * size; c++) s += x[r * k + c];
      sums[r * groups + g] = s;
    }
  float_matmul<Int8Weights>(x, rows, w, k, out, groups,
                            [&](int64_t r, int64_t n0, int64_t n1, int64_t g, const float *dot) {
    const float sum = sums[r * groups + g];
    float *yr = y + r * out;
    for (int64_t n = n0; n < n1; n++) {
      const float part = (dot[n - n0] - sum * offset[n * groups + g]) * scale[n * groups + g];
      yr[n] = g == 0 ? part : yr[n] + part;
    }
  });
  return 0;
}

extern "C" std::vector<int64_t> F16WeightMatmulInferShape(int *ndims, int64_t **shapes,
                                                          AotExtra *) {
  return matmul_shape(ndims, shapes);
}

extern "C" std::vector<int64_t> BF16WeightMatmulInferShape(int *ndims, int64_t **shapes,
                                                           AotExtra *) {
  return matmul_shape(ndims, shapes);
}

extern "C" std::vector<int64_t> F16WeightMatmulTInferShape(int *ndims, int64_t **shapes,
                                                           AotExtra *) {
  return transposed_shape(ndims, shapes);
}

extern "C" std::vector<int64_t> BF16WeightMatmulTInferShape(int *ndims, int64_t **shapes,
                                                            AotExtra *) {
  return transposed_shape(ndims, shapes);
}

// x (rows, in) f32, weight (out, in) f16 / bf16 -> (rows, out) f32, or (out, rows) for T
extern "C" int F16WeightMatmul(int, void **params, int *ndims, int64_t **shapes, const char **,
                               void *, void *) {
  return half_weight_matmul<F16Weights>(params, ndims, shapes, false);
}

extern "C" int BF16WeightMatmul(int, void **params, int *ndims, int64_t **shapes, const char **,
                                void *, void *) {
  return half_weight_matmul<BF16Weights>(params, ndims, shapes, false);
}

extern "C" int F16WeightMatmulT(int, void **params, int *ndims, int64_t **shapes,
                                const char **, void *, void *) {
  return half_weight_matmul<F16Weights>(params, ndims, shapes, true);
}

extern "C" int BF16WeightMatmulT(int, void **params, int *ndims, int64_t **shapes,
                                 const char **, void *, void *) {
  return half_weight_matmul<BF16Weights>(params, ndims, shapes, true);
}

extern "C" std::vector<int64_t> F16RowsInferShape(int *ndims, int64_t **shapes, AotExtra *) {
  return rows_shape(ndims, shapes);
}

extern "C" std::vector<int64_t> BF16RowsInferShape(int *ndims, int64_t **shapes, AotExtra *) {
  return rows_shape(ndims, shapes);
}

// table (vocab, width) f16 / bf16, ids (...) i32 in [0, vocab) -> (..., width) f32; an id
// outside the table fails the op
extern "C" int F16Rows(int, void **params, int *ndims, int64_t **shapes, const char **, void *,
                       void *) {
  return rows_of<uint16_t>(params, shapes, ndims, f16_to_float);
}

extern "C" int BF16Rows(int, void **params, int *ndims, int64_t **shapes, const char **, void *,
                        void *) {
  return rows_of<uint16_t>(params, shapes, ndims, bf16_to_float);
}
