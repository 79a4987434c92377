// greedy_accept — fused greedy acceptance for speculative decoding (body for mx.fast.metal_kernel).
//
// inputs : logits [k+1, V] (T), drafts [max(k,1)] int32, meta [2] int32 = (k, V)
// outputs: out [2] int32 = (n_accepted, next_token)
// launch : one threadgroup, grid = threadgroup = (NT, 1, 1), NT a multiple of 32, <= 1024
//
// Rows are processed in order; row j's argmax (first index of the maximum, as mx.argmax) is compared with
// drafts[j] and the loop stops at the first mismatch, so only n+1 rows are ever read. next_token is the argmax of
// row n (the correction, or the bonus token when every draft matched). Inputs are assumed NaN-free (softcapped
// logits are).

uint tid = thread_index_in_threadgroup;
uint lane = thread_index_in_simdgroup;
uint sg = simdgroup_index_in_threadgroup;
uint nsg = simdgroups_per_threadgroup;
uint nt = threads_per_threadgroup.x;
const int k = meta[0];
const int V = meta[1];
const int NONE = 0x7fffffff;

threadgroup float tg_val[32];
threadgroup int tg_idx[32];
threadgroup int tg_best[1];

int row = 0;
int best = 0;
for (;;) {
  const device T* x = logits + (ulong)row * (ulong)V;
  float m = -INFINITY;
  int mi = NONE;
  for (int i = int(tid); i < V; i += int(nt)) {
    float v = float(x[i]);
    if (v > m || mi == NONE) {
      m = v;
      mi = i;
    }
  }
  float sm = simd_max(m);
  int si = simd_min((m == sm) ? mi : NONE);
  if (lane == 0) {
    tg_val[sg] = sm;
    tg_idx[sg] = si;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (sg == 0) {
    float v = lane < nsg ? tg_val[lane] : -INFINITY;
    int vi = lane < nsg ? tg_idx[lane] : NONE;
    float bm = simd_max(v);
    int bi = simd_min((v == bm) ? vi : NONE);
    if (lane == 0) {
      tg_best[0] = bi;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  best = tg_best[0];
  if (row >= k || best != drafts[row]) {
    break;
  }
  row++;
}
if (tid == 0) {
  out[0] = row;
  out[1] = best;
}
