// msl_simdgroup.h — Metal's simdgroup_matrix (8x8) for the MSL-on-CPU harness, with the real ownership model: a
// simdgroup of 32 lanes cooperatively owns each 8x8 tile, every lane holding two of its 64 elements.
//
// Included at the end of msl_cpu.h (it uses that header's fibers and simd collectives).
//
// Lane layout (what `thread_elements()` exposes; the layout Apple GPUs use and MLX's steel kernels rely on):
//   qid = lane / 4;  row = (qid & 4) + (lane / 2) % 4;  col = (qid & 2) * 2 + (lane % 2) * 2
//   lane holds (row, col) in thread_elements()[0] and (row, col + 1) in thread_elements()[1].
//   So the 4 lanes sharing a row differ in lane bits 0 and 3 (row reductions: simd_shuffle_xor 1 and 8).
//
// Semantics modelled
//   * simdgroup_load / simdgroup_store / simdgroup_multiply(_accumulate) are simdgroup-wide operations: every one of
//     the 32 lanes must execute them (a simdgroup with fewer than 32 threads, a lane that returned early or is in a
//     different collective is an error, as it is undefined on the GPU), and for loads/stores every lane must pass
//     the same pointer, row stride, origin and transpose flag (divergent arguments are an error).
//   * load:  d(r, c) = M(r, c) with M(r, c) = src[(origin.y + r) * elements_per_row + origin.x + c]; with
//     transpose_matrix d(r, c) = M(c, r). store is the inverse. The pointer's element type must be the matrix's
//     (as in Metal: a float matrix loads from float memory only). A non-zero origin together with transpose is
//     refused (use a pointer offset), so the convention for that combination never matters.
//   * multiply_accumulate(d, a, b, c): d = a·b + c, element types may differ (MLX's steel kernels mix them); the
//     products and sums are formed in float32 (k = 0..7 in order), rounded once to d's type.
//   * A default-constructed matrix holds NaN (its contents are undefined in Metal); `simdgroup_matrix(v)` is v on
//     the diagonal and 0 elsewhere; `make_filled_simdgroup_matrix<T, 8, 8>(v)` is v everywhere.
#pragma once

namespace msl_sg {

constexpr int N8 = 8;

inline int frag_row(int lane) { return ((lane / 4) & 4) + (lane / 2) % 4; }
inline int frag_col(int lane) { return ((lane / 4) & 2) * 2 + (lane % 2) * 2; }

// what every lane deposits before a simdgroup_matrix operation (a side channel of the simd collective: the
// collective's own payload is 16 bytes a lane)
struct Stage {
  float a[msl_rt::SIMD][2], b[msl_rt::SIMD][2], c[msl_rt::SIMD][2];
  const void* ptr[msl_rt::SIMD];
  unsigned long epr[msl_rt::SIMD], ox[msl_rt::SIMD], oy[msl_rt::SIMD];
  int transpose[msl_rt::SIMD];
};

inline std::vector<Stage>& stages() {
  static std::vector<Stage> s;
  return s;
}

inline int simd_index_of(const msl_rt::SimdState& s) {
  return int(&s - msl_rt::current()->simd.data());
}

inline Stage& stage_for(int sg) {
  auto& v = stages();
  if ((int)v.size() <= sg) v.resize(sg + 1);
  return v[sg];
}

inline Stage& my_stage() { return stage_for(msl_rt::me().simdgroup_index_in_threadgroup); }

// every lane of the simdgroup present (32 of them); else an error
inline bool all_lanes(const msl_rt::SimdState& s, const char* what) {
  int n = 0;
  for (int l = 0; l < msl_rt::SIMD; l++) n += s.present[l] ? 1 : 0;
  if (n != msl_rt::SIMD) {
    char msg[200];
    std::snprintf(msg, sizeof(msg),
                  "%s executed by %d of the 32 lanes of a simdgroup (simdgroup_matrix operations need all 32 lanes "
                  "in uniform control flow)",
                  what, n);
    msl_rt::fail(msg);
    return false;
  }
  return true;
}

inline bool same_args(const Stage& st, const char* what) {
  for (int l = 1; l < msl_rt::SIMD; l++) {
    if (st.ptr[l] != st.ptr[0] || st.epr[l] != st.epr[0] || st.ox[l] != st.ox[0] || st.oy[l] != st.oy[0] ||
        st.transpose[l] != st.transpose[0]) {
      char msg[200];
      std::snprintf(msg, sizeof(msg), "%s: lanes of one simdgroup passed different pointers/strides/origins", what);
      msl_rt::fail(msg);
      return false;
    }
  }
  return true;
}

inline void stage_args(const void* p, unsigned long epr, unsigned long ox, unsigned long oy, bool tr,
                       const char* what) {
  Stage& st = my_stage();
  int lane = msl_rt::me().thread_index_in_simdgroup;
  st.ptr[lane] = p;
  st.epr[lane] = epr;
  st.ox[lane] = ox;
  st.oy[lane] = oy;
  st.transpose[lane] = tr ? 1 : 0;
  if (tr && (ox || oy)) msl_rt::fail("simdgroup load/store: a non-zero matrix_origin with transpose_matrix is "
                                     "not supported by the harness (offset the pointer instead)");
  (void)what;
}

// memory offset of matrix element (r, c) of a load/store
inline unsigned long offset(const Stage& st, int r, int c) {
  if (st.transpose[0]) return (unsigned long)c * st.epr[0] + (unsigned long)r;
  return (st.oy[0] + (unsigned long)r) * st.epr[0] + st.ox[0] + (unsigned long)c;
}

}  // namespace msl_sg

