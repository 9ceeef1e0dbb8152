// The routed experts of a sparse MoE layer (layers/moe.py) on CPU, reading the stacked expert
// weights where they lie: MindSpore 2.10's CPU ops can only copy the routed experts' slices
// out (ops.Gather) before multiplying, which costs a decode step as much as the products.
//
// MoeExperts(x (T, H), ids (T, k) int32, weights (T, k), gate_up (E, 2I, H), down (E, I, H),
//            threads (1,) int32) -> y (T, H)
//   y[t] = sum_j weights[t, j] * down[e]^T (silu(gate[e] x[t]) * up[e] x[t]), e = ids[t, j],
// gate[e] the first I rows of gate_up[e], up[e] the next I; ids outside [0, E) are experts
// this rank does not hold and add nothing. x, weights, the experts and y are all float32 or
// all float16 (float16 is computed in float32). The pairs (t, j) are grouped by expert, so an
// expert routed by several tokens of the call is read once for all of them: gate/up by row
// pairs (one dot product per token), then down by blocks of the output's columns (a work
// item each: no two threads write one element, and the sums run in a fixed order).
// `threads`: how many threads compute, MindSpore's CPU pool's count (ranks sharing a host
// each take their share): this one and workers of a pool of the kernel's own (`Pool`).
// Which thread computes which part changes no number.
#include <sched.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

class AotExtra;

namespace {

using half = _Float16;

#if defined(__AVX512F__)
constexpr int W = 16;  // float lanes of a vector
using vec = __m512;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float *p) { return _mm512_loadu_ps(p); }
inline vec vload(const half *p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)));
}
inline void vstore(float *p, vec a) { _mm512_storeu_ps(p, a); }
inline vec vset1(float a) { return _mm512_set1_ps(a); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int W = 8;
using vec = __m256;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float *p) { return _mm256_loadu_ps(p); }
inline vec vload(const half *p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
}
inline void vstore(float *p, vec a) { _mm256_storeu_ps(p, a); }
inline vec vset1(float a) { return _mm256_set1_ps(a); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
constexpr int W = 1;
using vec = float;
inline vec vzero() { return 0.0f; }
inline vec vload(const float *p) { return *p; }
inline vec vload(const half *p) { return static_cast<float>(*p); }
inline void vstore(float *p, vec a) { *p = a; }
inline vec vset1(float a) { return a; }
inline vec vfma(vec a, vec b, vec c) { return a * b + c; }
inline float vsum(vec a) { return a; }
#endif

#if defined(__x86_64__) || defined(__i386__)
inline void Relax() { _mm_pause(); }
#else
inline void Relax() { std::this_thread::yield(); }
#endif

constexpr int MAX_TILE = 4;            // tokens of one expert multiplied together
constexpr int64_t ROW_BLOCK = 16;      // gate/up row pairs per work item
constexpr int64_t CHUNK_TOKENS = 256;  // tokens per pass: bounds the activations' buffer
constexpr int64_t COLUMN_BLOCK = 128;  // down's output columns per work item

// Threads for the kernel's two passes of work items, instead of OpenMP's: libgomp's idle
// threads spin ~300,000 rounds before they sleep, which on a host of few cores takes the cores
// MindSpore's next ops run on (a decode step ran 4x slower on 2 busy cores). Here an idle
// worker spins 20 us, then sleeps; and items go to whichever thread claims them first, so a
// worker late to wake, or descheduled on a busy host, holds a call up by no more than the
// items it has claimed.
class Pool {
 public:
  using Item = std::function<void(int64_t)>;

  // first(i) for i in [0, n1), then, once all of them are done, second(i) for i in [0, n2),
  // on this thread and threads - 1 workers. One call at a time.
  void Run(int threads, int64_t n1, int64_t n2, const Item &first, const Item &second) {
    if (threads <= 1 || n1 + n2 <= 1 || n1 + n2 >= 1 << 24) {  // the ticket counts 24 bits
      for (int64_t i = 0; i < n1; i++) first(i);
      for (int64_t i = 0; i < n2; i++) second(i);
      return;
    }
    std::lock_guard<std::mutex> call(call_);
    while (static_cast<int>(workers_.size()) < threads - 1) {
      const int index = static_cast<int>(workers_.size());
      workers_.emplace_back([this, index] { Work(index); });
      workers_.back().detach();
    }
    first_ = &first;
    second_ = &second;
    n1_ = n1;
    helpers_ = threads - 1;
    done_.store(0);
    const uint64_t gen = (Gen(ticket_.load()) + 1) & 0xffff;
    ticket_.store(gen << 48 | static_cast<uint64_t>(n1 + n2) << 24);
    if (sleepers_.load() > 0) {
      { std::lock_guard<std::mutex> lock(mutex_); }
      wake_.notify_all();
    }
    int64_t item;
    while (Claim(gen, &item)) Do(item);
    Wait(n1 + n2);
  }

 private:
  static uint64_t Gen(uint64_t t) { return t >> 48; }

  // Item `next` of generation `gen` (ticket: generation 16 bits, items 24, next 24), if left.
  bool Claim(uint64_t gen, int64_t *item) {
    uint64_t t = ticket_.load();
    for (;;) {
      const uint64_t total = t >> 24 & 0xffffff, next = t & 0xffffff;
      if (Gen(t) != gen || next >= total) return false;
      if (ticket_.compare_exchange_weak(t, t + 1)) {
        *item = static_cast<int64_t>(next);
        return true;
      }
    }
  }

  void Do(int64_t item) {
    if (item < n1_) {
      (*first_)(item);
    } else {
      Wait(n1_);  // the second pass reads what the first wrote
      (*second_)(item - n1_);
    }
    done_.fetch_add(1);
  }

  void Wait(int64_t items) {
    for (int spins = 0; done_.load() < items; spins++) {
      if (spins < 2000) Relax();
      else sched_yield();  // a busy host: let the thread holding an item run
    }
  }

  void Work(int index) {
    uint64_t seen = 0;
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(20);
      while (Gen(ticket_.load()) == seen && std::chrono::steady_clock::now() < until)
        Relax();
      if (Gen(ticket_.load()) == seen) {
        std::unique_lock<std::mutex> lock(mutex_);
        sleepers_.fetch_add(1);
        wake_.wait(lock, [&] { return Gen(ticket_.load()) != seen; });
        sleepers_.fetch_sub(1);
      }
      seen = Gen(ticket_.load());
      if (index >= helpers_.load()) continue;  // this call wants fewer threads
      int64_t item;
      while (Claim(seen, &item)) Do(item);
    }
  }

  std::mutex call_, mutex_;
  std::condition_variable wake_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0}, helpers_{0};
  const Item *first_ = nullptr, *second_ = nullptr;
  int64_t n1_ = 0;
};

