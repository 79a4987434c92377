// rejection_accept — fused rejection-sampling acceptance for speculative decoding (body for mx.fast.metal_kernel).
//
// inputs : p [k+1, V] float32 target probabilities (after sampling.process + exp)
//          q [max(k,1), V] float32 draft probabilities (the distributions the drafts were sampled from)
//          drafts [max(k,1)] int32, u [k+1] float32 uniforms in [0, 1), meta [2] int32 = (k, V)
// outputs: out [2] int32 = (n_accepted, next_token)
// launch : one threadgroup, grid = threadgroup = (NT, 1, 1), NT a power of two in [32, 1024]
//
// Math (identical to glimmer_mlx.kernels.accept.rejection_accept_reference, bit for bit):
//   draft j is accepted iff u[j] * q[j, d_j] <= p[j, d_j]   (probability min(1, p/q));  n = leading accepts
//   weights  w_i = trunc(r_i * 2^38) as uint64, with r = max(0, p_n - q_n) if n < k (residual) else p_k (bonus);
//            if n < k and sum(w) == 0 (p_n == q_n up to 2^-38), w_i = trunc(p_n,i * 2^38)
//   draw     t = (trunc(u[k] * 2^24) * W) >> 24 with W = sum(w)   (exact integers: order-independent sums)
//   next     = smallest i with w_0 + ... + w_i > t                (inverse CDF)
// Integer weights make every sum exact, so any reduction order (threads, simdgroups, MLX's reference ops on CPU
// or GPU) gives the same token; the float work is one multiply-compare per draft and one subtract per element.

uint tid = thread_index_in_threadgroup;
uint nt = threads_per_threadgroup.x;
const int k = meta[0];
const int V = meta[1];

int n = 0;
while (n < k) {
  int d = drafts[n];
  float pd = p[(ulong)n * (ulong)V + d];
  float qd = q[(ulong)n * (ulong)V + d];
  if (!(u[n] * qd <= pd)) {
    break;
  }
  n++;
}
const bool resid = n < k;
const device float* pr = p + (ulong)n * (ulong)V;
const device float* qr = q + (ulong)(resid ? n : 0) * (ulong)V;

// each thread owns a contiguous chunk, so thread order is index order for the inverse CDF
const int chunk = (V + int(nt) - 1) / int(nt);
const int lo = min(int(tid) * chunk, V);
const int hi = min(lo + chunk, V);
ulong wr = 0;
ulong wp = 0;
for (int i = lo; i < hi; i++) {
  float pi = pr[i];
  wp += ulong(pi * 274877906944.0f);  // 2^38
  if (resid) {
    wr += ulong(max(pi - qr[i], 0.0f) * 274877906944.0f);
  }
}

threadgroup ulong sr[1024];
threadgroup ulong sp[1024];
threadgroup int found[1];
sr[tid] = wr;
sp[tid] = wp;
if (tid == 0) {
  found[0] = 0;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
// inclusive scan of the per-thread sums (Hillis-Steele)
for (uint off = 1; off < nt; off <<= 1) {
  ulong ar = tid >= off ? sr[tid - off] : 0;
  ulong ap = tid >= off ? sp[tid - off] : 0;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  sr[tid] += ar;
  sp[tid] += ap;
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
const bool use_r = resid && sr[nt - 1] > 0;
const ulong W = use_r ? sr[nt - 1] : sp[nt - 1];
const ulong t = (ulong(u[k] * 16777216.0f) * W) >> 24;  // 2^24
const ulong incl = use_r ? sr[tid] : sp[tid];
const ulong excl = incl - (use_r ? wr : wp);
if (excl <= t && t < incl) {
  ulong acc = excl;
  for (int i = lo; i < hi; i++) {
    float pi = pr[i];
    acc += use_r ? ulong(max(pi - qr[i], 0.0f) * 274877906944.0f) : ulong(pi * 274877906944.0f);
    if (acc > t) {
      found[0] = i;
      break;
    }
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (tid == 0) {
  out[0] = n;
  out[1] = found[0];
}
