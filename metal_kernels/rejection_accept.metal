// rejection_accept — fused rejection-sampling acceptance for speculative decoding, from log-probabilities (body for
// mx.fast.metal_kernel).
//
// inputs : p [k+1, V] (TP) target log-probs (after sampling.process), q [k, V] (TQ) draft log-probs (the
//          distributions the drafts were sampled from; a 1-element dummy when k = 0), drafts [max(k,1)] int32,
//          u [k+1] float32 uniforms in [0, 1), meta [2] int32 = (k, V)
// outputs: out [2] int32 = (n_accepted, next_token)
// launch : one threadgroup, grid = threadgroup = (NT, 1, 1), NT a multiple of 32 in [32, 1024]
//
// Math (glimmer_mlx.kernels.accept.rejection_accept_reference_logprobs computes the same in MLX ops):
//   P = exp(float(p)), Q = exp(float(q)) elementwise (metal::precise::exp, which is MLX's own Exp on the GPU)
//   draft j is accepted iff u[j] * Q[j, d_j] <= P[j, d_j]   (probability min(1, P/Q));  n = leading accepts
//   weight(r) = r > 0 ? trunc(min(r, 1) * 2^38) : 0  as uint64  (NaN and negative weigh 0)
//   w_i = weight(P[n,i] - Q[n,i]) if n < k (residual) else weight(P[k,i]) (bonus);
//         if n < k and sum(w) == 0 (P_n <= Q_n everywhere, up to 2^-38), w_i = weight(P[n,i])
//   draw   t = (trunc(u[k] * 2^24) * W) >> 24 with W = sum(w)   (exact integers: order-independent sums; t < W)
//   next   = smallest i with w_0 + ... + w_i > t (inverse CDF; never a zero-weight token), 0 if W == 0
// Rows must be normalised distributions (sum(P) <= 1 + 2^-20), as processed log-probs are.
// Only what is needed is exponentiated: 2k entries for the acceptance and row n (and Q's row n after a
// rejection) — twice, once for the sums, once more for the segment holding the draw.
//
// Parallel layout: the row is cut into one contiguous segment per simdgroup; inside a segment lane l reads
// l, l + 32, l + 64, … (each simdgroup's reads are 32 consecutive elements: coalesced), so the inverse CDF stays in
// index order with simd prefix sums and one threadgroup barrier. 64-bit sums go through simd collectives as two
// 32-bit halves (bits 0-23 and 24+), which cannot overflow for weights below 2^39.

#define GLIMMER_W(r) ((r) > 0.0f ? ulong(min((r), 1.0f) * 274877906944.0f) : ulong(0))

uint lane = thread_index_in_simdgroup;
uint sg = simdgroup_index_in_threadgroup;
uint nsg = simdgroups_per_threadgroup;
const int k = meta[0];
const int V = meta[1];

// 1. accepted length: lane j < k tests draft j (each simdgroup on its own, no barrier)
int rej = k;
if (int(lane) < k) {
  int d = drafts[lane];
  float pd = metal::precise::exp(float(p[(ulong)lane * (ulong)V + d]));
  float qd = metal::precise::exp(float(q[(ulong)lane * (ulong)V + d]));
  if (!(u[lane] * qd <= pd)) {
    rej = int(lane);
  }
}
const int n = simd_min(rej);
const bool resid = n < k;
// `auto`: MLX passes an input of fewer than 8 elements (the k = 0 dummy q) in the constant address space
auto pr = p + (ulong)n * (ulong)V;
auto qr = q + (ulong)(resid ? n : 0) * (ulong)V;

// 2. per-segment sums of both weightings
const int seg = ((V + int(nsg) - 1) / int(nsg) + 31) / 32 * 32;
const int lo = min(int(sg) * seg, V);
const int hi = min(lo + seg, V);
ulong wr = 0;
ulong wp = 0;
for (int i = lo + int(lane); i < hi; i += 32) {
  float pi = metal::precise::exp(float(pr[i]));
  wp += GLIMMER_W(pi);
  if (resid) {
    float qi = metal::precise::exp(float(qr[i]));
    wr += GLIMMER_W(pi - qi);
  }
}
ulong seg_p = (ulong(simd_sum(uint(wp >> 24))) << 24) + ulong(simd_sum(uint(wp & 0xffffff)));
ulong seg_r = (ulong(simd_sum(uint(wr >> 24))) << 24) + ulong(simd_sum(uint(wr & 0xffffff)));
threadgroup ulong tg_p[32];
threadgroup ulong tg_r[32];
if (lane == 0) {
  tg_p[sg] = seg_p;
  tg_r[sg] = seg_r;
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// 3. the draw: totals, then the segment that holds t
ulong Wp = 0;
ulong Wr = 0;
for (uint s = 0; s < nsg; s++) {
  Wp += tg_p[s];
  Wr += tg_r[s];
}
const bool use_r = resid && Wr > 0;
const ulong W = use_r ? Wr : Wp;
const ulong t = (ulong(u[k] * 16777216.0f) * W) >> 24;  // 2^24
int tseg = -1;
ulong base = 0;
ulong tbase = 0;
for (uint s = 0; s < nsg; s++) {
  ulong w = use_r ? tg_r[s] : tg_p[s];
  if (tseg < 0 && t < base + w) {
    tseg = int(s);
    tbase = base;
  }
  base += w;
}
if (sg == 0 && lane == 0) {
  out[0] = n;
  if (W == 0) {
    out[1] = 0;
  }
}

// 4. inside that segment, 32 elements at a time: inclusive prefix sums find the first cumulative weight > t
if (int(sg) == tseg) {
  ulong acc = tbase;
  for (int i0 = lo; i0 < hi; i0 += 32) {
    int i = i0 + int(lane);
    ulong w = 0;
    if (i < hi) {
      float pi = metal::precise::exp(float(pr[i]));
      w = use_r ? GLIMMER_W(pi - metal::precise::exp(float(qr[i]))) : GLIMMER_W(pi);
    }
    ulong incl = (ulong(simd_prefix_inclusive_sum(uint(w >> 24))) << 24) +
                 ulong(simd_prefix_inclusive_sum(uint(w & 0xffffff)));
    ulong total = (ulong(simd_sum(uint(w >> 24))) << 24) + ulong(simd_sum(uint(w & 0xffffff)));
    if (acc + total > t) {  // uniform across the simdgroup
      if (acc + incl - w <= t && t < acc + incl) {
        out[1] = i;
      }
      break;
    }
    acc += total;
  }
}
#undef GLIMMER_W
