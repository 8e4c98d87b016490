// XPU-OJ submission for silu_scale: y = silu(x) * alpha, bf16 in and out, fp32 math.
#include <cuda_bf16.h>
#include <stdint.h>

__global__ void silu_scale_kernel(const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ y, int64_t n,
                                  float alpha) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const float v = __bfloat162float(x[i]);
    y[i] = __float2bfloat16_rn(v / (1.0f + __expf(-v)) * alpha);
  }
}

extern "C" void run_kernel(const __nv_bfloat16* x, __nv_bfloat16* y, int64_t T, int64_t H, float alpha) {
  const int64_t n = T * H;
  if (n <= 0) return;
  const int threads = 256;
  const int64_t blocks = (n + threads - 1) / threads;
  silu_scale_kernel<<<(unsigned)(blocks < 4096 ? blocks : 4096), threads>>>(x, y, n, alpha);
}
