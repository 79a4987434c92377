// qmm_small — small-M affine-quantized matmul y = x @ dequant(Wq)^T with simdgroup_matrix tiles (body for
// mx.fast.metal_kernel), for the M = k+1 <= 16 rows of a verification forward.
//
// Computed as yᵀ = W · xᵀ in 8x8 tiles: A = an 8(n) x 8(k) tile of dequantized weights, B = an 8(k) x 8(m) tile of
// xᵀ, one or two m-tiles (M <= 8 or <= 16), so every packed weight word is read once for all M rows.
// The contraction order inside a 32-value block is permuted so that each lane's A elements over the block's four
// k-tiles are the 8 consecutive values of ONE 4-bit word (two words at 8 bits): lane (fr, fc) owns A(n = fr,
// kk = fc, fc+1) of tile t, and kk of tile t stands for k = k0 + (kk/2)*8 + 2t + kk%2 — applied alike to B, so the
// product is unchanged. The 32 lanes of a simdgroup read 8 weight rows x 16 contiguous bytes per block (4-bit).
// A threadgroup owns 8 output columns; its NSG simdgroups split K (blocks sg, sg+NSG, ...) and add their partial
// tiles through threadgroup memory at the end.
//
// inputs : x [M, K] (T), w [N, K*BITS/32] uint32 (MLX affine packing: value e of a word is (word >> BITS*e) & mask),
//          scales [N, K/GS] (T), biases [N, K/GS] (T), meta [3] int32 = (M, N, K)
// template: T (dtype), M (rows, 1..16), BITS (4 or 8), GS (group size 32, 64 or 128)
// outputs: y [M, N] (T)
// launch : grid (32*4, ceil(N/8), 1), threadgroup (32*4, 1, 1)
// w_k = scale_g * q_k + bias_g in float32, products and sums in float32, one rounding to T at the end.

constexpr int NSG = 4;
constexpr int MT = (M + 7) / 8;   // 8-row tiles of x
constexpr int PER = 32 / BITS;    // values per uint32
constexpr int WPB = 32 / PER;     // words per 32-value block of a weight row
constexpr int WPL = 8 / PER;      // words per lane per block (its 8 values)
constexpr uint MASK = (1u << BITS) - 1u;

const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint tid = thread_index_in_threadgroup;
const int N = meta[1];
const int K = meta[2];
const int n0 = int(threadgroup_position_in_grid.y) * 8;
const int fr = int(((lane / 4) & 4) + (lane / 2) % 4);  // fragment row (Apple's simdgroup_matrix layout)
const int fc = int(((lane / 4) & 2) * 2 + (lane % 2) * 2);  // first fragment column
const int nrow = min(n0 + fr, N - 1);  // weight row of this lane's A elements (past N: clamped, result dropped)
const int WPR = K / PER;  // words per weight row
const int GPR = K / GS;   // groups per weight row
const int KB = K / 32;    // 32-value blocks per row
const device uint32_t* wr = w + (ulong)nrow * WPR + (fc / 2) * WPL;
const device T* sr = scales + (ulong)nrow * GPR;
const device T* br = biases + (ulong)nrow * GPR;
// B = xᵀ: this lane's elements are (kk = fr, m = mt*8 + fc + e), i.e. x[m][k0 + kx_off + 2t]
const int kx_off = (fr / 2) * 8 + (fr % 2);

simdgroup_matrix<float, 8, 8> acc[MT];
for (int mt = 0; mt < MT; mt++) {
  acc[mt] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
}
for (int b = int(sg); b < KB; b += NSG) {
  const int k0 = b * 32;
  const float sc = float(sr[k0 / GS]);
  const float bi = float(br[k0 / GS]);
  uint words[WPL];
  for (int u = 0; u < WPL; u++) {
    words[u] = wr[b * WPB + u];
  }
  float wv[8];
  for (int e = 0; e < 8; e++) {
    wv[e] = sc * float((words[e / PER] >> (BITS * (e % PER))) & MASK) + bi;
  }
  for (int t = 0; t < 4; t++) {
    simdgroup_matrix<float, 8, 8> A;
    A.thread_elements()[0] = wv[2 * t];
    A.thread_elements()[1] = wv[2 * t + 1];
    const int kx = k0 + kx_off + 2 * t;
    for (int mt = 0; mt < MT; mt++) {
      simdgroup_matrix<float, 8, 8> B;
      for (int e = 0; e < 2; e++) {
        const int m = mt * 8 + fc + e;
        B.thread_elements()[e] = m < M ? float(x[(ulong)m * K + kx]) : 0.0f;
      }
      simdgroup_multiply_accumulate(acc[mt], A, B, acc[mt]);
    }
  }
}
// add the NSG partial tiles (each [8 n][8 m]) and write y[m][n0 .. n0+7]
threadgroup float red[NSG * MT * 64];
for (int mt = 0; mt < MT; mt++) {
  simdgroup_store(acc[mt], red + (int(sg) * MT + mt) * 64, 8);
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (int e = int(tid); e < MT * 64; e += NSG * 32) {
  const int mt = e / 64;
  const int mm = (e / 8) % 8;
  const int nn = e % 8;
  float s = 0.0f;
  for (int g = 0; g < NSG; g++) {
    s += red[(g * MT + mt) * 64 + nn * 8 + mm];
  }
  const int m = mt * 8 + mm;
  const int n = n0 + nn;
  if (m < M && n < N) {
    y[(ulong)m * N + n] = T(s);
  }
}
