// greedy_accept — per-row argmax of the target's logits for greedy speculative acceptance (body for
// mx.fast.metal_kernel). The accepted length and the next token are formed from these k+1 indices by a few tiny MLX
// ops (glimmer_mlx/kernels/accept.py): n = leading rows with sel[j] == drafts[j], next = sel[n].
//
// inputs : logits [R, V] (T), meta [2] int32 = (R, V)
// outputs: sel [R] int32 = argmax of each row
// launch : one threadgroup per row: grid (NT, R, 1), threadgroup (NT, 1, 1), NT a multiple of 32, <= 1024
//
// Reads are coalesced: thread t reads t, t + NT, t + 2 NT, … of its row.
// Order (matches mx.argmax of MLX 0.32 on the CPU, and numpy): values compare through an order-preserving uint key
// in which every NaN is above +inf (so the first NaN of a row wins, as in mx.argmax) and -0.0 equals +0.0; ties go
// to the smallest index — inside a thread's strided range by the strict `>` (earlier elements are seen first),
// across lanes and simdgroups by the minimum index among the lanes holding the largest key.

uint tid = thread_index_in_threadgroup;
uint lane = thread_index_in_simdgroup;
uint sg = simdgroup_index_in_threadgroup;
uint nsg = simdgroups_per_threadgroup;
uint nt = threads_per_threadgroup.x;
const uint row = threadgroup_position_in_grid.y;
const int V = meta[1];
const int NONE = 0x7fffffff;

threadgroup uint tg_key[32];
threadgroup int tg_idx[32];

auto x = logits + (ulong)row * (ulong)V;  // `auto`: a logits buffer of < 8 elements is in constant space
uint bk = 0u;  // below every real key (the smallest, -inf, is 0x007fffff)
int bi = NONE;
for (int i = int(tid); i < V; i += int(nt)) {
  float v = float(x[i]);
  uint u = as_type<uint>(v == 0.0f ? 0.0f : v);
  uint key = isnan(v) ? 0xffffffffu : ((u & 0x80000000u) ? ~u : (u | 0x80000000u));
  if (key > bk) {
    bk = key;
    bi = i;
  }
}
uint sk = simd_max(bk);
int si = simd_min(bk == sk ? bi : NONE);
if (lane == 0) {
  tg_key[sg] = sk;
  tg_idx[sg] = si;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (sg == 0) {
  uint k2 = lane < nsg ? tg_key[lane] : 0u;
  int i2 = lane < nsg ? tg_idx[lane] : NONE;
  uint mk = simd_max(k2);
  int mi = simd_min(k2 == mk ? i2 : NONE);
  if (lane == 0) {
    sel[row] = mi;
  }
}
