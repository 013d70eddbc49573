"""C++ source of a generated CPU lookup kernel for one :class:`KernelSpec`.

Every table's rows, dim, offsets and pooling are compile-time constants, so each feature's loop
is specialised (the dim unrolled and vectorised) and there is no per-call metadata. The arithmetic
is fbgemm's, operation for operation, so results are bitwise identical to its CPU kernels:
- forward: per bag, ids in order, ``acc = fma(weight, row, acc)`` (weighted) or ``acc + row``,
  mean pooling scaled by ``1.0f / length``; an empty bag is zeros; without pooling (an
  EmbeddingCollection's lookups) each id's row, at the id's position;
- backward: each id's gradient summed over its occurrences in KJT order (fbgemm's stable radix
  sort visits them in that order; here a slot per distinct id does, without the sort: the id
  indexes it, or in a table of many rows for its ids a hash of the id finds it; an occurrence's
  gradient is its bag's, or without pooling its own row's), then the
  optimizer's update of that row: SGD ``w = fma(-lr, g, w)``; Adagrad ``m = fma(g, g, m)`` and
  the step in double (fbgemm's scalar template calls the double ``sqrt``); rowwise Adagrad
  unfused, with fbgemm's 8-lane sum of squares and its pairwise reduction for a pooled table read
  by one feature (its JIT kernel) and a sequential sum for a table several features read or
  rows per id (its scalar path). Which operations fuse was read from fbgemm's compiled kernels,
  so the build turns contraction off and the source says every fused multiply-add itself.
The forward keeps each bag's sum in registers, as vectors of the widest lanes the build targets
(GCC's vector extensions: each lane adds in the scalar order, so the bits are the same; the
loop left to GCC's vectoriser kept the sum in memory and ran 1.3-1.7x slower than fbgemm's JIT
kernel on this project's AVX-512 machine; with the vectors ``benchmarks/generated_kernels.py``
measures 0.89-0.90x, the kernel call alone 0.70-0.76x), at most 8 vectors of a row's columns at a
time (more would not stay in registers).
Rows are prefetched 16 ahead, as fbgemm's kernels do (table rows are random reads).
Each bucket of tables (:attr:`KernelSpec.buckets`) is its own forward and backward; a kernel of
several buckets runs them on the OpenMP threads torch uses (built with ``openmp``), or one bucket
per call (pipelined buckets: ``runtime/pipeline``). Functions are
``extern "C"`` over raw pointers (called through ctypes): the source includes no torch header, so
a cold build takes about a second.
"""

from __future__ import annotations

from string import Template

from lightning_sparselift.runtime.codegen.spec import KernelSpec