Pool &ThePool() {
  static Pool *pool = new Pool;  // never destroyed: its workers live as long as the process
  return *pool;
}

// gate and up rows' dot products with N tokens' x rows (float32).
template <int N, typename T>
inline void GateUpRows(const T *g, const T *u, const float *const *x, int64_t h, float *gs,
                       float *us) {
  vec ag[N], au[N];
  for (int n = 0; n < N; n++) ag[n] = au[n] = vzero();
  int64_t c = 0;
  for (; c + W <= h; c += W) {
    const vec wg = vload(g + c), wu = vload(u + c);
    for (int n = 0; n < N; n++) {
      const vec xv = vload(x[n] + c);
      ag[n] = vfma(wg, xv, ag[n]);
      au[n] = vfma(wu, xv, au[n]);
    }
  }
  for (int n = 0; n < N; n++) {
    gs[n] = vsum(ag[n]);
    us[n] = vsum(au[n]);
    for (int64_t r = c; r < h; r++) {
      gs[n] += static_cast<float>(g[r]) * x[n][r];
      us[n] += static_cast<float>(u[r]) * x[n][r];
    }
  }
}

// y[n][0, CV*W) += w[n] * sum_i a[n][i] * d[i*h + 0, CV*W) for N pairs of one expert.
template <int N, int CV, typename T>
inline void DownColumns(const float *const *a, const T *d, int64_t rows, int64_t h,
                        float *const *y, const float *w) {
  vec acc[N][CV];
  for (int n = 0; n < N; n++)
    for (int v = 0; v < CV; v++) acc[n][v] = vzero();
  for (int64_t i = 0; i < rows; i++) {
    const T *row = d + i * h;
    vec dv[CV];
    for (int v = 0; v < CV; v++) dv[v] = vload(row + v * W);
    for (int n = 0; n < N; n++) {
      const vec av = vset1(a[n][i]);
      for (int v = 0; v < CV; v++) acc[n][v] = vfma(av, dv[v], acc[n][v]);
    }
  }
  for (int n = 0; n < N; n++) {
    const vec wv = vset1(w[n]);
    for (int v = 0; v < CV; v++) vstore(y[n] + v * W, vfma(wv, acc[n][v], vload(y[n] + v * W)));
  }
}

