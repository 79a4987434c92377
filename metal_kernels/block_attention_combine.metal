// block_attention_combine — pass 2 of block-verify attention (body for mx.fast.metal_kernel): merges the S
// per-chunk online-softmax states of block_attention_partial with a running max (one pass over the chunks).
//
// inputs : o_part [Hkv, S, RP, D] float32, ml [Hkv, S, RP, 2] float32 (max in base-2 units, sum), meta [5] int32
//          (as in pass 1; S = meta[4])
// template: T (output dtype), D (head dim, a multiple of 32), L (rows per head), G (query heads per KV head),
//           RP (padded rows per group and chunk, 8*ceil(G*L/8))
// outputs: out [Hq, L, D] (T)
// launch : grid (32, Hq, L), threadgroup (32, 1, 1): one simdgroup per output row, each lane D/32 consecutive
//          elements (unit-stride loads)

constexpr int DPL = D / 32;
const uint lane = thread_index_in_simdgroup;
const uint h = threadgroup_position_in_grid.y;
const uint i = threadgroup_position_in_grid.z;
const int S = meta[4];
const ulong kvh = h / G;
const ulong r = (h % G) * L + i;  // row of the group's padded [RP] rows
float m = -INFINITY;
float den = 0.0f;
float acc[DPL];
for (int e = 0; e < DPL; e++) {
  acc[e] = 0.0f;
}
for (int s = 0; s < S; s++) {
  const ulong row = (kvh * S + s) * RP + r;
  const float ms = ml[row * 2];
  if (ms == -INFINITY) {
    continue;  // a chunk this row sees no key of
  }
  const float mn = max(m, ms);
  const float a = exp2(m - mn);  // 0 while m is -inf
  const float b = exp2(ms - mn);
  den = den * a + b * ml[row * 2 + 1];
  const device float* op = o_part + row * D + lane * DPL;
  for (int e = 0; e < DPL; e++) {
    acc[e] = acc[e] * a + b * op[e];
  }
  m = mn;
}
device T* dst = out + ((ulong)h * L + i) * D + lane * DPL;
for (int e = 0; e < DPL; e++) {
  dst[e] = T(acc[e] / den);
}
