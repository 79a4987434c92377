// block_attention_combine — pass 2 of block-verify attention (body for mx.fast.metal_kernel): merges the S
// per-chunk online-softmax states of block_attention_partial.
//
// inputs : o_part [Hq, S, L, D] float32, ml [Hq, S, L, 2] float32, meta [8] int32 (as in pass 1)
// template: T (output dtype), D (head dim, a multiple of 32, <= 256)
// outputs: out [Hq, L, D] (T)
// launch : grid (32, Hq, L), threadgroup (32, 1, 1)

constexpr int DPL = D / 32;
uint lane = thread_index_in_simdgroup;
uint h = threadgroup_position_in_grid.y;
uint i = threadgroup_position_in_grid.z;
const int L = meta[0];
const int S = meta[7];
float M = -INFINITY;
for (int s = 0; s < S; s++) {
  M = max(M, ml[(((ulong)h * S + s) * L + i) * 2]);
}
float den = 0.0f;
float acc[DPL];
for (int e = 0; e < DPL; e++) {
  acc[e] = 0.0f;
}
for (int s = 0; s < S; s++) {
  ulong row = ((ulong)h * S + s) * L + i;
  float ms = ml[row * 2];
  if (ms == -INFINITY) {
    continue;  // a chunk this row sees no key of
  }
  float c = metal::exp(ms - M);
  den += c * ml[row * 2 + 1];
  for (int e = 0; e < DPL; e++) {
    acc[e] += c * o_part[row * D + lane * DPL + e];
  }
}
for (int e = 0; e < DPL; e++) {
  out[((ulong)h * L + i) * D + lane * DPL + e] = T(acc[e] / den);
}