typedef vec2<unsigned long> ulong2;  // simdgroup_load/store's matrix_origin (ulong2(x, y): x = column, y = row)

namespace metal {

template <typename T, int Cols = 8, int Rows = 8>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "the harness models 8x8 simdgroup matrices only");
  vec2<T> elems;

  simdgroup_matrix() {
    elems.x = T(NAN);
    elems.y = T(NAN);
  }
  // v on the diagonal, 0 elsewhere
  explicit simdgroup_matrix(T v) {
    int lane = msl_rt::me().thread_index_in_simdgroup;
    int r = msl_sg::frag_row(lane), c = msl_sg::frag_col(lane);
    elems.x = r == c ? v : T(0);
    elems.y = r == c + 1 ? v : T(0);
  }
  thread vec2<T>& thread_elements() { return elems; }
  const thread vec2<T>& thread_elements() const { return elems; }
};

typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat16_t, 8, 8> simdgroup_bfloat8x8;

template <typename T, int Cols, int Rows>
inline simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T v) {
  simdgroup_matrix<T, Cols, Rows> m;
  m.elems.x = v;
  m.elems.y = v;
  return m;
}

template <typename T, int C, int R>
inline void simdgroup_load(thread simdgroup_matrix<T, C, R>& d, const T* src, unsigned long elements_per_row = C,
                           ulong2 matrix_origin = {0, 0}, bool transpose_matrix = false) {
  msl_sg::stage_args(src, elements_per_row, matrix_origin.x, matrix_origin.y, transpose_matrix, "simdgroup_load");
  d.elems = msl_rt::simd_collective<vec2<T>>(d.elems, 0, [](const msl_rt::SimdState& s, int lane) {
    vec2<T> r{T(0), T(0)};
    if (!msl_sg::all_lanes(s, "simdgroup_load")) return r;
    const msl_sg::Stage& st = msl_sg::stage_for(msl_sg::simd_index_of(s));
    if (!msl_sg::same_args(st, "simdgroup_load")) return r;
    const T* p = static_cast<const T*>(st.ptr[0]);
    int row = msl_sg::frag_row(lane), col = msl_sg::frag_col(lane);
    r.x = p[msl_sg::offset(st, row, col)];
    r.y = p[msl_sg::offset(st, row, col + 1)];
    return r;
  });
}

