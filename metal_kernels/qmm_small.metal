// qmm_small — small-row affine-quantized matmul y = x @ dequant(Wq)^T (body for mx.fast.metal_kernel).
//
// Every packed weight word is read once and applied to all M rows of x (M <= 16), instead of once per row.
// inputs : x [M, K] (T), w [N, K*BITS/32] uint32 (MLX affine packing: value e of a word is (word >> BITS*e) & mask),
//          scales [N, K/GS] (T), biases [N, K/GS] (T), meta [3] int32 = (M, N, K)
// template: T (dtype), M (rows, 1..16), BITS (4 or 8), GS (group size 32, 64 or 128)
// outputs: y [M, N] (T)
// launch : grid (32, N, 1), threadgroup (32, 4, 1): one simdgroup per output column
// w_k = scale_g * q_k + bias_g is formed in float32; accumulation in float32; one rounding to T at the end.

constexpr int PER = 32 / BITS;  // values per uint32
constexpr uint MASK = (1u << BITS) - 1u;
uint lane = thread_index_in_simdgroup;
uint n = thread_position_in_grid.y;
const int N = meta[1];
const int K = meta[2];
const int WPR = K / PER;  // words per weight row
const int GPR = K / GS;   // groups per weight row
float acc[M];
for (int r = 0; r < M; r++) {
  acc[r] = 0.0f;
}
const device uint32_t* wr = w + (ulong)n * WPR;
for (int wi = int(lane); wi < WPR; wi += 32) {
  uint word = wr[wi];
  int k0 = wi * PER;
  int g = k0 / GS;
  float sc = float(scales[(ulong)n * GPR + g]);
  float bi = float(biases[(ulong)n * GPR + g]);
  float wv[PER];
  for (int e = 0; e < PER; e++) {
    wv[e] = sc * float((word >> (BITS * e)) & MASK) + bi;
  }
  for (int r = 0; r < M; r++) {
    const device T* xr = x + (ulong)r * K + k0;
    float a = 0.0f;
    for (int e = 0; e < PER; e++) {
      a += float(xr[e]) * wv[e];
    }
    acc[r] += a;
  }
}
for (int r = 0; r < M; r++) {
  float t = simd_sum(acc[r]);
  if (lane == 0) {
    y[(ulong)r * N + n] = T(t);
  }
}
