// block_attention_partial — pass 1 of block-verify attention (body for mx.fast.metal_kernel).
//
// The L query rows (anchor + drafts, or a token tree's flattened nodes) of all G query heads of one GQA group are
// R = G*L rows of one matrix problem against the group's shared K/V: a threadgroup owns (KV head, key chunk, row
// group) and reads each K/V row of its chunk once into threadgroup memory for all its rows; every simdgroup owns one
// 8-row tile of the R rows and computes S = Q·Kᵀ and O += P·V with 8x8 simdgroup_matrix tiles, keeping an online
// softmax (running max) per row.
// With R <= 8*NSG (NSG simdgroups, at most 8: G*L <= 64) one threadgroup covers the whole group, so each K/V row
// is read once per group and chunk; larger groups use ceil(R / (8*NSG)) row groups, each reading the chunk once.
//
// inputs : q [Hq, L, D] (T, RoPE / QK-norm applied), k [Hkv, N, D] (T), v [Hkv, N, D] (T), all addressed through
//          their strides (ensure_row_contiguous=False: views of the KV cache's buffer are read in place); the
//          K/V loads take a unit-stride path (consecutive lanes read consecutive elements of a row) whenever the
//          innermost stride is 1, which it is for the cache's views
//          meta [5] int32 = (N, qk, W, SS, S)   qk = absolute position of query 0 minus that of key 0,
//                                              W = sliding window (0 = global), SS keys per chunk, S chunks
//          fmeta [1] float32 = (softmax scale * log2(e))   scores are kept in base-2 units (exp2)
//          tree only (TREE): meta [5 + 2L] = (N, qk, W, SS, S, bits[L], depths[L]): bits[i] (a uint32 stored as
//          int32) has bit b set iff row i sees block row b (b = key - qk: its ancestors and itself, with the window
//          rule on block rows already applied, exactly `cache.tree_mask`'s block columns), depths[i] = row i's depth
// template: T (dtype), D (head dim, a multiple of 32), L (rows per head: 1..16, 1..32 for a tree), G (query heads
//           per KV head), BK (keys per block: 16, or 8 for D > 128 to fit 32 KiB), NSG (simdgroups per
//           threadgroup), TREE (false: the L rows are a chain at consecutive positions; true: a token tree's
//           flattened nodes, the mask from the ancestor bits; a compile-time constant, so the chain variant is the
//           same code as without it)
// outputs: o_part [Hkv, S, RP, D] float32 (unnormalised), ml [Hkv, S, RP, 2] float32 (running max in base-2
//          units, running sum); row r = g*L + i is query i of head kvh*G + g; RP = 8*ceil(R/8) (padding rows are
//          fully masked: max -inf, sum 0)
// launch : grid (32*NSG, Hkv*RG, S), threadgroup (32*NSG, 1, 1), RG = ceil(ceil(R/8) / NSG)
// mask   : chain: query i sees key j iff j <= qk + i (causal inside the block) and (W == 0 or j > qk + i - W).
//          tree: query i (at position qk + depths[i]) sees a context key j < qk iff W == 0 or j > qk + depths[i] - W,
//          and a block key j >= qk iff bit j - qk of bits[i] is set. One register per lane (the row's bits) and one
//          shift per key: no mask matrix is read inside the key loop.

constexpr int R = G * L;
constexpr int RT = (R + 7) / 8;          // 8-row tiles of the group
constexpr int RG = (RT + NSG - 1) / NSG; // row groups (threadgroups per KV head and chunk)
constexpr int RP = RT * 8;
constexpr int DT = D / 8;                // 8-wide head-dim tiles
constexpr int KT = BK / 8;               // 8-key tiles per block
constexpr int LDS = D + 4;               // threadgroup row stride in floats (padded against bank conflicts)
constexpr int NT = NSG * 32;
constexpr int CH = 4;                    // consecutive elements one thread loads per step
constexpr int CPR = D / CH;              // steps per K/V row

const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint tid = thread_index_in_threadgroup;
const int kvh = int(threadgroup_position_in_grid.y) / RG;
const int rt = (int(threadgroup_position_in_grid.y) % RG) * NSG + int(sg);  // this simdgroup's row tile
const bool active = rt < RT;  // uniform per simdgroup; idle simdgroups still load and meet every barrier
const int s = int(threadgroup_position_in_grid.z);
const int N = meta[0];
const int qk = meta[1];
const int W = meta[2];
const int SS = meta[3];
const int S = meta[4];
const float scale2 = fmeta[0];
const long qs0 = q_strides[0], qs1 = q_strides[1], qs2 = q_strides[2];
const long ks0 = k_strides[0], ks1 = k_strides[1], ks2 = k_strides[2];
const long vs0 = v_strides[0], vs1 = v_strides[1], vs2 = v_strides[2];
const bool unit = ks2 == 1 && vs2 == 1;

// this lane's fragment coordinates (Apple's simdgroup_matrix layout): elements (fr, fc) and (fr, fc + 1)
const int fr = int(((lane / 4) & 4) + (lane / 2) % 4);
const int fc = int(((lane / 4) & 2) * 2 + (lane % 2) * 2);
const int r = rt * 8 + fr;  // this lane's query row
const bool valid = active && r < R;
const int g = valid ? r / L : 0;
const int i = valid ? r % L : 0;
const uint tbits = TREE && valid ? uint(meta[5 + i]) : 0u;  // tree: the block rows row i sees
const int tpos = TREE && valid ? qk + meta[5 + L + i] : 0;  // tree: row i's position (relative to key 0)

