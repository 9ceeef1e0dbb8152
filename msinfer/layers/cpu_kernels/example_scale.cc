// A minimal kernel, used by tests/models/test_cpu_kernels.py to check the build and the
// aot contract (static and dynamic shapes): y = x * s, s a float32 per last-axis column.
#include <cstdint>
#include <vector>

class AotExtra;

extern "C" std::vector<int64_t> ScaleColumnsInferShape(int *ndims, int64_t **shapes, AotExtra *) {
  return std::vector<int64_t>(shapes[0], shapes[0] + ndims[0]);
}

extern "C" int ScaleColumns(int, void **params, int *ndims, int64_t **shapes, const char **,
                            void *, void *) {
  const float *x = static_cast<const float *>(params[0]);
  const float *s = static_cast<const float *>(params[1]);
  float *y = static_cast<float *>(params[2]);
  const int64_t cols = shapes[0][ndims[0] - 1];
  int64_t rows = 1;
  for (int i = 0; i < ndims[0] - 1; i++) rows *= shapes[0][i];
  #pragma omp parallel for
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = 0; c < cols; c++) y[r * cols + c] = x[r * cols + c] * s[c];
  return 0;
}
