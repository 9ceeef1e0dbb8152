// One activation row times a weight stored (out, in), as the checkpoint stores it:
// y[o] = sum_i x[i] * w[o, i]. Batch-1 decode on CPU is a read of every weight once; this
// loop streams each weight row once and reaches about twice the bandwidth of MindSpore's CPU
// MatMul(transpose_b=True) on the shapes where out >= in (see msinfer/cpu_kernels.py).
// A MindSpore "aot" custom op: params = {x (1, in), w (out, in), y (1, out)}.
// Threads are plain std::threads started per call (tens of microseconds): OpenMP's would
// spin between calls against MindSpore's own pool unless OMP_WAIT_POLICY was set before
// MindSpore loaded libgomp.
#include <cstdint>
#include <thread>
#include <vector>

static int g_threads = 1;

extern "C" void msinfer_set_threads(int n) { g_threads = n > 0 ? n : 1; }

static void rows(const float* x, const float* w, float* y, int64_t in, int64_t first,
                 int64_t last) {
  for (int64_t o = first; o < last; ++o) {
    const float* row = w + o * in;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < in; ++i) sum += x[i] * row[i];
    y[o] = sum;
  }
}

extern "C" int RowMatMul(int nparam, void** params, int* ndims, int64_t** shapes,
                         const char** dtypes, void* stream, void* extra) {
  if (nparam != 3 || ndims[0] != 2 || ndims[1] != 2 || shapes[0][0] != 1) return 1;
  const float* x = static_cast<const float*>(params[0]);
  const float* w = static_cast<const float*>(params[1]);
  float* y = static_cast<float*>(params[2]);
  const int64_t in = shapes[0][1], out = shapes[1][0];
  const int64_t parts = out >= 256 * g_threads ? g_threads : 1;
  std::vector<std::thread> helpers;
  for (int64_t p = 1; p < parts; ++p)
    helpers.emplace_back(rows, x, w, y, in, out * p / parts, out * (p + 1) / parts);
  rows(x, w, y, in, 0, out / parts);
  for (auto& t : helpers) t.join();
  return 0;
}