threadgroup float Ks[BK * LDS];
threadgroup float Vs[BK * LDS];

simdgroup_matrix<float, 8, 8> Qf[DT];
simdgroup_matrix<float, 8, 8> Of[DT];
for (int dt = 0; dt < DT; dt++) {
  const device T* qp = q + (long)(kvh * G + g) * qs0 + (long)i * qs1 + (long)(dt * 8 + fc) * qs2;
  Qf[dt].thread_elements()[0] = valid ? float(qp[0]) * scale2 : 0.0f;
  Qf[dt].thread_elements()[1] = valid ? float(qp[qs2]) * scale2 : 0.0f;
  Of[dt] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
}
float m = -INFINITY;  // running max of row fr (base-2 units), the same in the 4 lanes of the row
float l = 0.0f;       // running sum

// keys any row of the group can see (a tree's depths are >= 0, so no row sees a context key below qk - W + 1)
int lo = s * SS;
int hi = min(lo + SS, N);
hi = min(hi, qk + L);
if (W > 0) {
  lo = max(lo, qk - W + 1);
}
for (int j0 = lo; j0 < hi; j0 += BK) {
  threadgroup_barrier(mem_flags::mem_threadgroup);  // the previous block's tiles are no longer read
  for (int c = int(tid); c < BK * CPR; c += NT) {
    const int kr = c / CPR;
    const int d0 = (c % CPR) * CH;
    const int j = j0 + kr;
    threadgroup float* kd = Ks + kr * LDS + d0;
    threadgroup float* vd = Vs + kr * LDS + d0;
    if (j < hi) {
      const device T* kp = k + (long)kvh * ks0 + (long)j * ks1;
      const device T* vp = v + (long)kvh * vs0 + (long)j * vs1;
      if (unit) {
        for (int e = 0; e < CH; e++) {
          kd[e] = float(kp[d0 + e]);
          vd[e] = float(vp[d0 + e]);
        }
      } else {
        for (int e = 0; e < CH; e++) {
          kd[e] = float(kp[(long)(d0 + e) * ks2]);
          vd[e] = float(vp[(long)(d0 + e) * vs2]);
        }
      }
    } else {
      for (int e = 0; e < CH; e++) {
        kd[e] = 0.0f;
        vd[e] = 0.0f;
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (active) {
    // S = Q · Kᵀ for this block's KT key tiles
    simdgroup_matrix<float, 8, 8> Sf[KT];
    for (int kt = 0; kt < KT; kt++) {
      Sf[kt] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      for (int dt = 0; dt < DT; dt++) {
        simdgroup_matrix<float, 8, 8> Kf;
        simdgroup_load(Kf, Ks + kt * 8 * LDS + dt * 8, LDS, ulong2(0, 0), true);  // (d, key)
        simdgroup_multiply_accumulate(Sf[kt], Qf[dt], Kf, Sf[kt]);
      }
    }
    // mask, running max, probabilities
    float bmax = -INFINITY;
    for (int kt = 0; kt < KT; kt++) {
      for (int e = 0; e < 2; e++) {
        const int j = j0 + kt * 8 + fc + e;
        const bool see = valid && j < hi
            && (TREE ? (j < qk ? (W == 0 || j > tpos - W) : ((tbits >> uint(j - qk)) & 1u) != 0u)
                     : (j <= qk + i && (W == 0 || j > qk + i - W)));
        const float x = see ? Sf[kt].thread_elements()[e] : -INFINITY;
        Sf[kt].thread_elements()[e] = x;
        bmax = max(bmax, x);
      }
    }
    bmax = max(bmax, simd_shuffle_xor(bmax, ushort(1)));
    bmax = max(bmax, simd_shuffle_xor(bmax, ushort(8)));
    const float mn = max(m, bmax);
    const bool none = mn == -INFINITY;  // nothing seen yet by this row
    const float corr = none ? 1.0f : exp2(m - mn);
    float psum = 0.0f;
    for (int kt = 0; kt < KT; kt++) {
      for (int e = 0; e < 2; e++) {
        const float p = none ? 0.0f : exp2(Sf[kt].thread_elements()[e] - mn);
        Sf[kt].thread_elements()[e] = p;
        psum += p;
      }
    }
    psum += simd_shuffle_xor(psum, ushort(1));
    psum += simd_shuffle_xor(psum, ushort(8));
    l = l * corr + psum;
    m = mn;
    // O = O * corr + P · V
    for (int dt = 0; dt < DT; dt++) {
      Of[dt].thread_elements()[0] *= corr;
      Of[dt].thread_elements()[1] *= corr;
      for (int kt = 0; kt < KT; kt++) {
        simdgroup_matrix<float, 8, 8> Vf;
        simdgroup_load(Vf, Vs + kt * 8 * LDS + dt * 8, LDS);  // (key, d)
        simdgroup_multiply_accumulate(Of[dt], Sf[kt], Vf, Of[dt]);
      }
    }
  }
}
if (active) {
  const ulong row0 = ((ulong)kvh * S + s) * RP + rt * 8;
  for (int dt = 0; dt < DT; dt++) {
    simdgroup_store(Of[dt], o_part + row0 * D + dt * 8, D);
  }
  if (fc == 0) {
    ml[(row0 + fr) * 2] = m;
    ml[(row0 + fr) * 2 + 1] = l;
  }
}