_PRELUDE = r"""
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {
constexpr int64_t TOTAL_D = $total_dim;
constexpr int64_t BUCKETS = $buckets;
constexpr float EPS = $eps;
constexpr float BETA1 = $beta1;  // Adam's (0 for the other optimizers)
constexpr float BETA2 = $beta2;

constexpr int64_t PREFETCH = 16;  // rows ahead (as fbgemm's kernels): table rows are random reads

template <typename I>
inline uint64_t slot_hash(I id) { return static_cast<uint64_t>(id) * 0x9E3779B97F4A7C15ull; }

// into every cache level (prefetcht0, as fbgemm's kernels); WRITE: the row will be updated
template <int D, bool WRITE>
inline void prefetch_row(const float* row) {
  for (int line = 0; line < D; line += 16) __builtin_prefetch(row + line, WRITE ? 1 : 0, 3);
}

// the row of the id PREFETCH positions after p (before last), when it is one of the table's
template <int D, typename I>
inline void prefetch_ahead(const I* ids, int64_t p, int64_t last, const float* table, int64_t rows) {
  if (p + PREFETCH < last) {
    const int64_t ahead = ids[p + PREFETCH];
    if (ahead >= 0 && ahead < rows) prefetch_row<D, false>(table + ahead * D);
  }
}

// one row into a sum in memory (the backward's per-row gradients), lane by lane: a function of its
// own, its pointers restricted (inlined into a loop over ids, GCC interleaves two ids and leaves the
// lanes scalar: 3x slower on multi-hot bags)
template <int D>
__attribute__((noinline)) void add_row(float* __restrict acc, const float* __restrict row) {
  for (int d = 0; d < D; ++d) acc[d] = acc[d] + row[d];
}

template <int D>
__attribute__((noinline)) void fma_row(float* __restrict acc, const float* __restrict row, float w) {
  for (int d = 0; d < D; ++d) acc[d] = std::fma(w, row[d], acc[d]);
}

// a distinct id's first occurrence starts its sum: 0 + row, the bits of zeroing the sum and adding
// (0.0f + -0.0f is +0.0f; the build does not fold it away). Zeroing first was a ``rep stos``: a
// third of the accumulation's samples on this AVX2 EPYC, and the add's vector loads waited on its stores
template <int D>
__attribute__((noinline)) void first_row(float* __restrict acc, const float* __restrict row) {
  for (int d = 0; d < D; ++d) acc[d] = 0.0f + row[d];
}

template <int D>
__attribute__((noinline)) void first_fma_row(float* __restrict acc, const float* __restrict row, float w) {
  for (int d = 0; d < D; ++d) acc[d] = std::fma(w, row[d], 0.0f);
}

// the rows' lanes as vectors of the widest registers the build targets: the sum keeps them in
// registers, lane by lane as the scalar loop would (explicit vectors: GCC's own vectorising of a
// loop over ids left the lanes scalar)
#if defined(__AVX512F__)
constexpr int LANES = 16;
#elif defined(__AVX2__)
constexpr int LANES = 8;
#else
constexpr int LANES = 4;
#endif
typedef float Lanes __attribute__((vector_size(LANES * sizeof(float))));
// the same lanes at a float's alignment: rows and output columns need not be vector-aligned.
// Loaded and stored through this type, not memcpy: GCC turned the memcpy of each bag's sums into
// a copy of the whole sum through the stack in halves, whose loads stall on the wider stores
// before them (4.6x slower on an AVX2 EPYC, 1.5x on multi-hot bags)
typedef float UnalignedLanes __attribute__((vector_size(LANES * sizeof(float)), aligned(alignof(float))));

inline Lanes load_lanes(const float* p) { return *reinterpret_cast<const UnalignedLanes*>(p); }
inline void store_lanes(float* p, Lanes v) { *reinterpret_cast<UnalignedLanes*>(p) = v; }

inline Lanes fma_lanes(float w, Lanes row, Lanes acc) {
  for (int l = 0; l < LANES; ++l) acc[l] = std::fma(w, row[l], acc[l]);
  return acc;
}

// the vectors of a bag's sum kept in registers at once: x86-64 has 16 vector registers below
// AVX-512, so a dim-128 row (16 AVX2 vectors) summed whole spilled its sums to the stack at every id
constexpr int MOST_VECTORS = 8;

// one bag's sum over vectors [V0, V1) of its rows (and, LAST, the lanes after the vectors) into
// ``o``; returns the position of an out-of-range id, or -1
template <int D, int V0, int V1, bool LAST, bool WEIGHTED, bool MEAN, bool CHECK, typename I>
inline int64_t pool_columns(const I* ids, int64_t begin, int64_t end, int64_t last, const float* psw,
                            const float* table, int64_t rows, float* o) {
  constexpr int V = D / LANES, TAIL = LAST ? D % LANES : 0;
  Lanes acc[V1 > V0 ? V1 - V0 : 1] = {};
  float tail[TAIL > 0 ? TAIL : 1] = {};
  for (int64_t p = begin; p < end; ++p) {
    if (V0 == 0) prefetch_ahead<D>(ids, p, last, table, rows);
    const int64_t id = ids[p];
    if (CHECK && (id < 0 || id >= rows)) return p;
    const float* row = table + id * D;
    for (int v = V0; v < V1; ++v) {
      acc[v - V0] = WEIGHTED ? fma_lanes(psw[p], load_lanes(row + v * LANES), acc[v - V0])
                             : acc[v - V0] + load_lanes(row + v * LANES);
    }
    for (int t = 0; t < TAIL; ++t) {
      tail[t] = WEIGHTED ? std::fma(psw[p], row[V * LANES + t], tail[t]) : tail[t] + row[V * LANES + t];
    }
  }
  if (MEAN && end > begin) {
    const float scale = 1.0f / static_cast<float>(end - begin);
    for (int v = V0; v < V1; ++v) acc[v - V0] = acc[v - V0] * scale;
    for (int t = 0; t < TAIL; ++t) tail[t] = tail[t] * scale;
  }
  for (int v = V0; v < V1; ++v) store_lanes(o + v * LANES, acc[v - V0]);
  for (int t = 0; t < TAIL; ++t) o[V * LANES + t] = tail[t];
  return -1;
}

// one bag's sum, MOST_VECTORS vectors of its columns at a time from vector V0 (each lane still sums
// the bag's ids in order: the same bits)
template <int D, int V0, bool WEIGHTED, bool MEAN, bool CHECK, typename I>
inline int64_t pool_bag(const I* ids, int64_t begin, int64_t end, int64_t last, const float* psw,
                        const float* table, int64_t rows, float* o) {
  constexpr int V = D / LANES, V1 = V0 + MOST_VECTORS < V ? V0 + MOST_VECTORS : V;
  const int64_t bad = pool_columns<D, V0, V1, V1 == V, WEIGHTED, MEAN, CHECK, I>(ids, begin, end, last, psw, table,
                                                                                 rows, o);
  if constexpr (V1 < V) {
    if (bad < 0) return pool_bag<D, V1, WEIGHTED, MEAN, CHECK, I>(ids, begin, end, last, psw, table, rows, o);
  }
  return bad;
}

// forward: one feature's bags; returns the position of an out-of-range id, or -1
template <int D, bool WEIGHTED, bool MEAN, bool CHECK, typename I, typename O>
int64_t pool(const I* ids, const O* offsets, const float* psw, const float* table, int64_t rows,
             float* out, int64_t B, int64_t f, int64_t column) {
  const int64_t last = offsets[(f + 1) * B];
  for (int64_t b = 0; b < B; ++b) {
    const int64_t bad = pool_bag<D, 0, WEIGHTED, MEAN, CHECK, I>(ids, offsets[f * B + b], offsets[f * B + b + 1],
                                                                 last, psw, table, rows, out + b * TOTAL_D + column);
    if (bad >= 0) return bad;
  }
  return -1;
}

// forward without pooling: each id's row at the id's position; returns the position of an
// out-of-range id, or -1
template <int D, bool CHECK, typename I, typename O>
int64_t gather(const I* ids, const O* offsets, const float* table, int64_t rows, float* out, int64_t B, int64_t f) {
  const int64_t first = offsets[f * B], last = offsets[(f + 1) * B];
  for (int64_t p = first; p < last; ++p) {
    prefetch_ahead<D>(ids, p, last, table, rows);
    const int64_t id = ids[p];
    if (CHECK && (id < 0 || id >= rows)) return p;
    std::memcpy(out + p * D, table + id * D, D * sizeof(float));
  }
  return -1;
}

// backward scratch, reused across calls (grows only)
struct Scratch {
  // a table of few rows for its ids: per row, the slot of its sum, or -1 (only the rows a call
  // touched are reset after it)
  std::vector<int32_t> slot_of;
  // a larger table's: open addressing over the ids, an id beside its slot (a probe reads one line)
  struct Entry {
    int64_t key;
    int64_t slot;
  };
  std::vector<Entry> entries;
  std::vector<int64_t> rows;
  std::vector<float> acc;
};

// one table's gradient per distinct id (occurrences summed in KJT order) into s.acc/s.rows;
// returns the number of distinct ids, or -(position + 1) of an out-of-range id. DIRECT: the ids
// index the slots (no hash, no probe: the probes' misses were a third of the accumulation)
template <int D, bool WEIGHTED, bool MEAN, bool CHECK, bool ROWS, bool DIRECT, typename I, typename O>
int64_t accumulate_slots(const I* ids, const O* offsets, const float* psw, const float* grad, int64_t B,
                         int64_t f0, int64_t f1, int64_t column0, int64_t nrows, Scratch& s) {
  const int64_t n = offsets[f1 * B] - offsets[f0 * B];
  uint64_t cap = 16;
  if constexpr (DIRECT) {
    if (static_cast<int64_t>(s.slot_of.size()) < nrows) s.slot_of.resize(nrows, -1);
  } else {
    while (cap < 2 * static_cast<uint64_t>(n)) cap <<= 1;
    s.entries.assign(cap, Scratch::Entry{-1, 0});
  }
  const uint64_t mask = cap - 1;
  if (static_cast<int64_t>(s.rows.size()) < n) s.rows.resize(n);
  if (static_cast<int64_t>(s.acc.size()) < n * D) s.acc.resize(n * D);
  int64_t U = 0;
  const int64_t last = offsets[f1 * B];
  auto done = [&](int64_t result) {
    if constexpr (DIRECT) {
      for (int64_t u = 0; u < U; ++u) s.slot_of[s.rows[u]] = -1;
    }
    return result;
  };
  for (int64_t f = f0; f < f1; ++f) {
    const int64_t column = column0 + (f - f0) * D;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t begin = offsets[f * B + b], end = offsets[f * B + b + 1];
      // fbgemm's weight of an occurrence: float(1.0 / length) for mean pooling without weights
      const float scale = (MEAN && !WEIGHTED && end > begin) ? static_cast<float>(1.0 / static_cast<double>(end - begin)) : 1.0f;
      const float* bag = grad + b * TOTAL_D + column;
      for (int64_t p = begin; p < end; ++p) {
        const float* g = ROWS ? grad + p * TOTAL_D : bag;
        const int64_t id = ids[p];
        if (CHECK && (id < 0 || id >= nrows)) return done(-(p + 1));
        if (p + PREFETCH < last) {  // the slot PREFETCH ids ahead: a random read, as a row is
          const int64_t ahead = ids[p + PREFETCH];
          if (ahead >= 0 && ahead < nrows) {
            if constexpr (DIRECT) __builtin_prefetch(&s.slot_of[ahead], 1, 3);
            else __builtin_prefetch(&s.entries[(slot_hash(ahead) >> 20) & mask], 1, 3);
          }
        }
        int64_t slot;
        bool first;
        if constexpr (DIRECT) {
          int32_t& at = s.slot_of[id];
          first = at < 0;
          if (first) at = static_cast<int32_t>(U);
          slot = at;
        } else {
          uint64_t h = (slot_hash(id) >> 20) & mask;
          while (s.entries[h].key != -1 && s.entries[h].key != id) h = (h + 1) & mask;
          Scratch::Entry& e = s.entries[h];
          first = e.key == -1;
          if (first) e = Scratch::Entry{id, U};
          slot = e.slot;
        }
        if (first) s.rows[U++] = id;
        float* a = &s.acc[slot * D];
        if (WEIGHTED || MEAN) {  // (fma(w, g, a) is fma(g, w, a): one rounding)
          const float w = WEIGHTED ? psw[p] : scale;
          if (first) first_fma_row<D>(a, g, w); else fma_row<D>(a, g, w);
        } else {
          if (first) first_row<D>(a, g); else add_row<D>(a, g);
        }
      }
    }
  }
  return done(U);
}

// the ids index the slots where a slot per row is no larger than the hash table over the ids
// would be (16 bytes per entry, at least twice the ids): a one-hot feature's 2,048 ids in 100k
// rows touch a line of slots each (1.09x the time of hashing them, one run)
template <int D, bool WEIGHTED, bool MEAN, bool CHECK, bool ROWS, typename I, typename O>
int64_t accumulate(const I* ids, const O* offsets, const float* psw, const float* grad, int64_t B,
                   int64_t f0, int64_t f1, int64_t column0, int64_t nrows, Scratch& s) {
  const int64_t n = offsets[f1 * B] - offsets[f0 * B];
  return nrows <= 8 * n
      ? accumulate_slots<D, WEIGHTED, MEAN, CHECK, ROWS, true, I, O>(ids, offsets, psw, grad, B, f0, f1, column0, nrows, s)
      : accumulate_slots<D, WEIGHTED, MEAN, CHECK, ROWS, false, I, O>(ids, offsets, psw, grad, B, f0, f1, column0, nrows, s);
}

// every optimizer visits the distinct rows alike: the row's weights, its summed gradient, its index
template <int D, typename Update>
void update_rows(float* table, const Scratch& s, int64_t U, Update update) {
  for (int64_t u = 0; u < U; ++u) {
    if (u + PREFETCH < U) prefetch_row<D, true>(table + s.rows[u + PREFETCH] * D);
    update(table + s.rows[u] * D, &s.acc[u * D], s.rows[u]);
  }
}

template <int D>
void update_sgd(float* table, float*, const Scratch& s, int64_t U, float lr) {
  update_rows<D>(table, s, U, [&](float* w, const float* g, int64_t) {
    for (int d = 0; d < D; ++d) w[d] = std::fma(-lr, g[d], w[d]);
  });
}

template <int D>
void update_adagrad(float* table, float* state, const Scratch& s, int64_t U, float lr) {
  update_rows<D>(table, s, U, [&](float* w, const float* g, int64_t row) {
    float* m = state + row * D;
    for (int d = 0; d < D; ++d) {
      // fbgemm's build: m += g * g fused; float lr * g; sqrt, + float eps, division and w - step in
      // double, rounded once to float
      m[d] = std::fma(g[d], g[d], m[d]);
      const double step = static_cast<double>(lr * g[d]) /
                          (std::sqrt(static_cast<double>(m[d])) + static_cast<double>(EPS));
      w[d] = static_cast<float>(static_cast<double>(w[d]) - step);
    }
  });
}

// fbgemm's AVX2 rowwise Adagrad (a table one feature reads): 8 lanes of sums of squares
template <int D>
void update_rowwise_adagrad(float* table, float* state, const Scratch& s, int64_t U, float lr) {
  update_rows<D>(table, s, U, [&](float* w, const float* g, int64_t row) {
    // the JIT squares (vmulps) then adds (vaddps): no FMA, in the sum or in the update
    // (lane l sums g[l], g[l + 8], ... in order; written by blocks of 8 so the compiler vectorises it)
    float lane[8] = {};
    int d = 0;
    for (; d + 8 <= D; d += 8)
      for (int l = 0; l < 8; ++l) lane[l] = lane[l] + g[d + l] * g[d + l];
    for (int l = 0; d + l < D; ++l) lane[l] = lane[l] + g[d + l] * g[d + l];
    float sum = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    sum = sum / static_cast<float>(D);
    const float h = state[row] + sum;
    state[row] = h;
    const float step = -lr / (std::sqrt(h) + EPS);
    for (int d = 0; d < D; ++d) w[d] = w[d] + g[d] * step;
  });
}

// fbgemm's scalar rowwise Adagrad (a table several features read)
template <int D>
void update_rowwise_adagrad_shared(float* table, float* state, const Scratch& s, int64_t U, float lr) {
  update_rows<D>(table, s, U, [&](float* w, const float* g, int64_t row) {
    // fbgemm's build vectorises this loop in order, squares rounded (vmulps) then added; only its
    // scalar tail (D % 4 elements, none since fbgemm requires D % 4 == 0) would be fused
    float sum = 0.0f;
    for (int d = 0; d < D; ++d) sum = sum + g[d] * g[d];
    const float h = state[row] + sum / static_cast<float>(D);
    state[row] = h;
    const float multiplier = lr / (std::sqrt(h) + EPS);
    // fbgemm: fmsub(w, correction = 1, round(g * multiplier))
    for (int d = 0; d < D; ++d) w[d] = w[d] - g[d] * multiplier;
  });
}

// Adam as fbgemm's CUDA template writes it (fbgemm has no CPU Adam; the Triton kernel is the same
// arithmetic): each moment decayed then the new term added by one fma, the bias corrections
// 1 - powf(beta, iter) in double, the step in double, rounded once to float
template <int D>
void update_adam(float* table, float* m1s, float* m2s, const Scratch& s, int64_t U, float lr,
                 double correction1, double correction2) {
  update_rows<D>(table, s, U, [&](float* w, const float* g, int64_t row) {
    float* m1 = m1s + row * D;
    float* m2 = m2s + row * D;
    for (int d = 0; d < D; ++d) {
      m1[d] = std::fma(g[d], 1.0f - BETA1, m1[d] * BETA1);
      m2[d] = std::fma(g[d] * g[d], 1.0f - BETA2, m2[d] * BETA2);
      const float second = std::sqrt(static_cast<float>(static_cast<double>(m2[d]) / correction2)) + EPS;
      const double step = static_cast<double>(m1[d]) / correction1 / static_cast<double>(second) * static_cast<double>(lr);
      w[d] = static_cast<float>(static_cast<double>(w[d]) - step);
    }
  });
}

// one bucket's features (buckets hold disjoint tables and write disjoint output columns)
template <typename I, typename O>
int64_t forward_bucket(int64_t bucket, int64_t B, const I* ids, const O* offsets, const float* psw,
                       const float* weights, float* out) {
  int64_t bad = -1;
  switch (bucket) {
$forward_body
  }
  return -1;
}

// one bucket's tables
template <typename I, typename O>
int64_t backward_bucket(int64_t bucket, int64_t B, const I* ids, const O* offsets, const float* psw,
                        const float* grad, float* weights, float* state, float* state2, float lr,
                        double correction1, double correction2) {
  static thread_local Scratch s;
  int64_t U = 0;
  switch (bucket) {
$backward_body
  }
  return -1;
}

// bucket ``only`` (0 <= only < BUCKETS), or (-1) every bucket; several run on the threads of the
// OpenMP team the process's torch already uses (the kernel links the same libgomp), so they add
// no threads of their own
template <typename Run>
int64_t each_bucket(int64_t only, Run run) {
  if (only >= 0) return only < BUCKETS ? run(only) : -3;
  int64_t bad[BUCKETS];
#pragma omp parallel for schedule(dynamic, 1) if (BUCKETS > 1)
  for (int64_t b = 0; b < BUCKETS; ++b) bad[b] = run(b);
  for (int64_t b = 0; b < BUCKETS; ++b)
    if (bad[b] != -1) return bad[b];
  return -1;
}

template <typename I, typename O>
int64_t forward(int64_t only, int64_t B, const I* ids, const O* offsets, const float* psw, const float* weights,
                float* out) {
  return each_bucket(only, [&](int64_t b) { return forward_bucket<I, O>(b, B, ids, offsets, psw, weights, out); });
}

template <typename I, typename O>
int64_t backward(int64_t only, int64_t B, const I* ids, const O* offsets, const float* psw, const float* grad,
                 float* weights, float* state, float* state2, float lr, int64_t iter) {
  // (powf in float, 1 - it in double, as fbgemm's template)
  const double correction1 = 1.0 - static_cast<double>(powf(BETA1, static_cast<float>(iter)));
  const double correction2 = 1.0 - static_cast<double>(powf(BETA2, static_cast<float>(iter)));
  return each_bucket(only, [&](int64_t b) {
    return backward_bucket<I, O>(b, B, ids, offsets, psw, grad, weights, state, state2, lr, correction1, correction2);
  });
}
}  // namespace

#define SL_DISPATCH(call)                                                                   \
  if (id_bits == 64 && off_bits == 64) return call(int64_t, int64_t);                       \
  if (id_bits == 64 && off_bits == 32) return call(int64_t, int32_t);                       \
  if (id_bits == 32 && off_bits == 64) return call(int32_t, int64_t);                       \
  if (id_bits == 32 && off_bits == 32) return call(int32_t, int32_t);                       \
  return -2;

// ``bucket``: one bucket's tables, or -1 every bucket's
// return -1: done; -2: unsupported id/offset width; -3: no such bucket; else the position of an
// out-of-range id
extern "C" int64_t sl_forward(int64_t bucket, int64_t B, int id_bits, int off_bits, const void* ids,
                              const void* offsets, const float* psw, const float* weights, float* out) {
#define SL_FORWARD(I, O) forward<I, O>(bucket, B, static_cast<const I*>(ids), static_cast<const O*>(offsets), psw, weights, out)
  SL_DISPATCH(SL_FORWARD)
}

extern "C" int64_t sl_backward(int64_t bucket, int64_t B, int id_bits, int off_bits, const void* ids,
                               const void* offsets, const float* psw, const float* grad, float* weights, float* state,
                               float* state2, float lr, int64_t iter) {
#define SL_BACKWARD(I, O) backward<I, O>(bucket, B, static_cast<const I*>(ids), static_cast<const O*>(offsets), psw, grad, weights, state, state2, lr, iter)
  SL_DISPATCH(SL_BACKWARD)
}
"""


