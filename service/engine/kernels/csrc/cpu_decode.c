/* Fused fp32 CPU kernels of the "native" kernel bundle: the decode-step hot spots as one pass over their data.

Each function is the kernel of a Python launcher in service/engine/kernels/cpu_native_ops.py (which checks shapes,
dtypes and strides and says which inputs reach here); the pure-torch `*_ref` ops are the oracles the tests compare
against. Plain loops that -O3 vectorizes, and GCC vector values (`v16`) where a loop is a reduction: those sum LANES
partial sums as a fixed tree (their own reassociation, so a result does not depend on the instruction set). The hot functions
are compiled once per x86-64 level (target_clones: AVX-512, AVX2 + FMA, baseline) and the loader picks the one this
CPU runs, so one build is portable across x86-64 machines.

Sizes are int64 element counts; "row" arguments are row strides in elements; every other operand is contiguous.
Each kernel returns 0 when done; those that index memory by ids they are given (slots, pages, experts) check
them first and return -1, having touched nothing, when one lies outside its range. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HS_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define HS_CLONES
#endif
#define HS_INLINE static inline __attribute__((always_inline))

enum { LANES = 16 };
/* how far ahead (floats) the expert kernels ask for their weight stream (the hardware prefetcher stops at every 4 KiB
   page of a stream: this keeps a few pages' lines in flight); the recurrence asks for the next head's state */
enum { PREFETCH_FLOATS = 2048 };
/* how many keys ahead the decode attention asks for the key / value rows it reads through the page table */
enum { PREFETCH_KEYS = 16 };
/* LANES floats as one vector value (GCC vector extension; unaligned loads and stores through it are allowed) */
typedef float v16 __attribute__((vector_size(LANES * sizeof(float)), aligned(4), may_alias));
typedef int32_t v16i __attribute__((vector_size(LANES * sizeof(int32_t))));