// Columns [c, c1) of N pairs' down products: register tiles of CV vectors, then of fewer
// (each tile one pass over the expert's rows: the widest that fits, for independent sums).
template <int N, int CV, typename T>
inline void DownVectors(const float *const *a, const T *d, int64_t rows, int64_t h,
                        float *const *y, const float *w, int64_t &c, int64_t c1) {
  float *yt[N];
  for (; c + CV * W <= c1; c += CV * W) {
    for (int n = 0; n < N; n++) yt[n] = y[n] + c;
    DownColumns<N, CV>(a, d + c, rows, h, yt, w);
  }
  if constexpr (CV > 1) DownVectors<N, CV / 2>(a, d, rows, h, y, w, c, c1);
}

// Columns [c0, c1) of N pairs' down products: whole vectors, then the columns short of one.
template <int N, typename T>
void DownBlock(const float *const *a, const T *d, int64_t rows, int64_t h, float *const *y,
               const float *w, int64_t c0, int64_t c1) {
  int64_t c = c0;
  DownVectors<N, 16 / N>(a, d, rows, h, y, w, c, c1);  // N x 16/N sums: half the registers
  for (; c < c1; c++)
    for (int n = 0; n < N; n++) {
      float s = 0.0f;
      for (int64_t i = 0; i < rows; i++) s += a[n][i] * static_cast<float>(d[i * h + c]);
      y[n][c] += w[n] * s;
    }
}

template <typename T>
void DownTile(int n, const float *const *a, const T *d, int64_t rows, int64_t h,
              float *const *y, const float *w, int64_t c0, int64_t c1) {
  switch (n) {
    case 1: return DownBlock<1>(a, d, rows, h, y, w, c0, c1);
    case 2: return DownBlock<2>(a, d, rows, h, y, w, c0, c1);
    case 3: return DownBlock<3>(a, d, rows, h, y, w, c0, c1);
    default: return DownBlock<4>(a, d, rows, h, y, w, c0, c1);
  }
}

template <typename T>
void GateUpTile(int n, const T *g, const T *u, const float *const *x, int64_t h, float *gs,
                float *us) {
  switch (n) {
    case 1: return GateUpRows<1>(g, u, x, h, gs, us);
    case 2: return GateUpRows<2>(g, u, x, h, gs, us);
    case 3: return GateUpRows<3>(g, u, x, h, gs, us);
    default: return GateUpRows<4>(g, u, x, h, gs, us);
  }
}

inline float Silu(float g) { return g / (1.0f + std::exp(-g)); }

struct Shapes {
  int64_t tokens, hidden, k, experts, width;
};

// Tokens [t0, t1): their (token, expert) pairs grouped by expert, then the two passes.
template <typename T>
void Chunk(const Shapes &s, const float *x, const int32_t *ids, const T *weights,
           const T *gate_up, const T *down, float *y, int64_t t0, int64_t t1, int threads) {
  const int64_t h = s.hidden, width = s.width;
  std::vector<int64_t> start(s.experts + 1, 0);
  for (int64_t p = t0 * s.k; p < t1 * s.k; p++)
    if (ids[p] >= 0 && ids[p] < s.experts) start[ids[p] + 1]++;
  for (int64_t e = 0; e < s.experts; e++) start[e + 1] += start[e];
  const int64_t pairs = start[s.experts];
  std::vector<int64_t> fill(start.begin(), start.end() - 1), token(pairs);
  std::vector<float> weight(pairs);
  for (int64_t p = t0 * s.k; p < t1 * s.k; p++) {
    const int32_t e = ids[p];
    if (e < 0 || e >= s.experts) continue;
    token[fill[e]] = p / s.k;
    weight[fill[e]++] = static_cast<float>(weights[p]);
  }
  std::vector<int64_t> active;  // the experts with pairs, in order
  for (int64_t e = 0; e < s.experts; e++)
    if (start[e + 1] > start[e]) active.push_back(e);
  if (active.empty()) return;
  std::vector<float> act(pairs * width);  // silu(gate x) * up x of each pair, by expert
  const int64_t blocks = (width + ROW_BLOCK - 1) / ROW_BLOCK;
  const int64_t items = static_cast<int64_t>(active.size()) * blocks;

  const int64_t column_blocks = (h + COLUMN_BLOCK - 1) / COLUMN_BLOCK;
  const auto gate_up_item = [&](int64_t item) {  // an expert's rows [r0, r1): act
    const int64_t e = active[item / blocks], r0 = item % blocks * ROW_BLOCK;
    const int64_t r1 = std::min(width, r0 + ROW_BLOCK);
    const T *g = gate_up + e * 2 * width * h, *u = g + width * h;
    for (int64_t r = r0; r < r1; r++)
      for (int64_t p = start[e]; p < start[e + 1]; p += MAX_TILE) {
        const int n = static_cast<int>(std::min<int64_t>(MAX_TILE, start[e + 1] - p));
        const float *xs[MAX_TILE];
        float gs[MAX_TILE], us[MAX_TILE];
        for (int j = 0; j < n; j++) xs[j] = x + token[p + j] * h;
        GateUpTile(n, g + r * h, u + r * h, xs, h, gs, us);
        for (int j = 0; j < n; j++) act[(p + j) * width + r] = Silu(gs[j]) * us[j];
      }
  };
  const auto down_item = [&](int64_t block) {  // y's columns [c0, c1), every pair's
    const int64_t c0 = block * COLUMN_BLOCK, c1 = std::min(h, c0 + COLUMN_BLOCK);
    for (int64_t e : active) {
      const T *d = down + e * width * h;
      for (int64_t p = start[e]; p < start[e + 1]; p += MAX_TILE) {
        const int n = static_cast<int>(std::min<int64_t>(MAX_TILE, start[e + 1] - p));
        const float *as[MAX_TILE];
        float *ys[MAX_TILE];
        for (int j = 0; j < n; j++) {
          as[j] = act.data() + (p + j) * width;
          ys[j] = y + token[p + j] * h;
        }
        DownTile(n, as, d, width, h, ys, weight.data() + p, c0, c1);
      }
    }
  };
  ThePool().Run(threads, items, column_blocks, gate_up_item, down_item);
}