def _bool(value: bool) -> str:
    return "true" if value else "false"


def cpu_source(spec: KernelSpec) -> str:
    """The kernel's C++ translation unit."""
    flags = f"{_bool(spec.weighted)}, {_bool(spec.pooling == 'mean')}, {_bool(spec.check_ids)}"
    rows = spec.pooling == "none"
    features = spec.features
    forward, backward = [], []
    for b, tables in enumerate(spec.buckets):
        forward.append(f"    case {b}:")
        backward.append(f"    case {b}:")
        for t in tables:
            table = spec.tables[t]
            for f in range(table.first_feature, table.end_feature):
                _, dim, column = features[f]
                table_at = f"weights + {table.weights_offset}LL, {table.rows}LL"
                call = (f"gather<{dim}, {_bool(spec.check_ids)}, I, O>(ids, offsets, {table_at}, out, B, {f})" if rows
                        else f"pool<{dim}, {flags}, I, O>(ids, offsets, psw, {table_at}, out, B, {f}, {column})")
                forward.append(f"      bad = {call};\n      if (bad >= 0) return bad;")
            update = spec.optimizer
            # (fbgemm's vectorised JIT kernel takes a table one feature reads, pooled; the others
            # its scalar path)
            if update == "rowwise_adagrad" and (rows or table.end_feature - table.first_feature > 1):
                update = "rowwise_adagrad_shared"
            state = "nullptr" if spec.optimizer == "sgd" else f"state + {table.state_offset}LL"
            step = "lr"
            if update == "adam":
                state += f", state2 + {table.state2_offset}LL"
                step = "lr, correction1, correction2"
            backward.append(
                f"      U = accumulate<{table.dim}, {flags}, {_bool(rows)}, I, O>(ids, offsets, psw, grad, B, "
                f"{table.first_feature}, {table.end_feature}, {features[table.first_feature][2]}, {table.rows}LL, s);\n"
                f"      if (U < 0) return -U - 1;\n"
                f"      update_{update}<{table.dim}>(weights + {table.weights_offset}LL, {state}, s, U, {step});")
        forward.append("      break;")
        backward.append("      break;")
    return Template(_PRELUDE).substitute(total_dim=spec.total_dim, buckets=len(spec.buckets), eps=f"{spec.eps!r}f",
                                         beta1=f"{spec.beta1!r}f", beta2=f"{spec.beta2!r}f",
                                         forward_body="\n".join(forward), backward_body="\n".join(backward))