/* sum of the lanes of a, as a fixed tree of halvings */
HS_INLINE float hs_hsum(v16 a) {
    a += __builtin_shuffle(a, (v16i){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    a += __builtin_shuffle(a, (v16i){4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3});
    a += __builtin_shuffle(a, (v16i){2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1});
    a += __builtin_shuffle(a, (v16i){1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0});
    return a[0];
}

/* exp(x) (relative error about 2e-7) for x in [-87, 88] (clamped there: exp(-87) stands for 0), without calls or
   branches so that a loop over it vectorizes: 2^n times a degree-6 polynomial of r = x - n ln2, |r| <= ln2 / 2
   (n rounded to nearest by adding and subtracting 1.5 * 2^23) */
HS_INLINE float hs_exp(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* a . b over n elements: LANES partial sums, then the tree */
HS_INLINE float hs_dot(const float *a, const float *b, int64_t n) {
    v16 acc = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) acc += *(const v16 *)(a + i) * *(const v16 *)(b + i);
    float tail = 0.0f;
    for (; i < n; i++) tail += a[i] * b[i];
    return hs_hsum(acc) + tail;
}

/* SiLU in place on v[0..n) */
HS_INLINE void hs_silu(float *v, int64_t n) {
    for (int64_t i = 0; i < n; i++) v[i] = v[i] / (1.0f + hs_exp(-v[i]));
}

/* 0 when every slots[0..n) lies in [0, num_slots), else -1 (the kernels check before they touch a pool) */
static int64_t hs_check_slots(const int64_t *slots, int64_t n, int64_t num_slots) {
    for (int64_t i = 0; i < n; i++)
        if (slots[i] < 0 || slots[i] >= num_slots) return -1;
    return 0;
}

/* One token through one head's state, in place: s [P, N] = s dA + (dt x) B^T, y [P] = s C + Dh x
   (x, y [P]; B, C [N]). */
HS_INLINE void hs_head_token(float *s, const float *xv, float dt, float dA, const float *Bv, const float *Cv, float Dh,
                             float *yv, int64_t P, int64_t N) {
    for (int64_t p = 0; p < P; p++, s += N) {
        float dtx = dt * xv[p], tail = 0.0f;
        v16 acc = {0};
        int64_t n = 0;
        for (; n + LANES <= N; n += LANES) {
            v16 sn = *(v16 *)(s + n) * dA + dtx * *(const v16 *)(Bv + n);
            *(v16 *)(s + n) = sn;
            acc += sn * *(const v16 *)(Cv + n);
        }
        for (; n < N; n++) {
            s[n] = s[n] * dA + dtx * Bv[n];
            tail += s[n] * Cv[n];
        }
        yv[p] = hs_hsum(acc) + tail + Dh * xv[p];
    }
}

/* One Mamba-2 decode step per (request b, head h), the state updated in place in one pass over it:
   dt = clamp(softplus(dt_raw + dt_bias), dt_lo, dt_hi), dA = exp(-dt exp(A_log)),
   state = state dA + dt x B^T, y = state C + D x.
   pool [S, H, P, N] (rows slots[b]); x [nb, H, P] (row x_row, heads contiguous); dt_raw [nb, H] (row dt_row);
   Bm, Cm [nb, G, N] (rows b_row, c_row; head h reads group h / (H / G)); A_log, D, dt_bias [H]; y [nb, H, P]. */
HS_CLONES int64_t hs_ssu_f32(float *pool, int64_t num_slots, const int64_t *slots, int64_t nb, int64_t H, int64_t P, int64_t N, int64_t G,
                          const float *x, int64_t x_row, const float *dt_raw, int64_t dt_row, const float *A_log,
                          const float *Bm, int64_t b_row, const float *Cm, int64_t c_row, const float *D,
                          const float *dt_bias, float dt_lo, float dt_hi, float *y) {
    if (hs_check_slots(slots, nb, num_slots)) return -1;
    int64_t rep = H / G;
    for (int64_t b = 0; b < nb; b++) {
        for (int64_t h = 0; h < H; h++) {
            float v = dt_raw[b * dt_row + h] + dt_bias[h];
            float dt = v > 20.0f ? v : log1pf(expf(v));
            dt = dt < dt_lo ? dt_lo : (dt > dt_hi ? dt_hi : dt);
            float dA = expf(-dt * expf(A_log[h]));
            const float *Bv = Bm + b * b_row + (h / rep) * N, *Cv = Cm + b * c_row + (h / rep) * N;
            const float *xv = x + b * x_row + h * P;
            float *s = pool + (slots[b] * H + h) * P * N;
            float *yv = y + (b * H + h) * P;
            const float *next = h + 1 < H ? s + P * N : (b + 1 < nb ? pool + slots[b + 1] * H * P * N : s);
            for (int64_t i = 0; i < P * N; i += 16) __builtin_prefetch(next + i, 1); /* the next head's state */
            hs_head_token(s, xv, dt, dA, Bv, Cv, D[h], yv, P, N);
        }
    }
    return 0;
}

/* Mamba-2 prefill scan of a packed batch as its recurrence, token after token (the decode step's update), per
   request b and head h. The head's state lives in the states row of the chunk being scanned: entering chunk c it is
   init[b] (the request's first chunk) or the state after chunk c-1; then per token t of the chunk:
   dA = exp(dt A[h]), state = state dA + dt x_t B_t^T, y_t = state C_t + D[h] x_t.
   x [T, H, P] (row x_row, heads contiguous); dt [T, H] softplus'd and clamped (row dt_row); A (negative), D [H];
   Bm, Cm [T, G, N] (rows b_row, c_row; head h reads group h / (H / G)); init [nb, H, P, N];
   the chunks of request b are first_chunk[b] .. first_chunk[b] + num_chunks[b] - 1, in order, chunk c covering
   tokens chunk_start[c] .. chunk_start[c] + chunk_len[c] - 1; y [T, H, P]; states [nc, H, P, N] (the state after
   each chunk's last token). Returns -1, having written nothing, when a chunk or token index lies outside [0, nc) or
   [0, T). */
HS_CLONES int64_t hs_ssd_scan_f32(int64_t nb, int64_t H, int64_t P, int64_t N, int64_t G, const float *x,
                                  int64_t x_row, const float *dt, int64_t dt_row, const float *A, const float *Bm,
                                  int64_t b_row, const float *Cm, int64_t c_row, const float *D, const float *init,
                                  const int64_t *first_chunk, const int64_t *num_chunks, const int64_t *chunk_start,
                                  const int64_t *chunk_len, int64_t nc, int64_t T, float *y, float *states) {
    for (int64_t b = 0; b < nb; b++)
        if (first_chunk[b] < 0 || num_chunks[b] < 0 || first_chunk[b] + num_chunks[b] > nc) return -1;
    for (int64_t c = 0; c < nc; c++)
        if (chunk_start[c] < 0 || chunk_len[c] < 0 || chunk_start[c] + chunk_len[c] > T) return -1;
    int64_t rep = H / G, PN = P * N;
    for (int64_t b = 0; b < nb; b++) {
        for (int64_t h = 0; h < H; h++) {
            const float *prev = init + (b * H + h) * PN;
            for (int64_t c = first_chunk[b]; c < first_chunk[b] + num_chunks[b]; c++) {
                float *st = states + (c * H + h) * PN;
                memmove(st, prev, PN * sizeof(float));
                for (int64_t t = chunk_start[c]; t < chunk_start[c] + chunk_len[c]; t++) {
                    float dtv = dt[t * dt_row + h], dA = expf(dtv * A[h]);
                    const float *Bv = Bm + t * b_row + (h / rep) * N, *Cv = Cm + t * c_row + (h / rep) * N;
                    const float *xv = x + t * x_row + h * P;
                    hs_head_token(st, xv, dtv, dA, Bv, Cv, D[h], y + (t * H + h) * P, P, N);
                }
                prev = st;
            }
        }
    }
    return 0;
}

/* Causal depthwise conv decode step per request b and channel d, the state shifted in place:
   out = silu(bias + sum_k state[k] w[k] + x w[K-1]), state = [state[1:], x].
   pool [S, D, K-1] (rows slots[b]); x [nb, D] (row x_row); w [D, K]; bias [D] or NULL; out [nb, D]. */
HS_CLONES int64_t hs_conv_update_f32(float *pool, int64_t num_slots, const int64_t *slots, int64_t nb, int64_t D, int64_t K, const float *x,
                                  int64_t x_row, const float *w, const float *bias, float *out) {
    if (hs_check_slots(slots, nb, num_slots)) return -1;
    int64_t km1 = K - 1;
    for (int64_t b = 0; b < nb; b++) {
        float *st = pool + slots[b] * D * km1, *o = out + b * D;
        const float *xb = x + b * x_row;
        if (km1 == 3) { /* the models' width 4, unrolled (the generic loops below run about 9x slower) */
            for (int64_t d = 0; d < D; d++) {
                float *s = st + d * 3, s0 = s[0], s1 = s[1], s2 = s[2], xv = xb[d];
                const float *wd = w + d * 4;
                o[d] = (bias ? bias[d] : 0.0f) + s0 * wd[0] + s1 * wd[1] + s2 * wd[2] + xv * wd[3];
                s[0] = s1;
                s[1] = s2;
                s[2] = xv;
            }
            hs_silu(o, D);
            continue;
        }
        for (int64_t d = 0; d < D; d++) {
            float *s = st + d * km1;
            const float *wd = w + d * K;
            float acc = bias ? bias[d] : 0.0f;
            for (int64_t k = 0; k < km1; k++) acc += s[k] * wd[k];
            acc += xb[d] * wd[km1];
            for (int64_t k = 0; k + 1 < km1; k++) s[k] = s[k + 1];
            if (km1 > 0) s[km1 - 1] = xb[d];
            o[d] = acc;
        }
        hs_silu(o, D);
    }
    return 0;
}

/* softmax of sc[0..L) in place (four running maxima: independent compare chains) */
HS_INLINE void hs_softmax(float *sc, int64_t L) {
    float m0 = -INFINITY, m1 = -INFINITY, m2 = -INFINITY, m3 = -INFINITY, sum = 0.0f;
    int64_t i = 0;
    for (; i + 4 <= L; i += 4) {
        m0 = sc[i] > m0 ? sc[i] : m0;
        m1 = sc[i + 1] > m1 ? sc[i + 1] : m1;
        m2 = sc[i + 2] > m2 ? sc[i + 2] : m2;
        m3 = sc[i + 3] > m3 ? sc[i + 3] : m3;
    }
    for (; i < L; i++) m0 = sc[i] > m0 ? sc[i] : m0;
    m0 = m0 > m1 ? m0 : m1;
    m2 = m2 > m3 ? m2 : m3;
    float m = m0 > m2 ? m0 : m2;
    for (i = 0; i < L; i++) sc[i] = hs_exp(sc[i] - m);
    v16 acc = {0};
    i = 0;
    for (; i + LANES <= L; i += LANES) acc += *(const v16 *)(sc + i);
    for (; i < L; i++) sum += sc[i];
    float inv = 1.0f / (hs_hsum(acc) + sum);
    for (i = 0; i < L; i++) sc[i] *= inv;
}

/* the lane sums of a0..a3 as lanes 0, 4, 8, 12 of one vector: halvings that merge the four as they go */
HS_INLINE v16 hs_hsum4(v16 a0, v16 a1, v16 a2, v16 a3) {
    const v16i lo = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const v16i hi = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    v16 t0 = __builtin_shuffle(a0, a1, lo) + __builtin_shuffle(a0, a1, hi); /* a0: lanes 0-7, a1: 8-15 */
    v16 t1 = __builtin_shuffle(a2, a3, lo) + __builtin_shuffle(a2, a3, hi);
    const v16i lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const v16i hi2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    v16 u = __builtin_shuffle(t0, t1, lo2) + __builtin_shuffle(t0, t1, hi2); /* a0..a3: 4 lanes each */
    u += __builtin_shuffle(u, (v16i){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    u += __builtin_shuffle(u, (v16i){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return u;
}

/* sc[h * L + j] = scale * (qh[h] . key j) for the 4 heads h0..h0+3: the key (Dh values at kv) read once */
HS_INLINE void hs_scores4(float *sc, const float *qh, int64_t Dh, const float *kv, int64_t L, int64_t j,
                          float scale) {
    v16 d0 = {0}, d1 = {0}, d2 = {0}, d3 = {0};
    int64_t c = 0;
    for (; c + LANES <= Dh; c += LANES) {
        v16 k = *(const v16 *)(kv + c);
        d0 += *(const v16 *)(qh + c) * k;
        d1 += *(const v16 *)(qh + Dh + c) * k;
        d2 += *(const v16 *)(qh + 2 * Dh + c) * k;
        d3 += *(const v16 *)(qh + 3 * Dh + c) * k;
    }
    v16 sums = hs_hsum4(d0, d1, d2, d3) * scale;
    sc[j] = sums[0];  /* lanes read straight from the register (a loop over them would go through memory) */
    sc[L + j] = sums[4];
    sc[2 * L + j] = sums[8];
    sc[3 * L + j] = sums[12];
    for (int i = 0; c < Dh && i < 4; i++)
        for (int64_t t = c; t < Dh; t++) sc[i * L + j] += qh[i * Dh + t] * kv[t] * scale;
}

/* o[h, c:c+LANES] = sum_j p[h * L + j] v_j[c:c+LANES] for the 4 heads h0..h0+3 (p at h0's row): each value slice
   read once, four independent sums */
HS_INLINE void hs_values4(float *o, const float *p, int64_t Dh, const float *vc, const int64_t *key_rows, int64_t L,
                          int64_t kv_row, int64_t c) {
    v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t j = 0; j < L; j++) {
        if (j + PREFETCH_KEYS < L) __builtin_prefetch(vc + key_rows[j + PREFETCH_KEYS] * kv_row + c);
        v16 v = *(const v16 *)(vc + key_rows[j] * kv_row + c);
        a0 += p[j] * v;
        a1 += p[L + j] * v;
        a2 += p[2 * L + j] * v;
        a3 += p[3 * L + j] * v;
    }
    *(v16 *)(o + c) = a0;
    *(v16 *)(o + Dh + c) = a1;
    *(v16 *)(o + 2 * Dh + c) = a2;
    *(v16 *)(o + 3 * Dh + c) = a3;
}

/* Attention of one query row's rep heads qh [rep, Dh] over L keys and values at rows key_rows[0..L) of
   kc, vc (row stride kv_row; this KV head's Dh values at the row start) -> o [rep, Dh]; sc [rep, L] scratch.
   Heads in groups of four share each key and value read; the rest (rep % 4) one at a time. */
HS_INLINE void hs_attend(float *o, const float *qh, int64_t rep, int64_t Dh, const float *kc, const float *vc,
                         const int64_t *key_rows, int64_t L, int64_t kv_row, float scale, float *sc) {
    int64_t h4 = rep - rep % 4;
    for (int64_t j = 0; j < L; j++) {
        const float *kv = kc + key_rows[j] * kv_row;
        if (j + PREFETCH_KEYS < L)
            for (int64_t c = 0; c < Dh; c += 16) __builtin_prefetch(kc + key_rows[j + PREFETCH_KEYS] * kv_row + c);
        for (int64_t h = 0; h < h4; h += 4) hs_scores4(sc + h * L, qh + h * Dh, Dh, kv, L, j, scale);
        for (int64_t h = h4; h < rep; h++) sc[h * L + j] = hs_dot(qh + h * Dh, kv, Dh) * scale;
    }
    for (int64_t h = 0; h < rep; h++) hs_softmax(sc + h * L, L);
    int64_t c16 = Dh - Dh % LANES;
    for (int64_t h = 0; h < h4; h += 4)
        for (int64_t c = 0; c < c16; c += LANES) hs_values4(o + h * Dh, sc + h * L, Dh, vc, key_rows, L, kv_row, c);
    for (int64_t h = 0; h < rep; h++)
        for (int64_t c = h < h4 ? c16 : 0; c < Dh; c++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < L; j++) acc += sc[h * L + j] * vc[key_rows[j] * kv_row + c];
            o[h * Dh + c] = acc;
        }
}

/* Decode attention, one query per row r over its request's first ctx[r] keys, GQA (rep = Hq / Hkv query heads per
   KV head), fp32 softmax:
   q [*, Hq, Dh] (row q_row; query of row r at q + tok[r] q_row); kc, vc [S, Hkv, Dh]; page_table [*, pages]
   (row pt_row; row r reads request req[r]'s: key j at slot page_table[j / ps] * ps + j % ps); out [*, Hq, Dh]
   (row tok[r], contiguous); scratch: (rep + 2) * max ctx floats. */
HS_CLONES int64_t hs_decode_attention_f32(const float *q, int64_t q_row, const float *kc, const float *vc,
                                          int64_t num_kv_rows, const int64_t *page_table, int64_t pt_row,
                                          int64_t ps, const int64_t *tok, const int64_t *req, const int64_t *ctx,
                                          int64_t nrows, int64_t Hq, int64_t Hkv, int64_t Dh, float scale, float *out,
                                          float *scratch) {
    for (int64_t r = 0; r < nrows; r++)
        for (int64_t i = 0; i < (ctx[r] + ps - 1) / ps; i++) {
            int64_t page = page_table[req[r] * pt_row + i];
            if (page < 0 || (page + 1) * ps > num_kv_rows) return -1;
        }
    int64_t rep = Hq / Hkv;
    for (int64_t r = 0; r < nrows; r++) {
        const int64_t *pt = page_table + req[r] * pt_row;
        int64_t L = ctx[r];
        int64_t *key_rows = (int64_t *)scratch;  /* L int64: the key's row of the [S * Hkv, Dh] view */
        for (int64_t j = 0; j < L; j++) key_rows[j] = (pt[j / ps] * ps + j % ps) * Hkv;
        for (int64_t g = 0; g < Hkv; g++)
            hs_attend(out + (tok[r] * Hq + g * rep) * Dh, q + tok[r] * q_row + g * rep * Dh, rep, Dh, kc + g * Dh,
                      vc + g * Dh, key_rows, L, Dh, scale, scratch + 2 * L);
    }
    return 0;
}

/* h[t] = relu(x_t @ up_e)^2 * w_t for the nt <= 4 tokens of one tile (x rows xt[t], routing weights wt[t]),
   up_e [d, I] row-major: its rows read once, in order, each added into the four tokens' sums (h [4, I], in L1) */
HS_INLINE void hs_expert_up4(float *h, const float *const *xt, const float *wt, int64_t nt, const float *up_e,
                             int64_t d, int64_t I) {
    memset(h, 0, (size_t)(4 * I) * sizeof *h);
    for (int64_t kk = 0; kk < d; kk++) {
        const float *row = up_e + kk * I;
        for (int64_t c = 0; c < I; c += 16) __builtin_prefetch(row + PREFETCH_FLOATS + c);
        for (int64_t t = 0; t < nt; t++) {
            float xv = xt[t][kk];
            float *ht = h + t * I;
            for (int64_t c = 0; c < I; c += LANES) *(v16 *)(ht + c) += xv * *(const v16 *)(row + c);
        }
    }
    for (int64_t t = 0; t < nt; t++)
        for (int64_t c = 0; c < I; c++) {
            float r = h[t * I + c] > 0.0f ? h[t * I + c] : 0.0f;
            h[t * I + c] = r * r * wt[t];
        }
}

/* out_t += h[t] @ down_e for the nt <= 4 rows of h [4, I]; down_e [I, d] row-major: its rows read once, in order */
HS_INLINE void hs_expert_down4(float *const *out_t, const float *h, int64_t nt, const float *down_e, int64_t d,
                               int64_t I) {
    for (int64_t i = 0; i < I; i++) {
        const float *row = down_e + i * d;
        for (int64_t c = 0; c < d; c += 16) __builtin_prefetch(row + PREFETCH_FLOATS + c);
        for (int64_t t = 0; t < nt; t++) {
            float hv = h[t * I + i];
            float *o = out_t[t];
            for (int64_t c = 0; c < d; c += LANES) *(v16 *)(o + c) += hv * *(const v16 *)(row + c);
        }
    }
}

/* Routed experts of T tokens (top-k picks each), fp32: out[t] += sum_j w[t, j] * down_e(relu(up_e(x_t))^2) with
   e = ids[t, j], the weight applied to the activation (linear: the same up to rounding). Each expert's tokens run in
   tiles of 4 that share every weight read (a second tile of an expert reads its weights from cache).
   x [T, d] (row x_row); up stored [E, d, I] and down stored [E, I, d], row-major (each expert's weights one
   block, streamed in order);
   ids, w [T, k]; out [T, d] (contiguous, accumulated into); d and I multiples of LANES;
   iscratch: T * k + E int64; fscratch: 4 * I floats. Returns -1 (nothing touched) when an id is outside [0, E). */
HS_CLONES int64_t hs_moe_experts_f32(const float *x, int64_t x_row, int64_t T, int64_t d, int64_t I, int64_t E,
                                     const float *up, const float *down, const int64_t *ids, const float *w,
                                     int64_t k, float *out, int64_t *iscratch, float *fscratch) {
    int64_t n = T * k, *order = iscratch, *start = iscratch + n;
    for (int64_t e = 0; e < E; e++) start[e] = 0;
    for (int64_t p = 0; p < n; p++) {
        if (ids[p] < 0 || ids[p] >= E) return -1;
        start[ids[p]]++;
    }
    for (int64_t e = 0, s = 0; e < E; e++) {  /* counts -> start of each expert's run, then fill (pair order kept) */
        int64_t c = start[e];
        start[e] = s;
        s += c;
    }
    for (int64_t p = 0; p < n; p++) order[start[ids[p]]++] = p;  /* start[e] is now the end of e's run */
    for (int64_t e = 0, p0 = 0; e < E; p0 = start[e], e++) {
        for (int64_t p = p0; p < start[e]; p += 4) {
            int64_t nt = start[e] - p < 4 ? start[e] - p : 4;
            const float *xt[4];
            float wt[4], *ot[4];
            for (int64_t t = 0; t < nt; t++) {
                int64_t tok = order[p + t] / k;
                xt[t] = x + tok * x_row;
                wt[t] = w[order[p + t]];
                ot[t] = out + tok * d;
            }
            hs_expert_up4(fscratch, xt, wt, nt, up + e * I * d, d, I);
            hs_expert_down4(ot, fscratch, nt, down + e * I * d, d, I);
        }
    }
    return 0;
}

/* Gated group RMSNorm (the Mamba-2 output norm) of T rows: g = y silu(z), each group of gs channels times
   rsqrt(mean(g^2) + eps), times w. y [T, Di] (row y_row), z [T, Di] (row z_row), w [Di], out [T, Di] (contiguous);
   Di a multiple of gs. */
HS_CLONES int64_t hs_gated_norm_f32(const float *y, int64_t y_row, const float *z, int64_t z_row, int64_t T,
                                    int64_t Di, int64_t gs, const float *w, float eps, float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *yt = y + t * y_row, *zt = z + t * z_row;
        float *o = out + t * Di;
        for (int64_t i = 0; i < Di; i++) o[i] = yt[i] * (zt[i] / (1.0f + hs_exp(-zt[i])));
        for (int64_t g0 = 0; g0 < Di; g0 += gs) {
            float r = 1.0f / sqrtf(hs_dot(o + g0, o + g0, gs) / (float)gs + eps);
            for (int64_t i = g0; i < g0 + gs; i++) o[i] = o[i] * r * w[i];
        }
    }
    return 0;
}

/* Causal depthwise conv of a packed batch with per-request initial states, then SiLU:
   out[t] = silu(bias + sum_k w[:, k] src(t - (K-1) + k)), src the request's own tokens, before its first token its
   initial state's columns. x [T, D] (row x_row); w [D, K]; bias [D] or NULL; states [B, D, K-1] (contiguous);
   qsl [B+1] (request i: tokens qsl[i] .. qsl[i+1]); out [T, D] (contiguous); taps: K * D floats of scratch. */
HS_CLONES int64_t hs_conv_varlen_f32(const float *x, int64_t x_row, int64_t D, int64_t K, const float *w,
                                     const float *bias, const float *states, const int64_t *qsl, int64_t B,
                                     float *out, float *taps) {
    int64_t km1 = K - 1;
    for (int64_t d = 0; d < D; d++)
        for (int64_t k = 0; k < K; k++) taps[k * D + d] = w[d * K + k];
    for (int64_t i = 0; i < B; i++) {
        const float *st = states + i * D * km1;
        for (int64_t t = qsl[i]; t < qsl[i + 1]; t++) {
            float *o = out + t * D;
            int64_t j = t - qsl[i];
            for (int64_t d = 0; d < D; d++) o[d] = bias ? bias[d] : 0.0f;
            for (int64_t k = 0; k < K; k++) {
                int64_t m = j - km1 + k; /* the source column: a token (m >= 0) or a state column */
                const float *tk = taps + k * D;
                if (m >= 0) {
                    const float *xr = x + (qsl[i] + m) * x_row;
                    for (int64_t d = 0; d < D; d++) o[d] += tk[d] * xr[d];
                } else {
                    for (int64_t d = 0; d < D; d++) o[d] += tk[d] * st[d * km1 + km1 + m];
                }
            }
            hs_silu(o, D);
        }
    }
    return 0;
}

/* Residual add + RMSNorm of T rows: r = res + x (written to res_out), normed = r rsqrt(mean(r^2) + eps) w.
   x [T, d] (row x_row), res [T, d] (row res_row), w [d]; res_out, normed [T, d] (contiguous). */
HS_CLONES int64_t hs_add_rms_norm_f32(const float *x, int64_t x_row, const float *res, int64_t res_row, int64_t T,
                                      int64_t d, const float *w, float eps, float *res_out, float *normed) {
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * x_row, *rt = res + t * res_row;
        float *ro = res_out + t * d, *no = normed + t * d;
        for (int64_t i = 0; i < d; i++) ro[i] = rt[i] + xt[i];
        float r = 1.0f / sqrtf(hs_dot(ro, ro, d) / (float)d + eps);
        for (int64_t i = 0; i < d; i++) no[i] = ro[i] * r * w[i];
    }
    return 0;
}

/* Router picks of T tokens from their gate logits [T, E] (contiguous), one group (no group limit): s = sigmoid(logit),
   the k largest s + bias (ties: the lower expert id first), in descending order -> ids [T, k]; w [T, k] = s at the
   picks, divided by (their sum + 1e-20) when norm, times scaling. k <= E; scratch: 2 E floats. Returns -1 when a
   row's s + bias holds a NaN (the caller runs the reference, whose top-k ranks NaN first). */
HS_CLONES int64_t hs_moe_route_f32(const float *logits, int64_t T, int64_t E, const float *bias, int64_t k,
                                   int64_t norm, float scaling, float *w, int64_t *ids, float *scratch) {
    float *s = scratch, *c = scratch + E;
    for (int64_t t = 0; t < T; t++) {
        const float *lt = logits + t * E;
        for (int64_t e = 0; e < E; e++) {
            s[e] = 1.0f / (1.0f + expf(-lt[e]));
            c[e] = s[e] + bias[e];
            if (c[e] != c[e]) return -1;
        }
        float sum = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            int64_t best = 0;
            for (int64_t e = 1; e < E; e++) best = c[e] > c[best] ? e : best;
            ids[t * k + j] = best;
            w[t * k + j] = s[best];
            sum += s[best];
            c[best] = -INFINITY;
        }
        for (int64_t j = 0; j < k; j++)
            w[t * k + j] = (norm ? w[t * k + j] / (sum + 1e-20f) : w[t * k + j]) * scaling;
    }
    return 0;
}