template <typename T>
int Run(void **params, const Shapes &s, int threads) {
  const T *x = static_cast<const T *>(params[0]);
  const int32_t *ids = static_cast<const int32_t *>(params[1]);
  const T *weights = static_cast<const T *>(params[2]);
  const T *gate_up = static_cast<const T *>(params[3]);
  const T *down = static_cast<const T *>(params[4]);
  T *out = static_cast<T *>(params[6]);
  const int64_t n = s.tokens * s.hidden;
  std::vector<float> xf, yf;
  const float *x32;
  float *y32;
  if constexpr (std::is_same_v<T, float>) {
    x32 = x;
    y32 = out;
  } else {
    xf.resize(n);
    yf.resize(n);
    for (int64_t i = 0; i < n; i++) xf[i] = static_cast<float>(x[i]);
    x32 = xf.data();
    y32 = yf.data();
  }
  std::memset(y32, 0, n * sizeof(float));
  for (int64_t t0 = 0; t0 < s.tokens; t0 += CHUNK_TOKENS)
    Chunk<T>(s, x32, ids, weights, gate_up, down, y32, t0,
             std::min(s.tokens, t0 + CHUNK_TOKENS), threads);
  if constexpr (!std::is_same_v<T, float>)
    for (int64_t i = 0; i < n; i++) out[i] = static_cast<T>(yf[i]);
  return 0;
}

}  // namespace

extern "C" std::vector<int64_t> MoeExpertsInferShape(int *ndims, int64_t **shapes, AotExtra *) {
  return std::vector<int64_t>(shapes[0], shapes[0] + ndims[0]);
}

// Non-zero (MindSpore raises) on inputs of the wrong ranks, shapes or types.
extern "C" int MoeExperts(int nparam, void **params, int *ndims, int64_t **shapes,
                          const char **dtypes, void *, void *) {
  if (nparam != 7 || ndims[0] != 2 || ndims[1] != 2 || ndims[2] != 2 || ndims[3] != 3 ||
      ndims[4] != 3)
    return 1;
  const Shapes s{shapes[0][0], shapes[0][1], shapes[1][1], shapes[3][0], shapes[4][1]};
  if (shapes[1][0] != s.tokens || shapes[2][0] != s.tokens || shapes[2][1] != s.k ||
      shapes[3][1] != 2 * s.width || shapes[3][2] != s.hidden || shapes[4][0] != s.experts ||
      shapes[4][2] != s.hidden)
    return 2;
  const int threads = std::max(1, *static_cast<const int32_t *>(params[5]));
  const std::string dtype = dtypes[0];
  if (std::string(dtypes[1]) != "int32") return 3;
  if (dtype == "float32") return Run<float>(params, s, threads);
  if (dtype == "float16") return Run<half>(params, s, threads);
  return 3;
}
