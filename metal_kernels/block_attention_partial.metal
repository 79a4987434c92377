// block_attention_partial — pass 1 of block-verify attention (body for mx.fast.metal_kernel).
//
// L <= 16 query rows (the anchor and k drafts) of every query head against a KV cache of N rows, split along the
// keys into S chunks of SS rows; one simdgroup per (query head, chunk) keeps an online softmax for all L rows, so
// each key / value row is read once per query head and chunk, whatever L is.
//
// inputs : q [Hq, L, D] (T, RoPE and QK-norm already applied), k [Hkv, N, D] (T), v [Hkv, N, D] (T), all three
//          addressed through their strides (built with ensure_row_contiguous=False: views of the KV cache's buffer
//          are read in place, not copied)
//          meta [8] int32 = (L, N, Hq, Hkv, qk, W, SS, S)   qk = absolute position of query 0 minus that of key 0
//                                                          W = sliding window (0 = global)
//          fmeta [1] float32 = (softmax scale)
// template: T (dtype), D (head dim, a multiple of 32, <= 256)
// outputs: o_part [Hq, S, L, D] float32 (unnormalised), ml [Hq, S, L, 2] float32 (running max, running sum)
// launch : grid (32, Hq, S), threadgroup (32, 1, 1)
// mask   : query i sees key j iff j <= qk + i (causal inside the block) and (W == 0 or j > qk + i - W)

constexpr int DPL = D / 32;  // head-dim elements per lane
uint lane = thread_index_in_simdgroup;
uint h = threadgroup_position_in_grid.y;
uint s = threadgroup_position_in_grid.z;
const int L = meta[0];
const int N = meta[1];
const int Hq = meta[2];
const int Hkv = meta[3];
const int qk = meta[4];
const int W = meta[5];
const int SS = meta[6];
const int S = meta[7];
const float scale = fmeta[0];
const int kvh = int(h) / (Hq / Hkv);
const long qs0 = q_strides[0], qs1 = q_strides[1], qs2 = q_strides[2];
const long ks0 = k_strides[0], ks1 = k_strides[1], ks2 = k_strides[2];
const long vs0 = v_strides[0], vs1 = v_strides[1], vs2 = v_strides[2];

float qr[16][DPL];
float o[16][DPL];
float m[16];
float l[16];
for (int i = 0; i < 16; i++) {
  m[i] = -INFINITY;
  l[i] = 0.0f;
  for (int e = 0; e < DPL; e++) {
    qr[i][e] = i < L ? float(q[h * qs0 + i * qs1 + (lane * DPL + e) * qs2]) * scale : 0.0f;
    o[i][e] = 0.0f;
  }
}
// keys any row of the block can see
int lo = int(s) * SS;
int hi = min(lo + SS, N);
hi = min(hi, qk + L);
if (W > 0) {
  lo = max(lo, qk - W + 1);
}
for (int j = lo; j < hi; j++) {
  const device T* kr = k + kvh * ks0 + j * ks1 + lane * DPL * ks2;
  const device T* vr = v + kvh * vs0 + j * vs1 + lane * DPL * vs2;
  float kk[DPL];
  float vv[DPL];
  for (int e = 0; e < DPL; e++) {
    kk[e] = float(kr[e * ks2]);
    vv[e] = float(vr[e * vs2]);
  }
  for (int i = 0; i < L; i++) {
    if (j > qk + i || (W > 0 && j <= qk + i - W)) {
      continue;  // uniform across the simdgroup
    }
    float dot = 0.0f;
    for (int e = 0; e < DPL; e++) {
      dot += qr[i][e] * kk[e];
    }
    dot = simd_sum(dot);
    float mn = max(m[i], dot);
    float c = metal::exp(m[i] - mn);
    float pj = metal::exp(dot - mn);
    l[i] = l[i] * c + pj;
    for (int e = 0; e < DPL; e++) {
      o[i][e] = o[i][e] * c + pj * vv[e];
    }
    m[i] = mn;
  }
}
for (int i = 0; i < L; i++) {
  ulong row = ((ulong)h * S + s) * L + i;
  for (int e = 0; e < DPL; e++) {
    o_part[row * D + lane * DPL + e] = o[i][e];
  }
  if (lane == 0) {
    ml[row * 2] = m[i];
    ml[row * 2 + 1] = l[i];
  }
}
