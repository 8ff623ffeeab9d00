/* Deltas of GPU params (crate::delta::device), compiled at run time by
 * NVRTC: the XXH3-128 of runs of GPU memory (the engine's fingerprint of a
 * delta's base and the check of its result, without reading the param
 * back over PCIe) and the scatter that writes a delta's changed elements.
 *
 * XXH3 over a run of more than 240 bytes keeps 8 64-bit accumulators. Each
 * 1 KiB block adds 16 stripes' products to them (sums, so the blocks'
 * shares are computed in parallel: wm_xxh3_blocks), then scrambles them
 * (not linear: the blocks of one run are chained in order by 8 threads,
 * one per accumulator: wm_xxh3_chain, which also adds the last partial
 * block and the last stripe). The host merges the 8 accumulators into the
 * 128-bit digest, as XXH3 does. Long runs go in rounds of at most a
 * scratch's worth of blocks, each run taking a share of every round (its
 * piece), its accumulators carried in device memory.
 *
 * The same source compiles as C for the test driver (tests/fake_cuda.c),
 * which runs a launch's threads one by one, so the host side and the
 * arithmetic are tested without a GPU. Kernels need no synchronization
 * inside a launch: each thread's work is its own. */

/* The integer types and WM_KERNEL, WM_DEVICE, WM_FIRST_THREAD and
 * WM_THREADS come from memory::nvrtc's prelude (the test driver's own). */

#define WM_XXH3_BLOCK 1024
#define WM_XXH3_SECRET 192
#define WM_XXH3_PRIME32_1 0x9E3779B1ull

/* One run (or piece of one) of the host's delta::device::Piece. */
struct wm_hash_piece {
    u64 src;    /* device address of the run's byte 0 */
    u64 len;    /* the run's bytes (more than 240) */
    u64 block0; /* the piece's first 1 KiB block of the run */
    u64 blocks; /* its whole blocks (the run's last, partial, excluded) */
    u64 sums;   /* the index of its first block in the sums scratch */
    u64 acc;    /* the index of the run's 8 accumulators */
    u64 last;   /* 1: the piece ends the run (and adds its tail) */
};

/* 8 little-endian bytes at p, aligned or not. */
WM_DEVICE u64 wm_read64(const u8 *p) {
    if (((u64)p & 7) == 0) return *(const u64 *)p;
    u64 x = 0;
    for (int k = 7; k >= 0; k--) x = (x << 8) | p[k];
    return x;
}

/* What one 64-byte stripe at `in` adds to accumulator `lane`, with the
 * secret at `key` (XXH3's accumulate_512: the neighbour lane's word plus
 * the product of this lane's word's halves, keyed). */
WM_DEVICE u64 wm_stripe(const u8 *in, const u8 *key, u32 lane) {
    u64 v = wm_read64(in + 8 * (lane ^ 1));
    u64 k = wm_read64(in + 8 * lane) ^ wm_read64(key + 8 * lane);
    return v + (k & 0xffffffffull) * (k >> 32);
}

/* XXH3's scramble of one accumulator after a block. */
WM_DEVICE u64 wm_scramble(u64 acc, u64 key) {
    acc ^= acc >> 47;
    acc ^= key;
    return acc * WM_XXH3_PRIME32_1;
}

/* The piece holding scratch block g: the last whose first is <= g. */
WM_DEVICE u64 wm_piece_of(const struct wm_hash_piece *pieces, u64 npieces, u64 g) {
    u64 lo = 0, hi = npieces;
    while (hi - lo > 1) {
        u64 mid = lo + (hi - lo) / 2;
        if (pieces[mid].sums <= g) lo = mid;
        else hi = mid;
    }
    return lo;
}

/* Every whole block's share of its run's accumulators: thread 8 g + lane
 * writes sums[8 g + lane] for scratch block g (of `total`). */
WM_KERNEL void wm_xxh3_blocks(const struct wm_hash_piece *pieces, u64 npieces, u64 total,
                              const u8 *secret, u64 *sums) {
    for (u64 t = WM_FIRST_THREAD; t < total * 8; t += WM_THREADS) {
        u64 g = t >> 3;
        u32 lane = (u32)(t & 7);
        const struct wm_hash_piece *p = &pieces[wm_piece_of(pieces, npieces, g)];
        const u8 *in = (const u8 *)(p->src + (p->block0 + g - p->sums) * WM_XXH3_BLOCK);
        u64 s = 0;
        for (int k = 0; k < 16; k++) s += wm_stripe(in + 64 * k, secret + 8 * k, lane);
        sums[g * 8 + lane] = s;
    }
}

/* Each piece's blocks chained into its run's accumulators (thread
 * 8 piece + lane), in block order; a run's last piece adds its partial
 * last block and last stripe. */
WM_KERNEL void wm_xxh3_chain(const struct wm_hash_piece *pieces, u64 npieces, const u8 *secret,
                             const u64 *sums, u64 *accs) {
    for (u64 t = WM_FIRST_THREAD; t < npieces * 8; t += WM_THREADS) {
        const struct wm_hash_piece *p = &pieces[t >> 3];
        u32 lane = (u32)(t & 7);
        u64 acc = accs[p->acc * 8 + lane];
        u64 key = wm_read64(secret + WM_XXH3_SECRET - 64 + 8 * lane);
        const u64 *s = sums + p->sums * 8 + lane;
        /* The chain is sequential; its loads are not: 16 at a time, so
         * their latency is paid once per 16 blocks, not per block. */
        u64 b = 0;
        for (; b + 16 <= p->blocks; b += 16) {
            u64 c[16];
            for (int k = 0; k < 16; k++) c[k] = s[(b + k) * 8];
            for (int k = 0; k < 16; k++) acc = wm_scramble(acc + c[k], key);
        }
        for (; b < p->blocks; b++) acc = wm_scramble(acc + s[b * 8], key);
        if (p->last) {
            u64 whole = (p->len - 1) / WM_XXH3_BLOCK;
            const u8 *in = (const u8 *)(p->src + whole * WM_XXH3_BLOCK);
            u64 stripes = (p->len - 1 - whole * WM_XXH3_BLOCK) / 64;
            for (u64 k = 0; k < stripes; k++) acc += wm_stripe(in + 64 * k, secret + 8 * k, lane);
            acc += wm_stripe((const u8 *)(p->src + p->len - 64), secret + WM_XXH3_SECRET - 71, lane);
        }
        accs[p->acc * 8 + lane] = acc;
    }
}

/* A delta's changed elements into a run: element positions[k] (of
 * `esize` bytes) of the run at `dst` becomes values[k]. Positions are
 * distinct (the host decoded and checked them), so threads never write
 * the same bytes. */
WM_KERNEL void wm_delta_scatter(u8 *dst, const u32 *positions, const u8 *values, u64 n,
                                u32 esize) {
    for (u64 k = WM_FIRST_THREAD; k < n; k += WM_THREADS) {
        u8 *to = dst + (u64)positions[k] * esize;
        const u8 *from = values + k * esize;
        for (u32 b = 0; b < esize; b++) to[b] = from[b];
    }
}