template <typename T, int C, int R>
inline void simdgroup_store(simdgroup_matrix<T, C, R> a, T* dst, unsigned long elements_per_row = C,
                            ulong2 matrix_origin = {0, 0}, bool transpose_matrix = false) {
  msl_sg::stage_args(dst, elements_per_row, matrix_origin.x, matrix_origin.y, transpose_matrix, "simdgroup_store");
  msl_rt::simd_collective<vec2<T>>(a.elems, 0, [](const msl_rt::SimdState& s, int lane) {
    vec2<T> none{T(0), T(0)};
    // the whole tile is written by the collective's first evaluation (lane order 0..31)
    if (lane != 0 || !msl_sg::all_lanes(s, "simdgroup_store")) return none;
    const msl_sg::Stage& st = msl_sg::stage_for(msl_sg::simd_index_of(s));
    if (!msl_sg::same_args(st, "simdgroup_store")) return none;
    T* p = static_cast<T*>(const_cast<void*>(st.ptr[0]));
    for (int l = 0; l < msl_rt::SIMD; l++) {
      vec2<T> v = msl_rt::lane_value<vec2<T>>(s, l);
      int row = msl_sg::frag_row(l), col = msl_sg::frag_col(l);
      p[msl_sg::offset(st, row, col)] = v.x;
      p[msl_sg::offset(st, row, col + 1)] = v.y;
    }
    return none;
  });
}

// d = a·b + c (all 8x8), one rounding to d's element type
template <typename TD, typename TA, typename TB, typename TC>
inline void simdgroup_multiply_accumulate(thread simdgroup_matrix<TD, 8, 8>& d, const thread simdgroup_matrix<TA, 8, 8>& a,
                                          const thread simdgroup_matrix<TB, 8, 8>& b,
                                          const thread simdgroup_matrix<TC, 8, 8>& c) {
  msl_sg::Stage& st = msl_sg::my_stage();
  int lane = msl_rt::me().thread_index_in_simdgroup;
  st.a[lane][0] = float(a.elems.x);
  st.a[lane][1] = float(a.elems.y);
  st.b[lane][0] = float(b.elems.x);
  st.b[lane][1] = float(b.elems.y);
  st.c[lane][0] = float(c.elems.x);
  st.c[lane][1] = float(c.elems.y);
  d.elems = msl_rt::simd_collective<vec2<TD>>(d.elems, 0, [](const msl_rt::SimdState& s, int lane) {
    vec2<TD> r{TD(0), TD(0)};
    if (!msl_sg::all_lanes(s, "simdgroup_multiply_accumulate")) return r;
    const msl_sg::Stage& st = msl_sg::stage_for(msl_sg::simd_index_of(s));
    float A[8][8], B[8][8], C[8][8];
    for (int l = 0; l < msl_rt::SIMD; l++) {
      int row = msl_sg::frag_row(l), col = msl_sg::frag_col(l);
      for (int e = 0; e < 2; e++) {
        A[row][col + e] = st.a[l][e];
        B[row][col + e] = st.b[l][e];
        C[row][col + e] = st.c[l][e];
      }
    }
    int row = msl_sg::frag_row(lane), col = msl_sg::frag_col(lane);
    float out[2];
    for (int e = 0; e < 2; e++) {
      float acc = 0.0f;
      for (int k = 0; k < 8; k++) acc += A[row][k] * B[k][col + e];
      out[e] = acc + C[row][col + e];
    }
    r.x = TD(out[0]);
    r.y = TD(out[1]);
    return r;
  });
}

template <typename TD, typename TA, typename TB>
inline void simdgroup_multiply(thread simdgroup_matrix<TD, 8, 8>& d, const thread simdgroup_matrix<TA, 8, 8>& a,
                               const thread simdgroup_matrix<TB, 8, 8>& b) {
  simdgroup_matrix<TD, 8, 8> zero = make_filled_simdgroup_matrix<TD, 8, 8>(TD(0));
  simdgroup_multiply_accumulate(d, a, b, zero);
}

}  // namespace metal
