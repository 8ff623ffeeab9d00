/* FP8 E4M3 quantization on the GPU (crate::quant::device), compiled at run
 * time by NVRTC. The rule is the CPU quantizer's (quant/mod.rs), bit for
 * bit: the factor 448 / amax and scale_inv come from the host (computed as
 * the CPU does), the product is one f32 multiply rounded to nearest
 * (__fmul_rn: never contracted), the cast is PyTorch's (e4m3 below).
 *
 * The same source compiles as C for the test driver (tests/fake_cuda.c),
 * which defines the prelude below and runs a launch's threads one by one,
 * so the host side and the arithmetic are tested without a GPU.
 *
 * A launch covers one run of a request: n = rows * len elements, row k of
 * the run being len shard elements from offset + k * stride (row-major
 * shard elements). Blocks are numbered in a grid local to the shard's box:
 * (batch * brows + block row - the box's first) * bcols + block column -
 * the box's first; the host maps them to global blocks. */

#ifdef __CUDACC_RTC__
/* The integer types and WM_KERNEL, WM_DEVICE, WM_FIRST_THREAD and
 * WM_THREADS come from memory::nvrtc's prelude. */
WM_DEVICE float wm_mul(float a, float b) { return __fmul_rn(a, b); }
WM_DEVICE float wm_add(float a, float b) { return __fadd_rn(a, b); }
WM_DEVICE u32 wm_bits(float f) { return __float_as_uint(f); }
WM_DEVICE float wm_float(u32 u) { return __uint_as_float(u); }
WM_DEVICE void wm_min_u64(u64 *at, u64 v) { atomicMin(at, v); }
/* 32 bytes at p (16-byte aligned) as 8 words; 16 bytes of words to p. */
WM_DEVICE void wm_load32(const void *p, u32 *w) {
    const uint4 *q = (const uint4 *)p;
    uint4 a = q[0], b = q[1];
    w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
    w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
}
WM_DEVICE void wm_store16(void *p, const u32 *w) {
    uint4 a;
    a.x = w[0]; a.y = w[1]; a.z = w[2]; a.w = w[3];
    *(uint4 *)p = a;
}
/* The largest v of the warp's lanes that share `key`, into *at once per
 * group (a row's 32 consecutive elements usually share their block). */
WM_DEVICE void wm_group_max(u32 *at, u64 key, u32 v) {
#if __CUDA_ARCH__ >= 800
    unsigned peers = __match_any_sync(__activemask(), key);
    v = __reduce_max_sync(peers, v);
    if ((threadIdx.x & 31) == (unsigned)(__ffs(peers) - 1)) atomicMax(at, v);
#else
    atomicMax(at, v);
#endif
}
#endif

/* One run's geometry (the host's quant::device::Run, #[repr(C)]). */
struct wm_fp8_run {
    u64 src;      /* device address of the shard's element 0 */
    u64 n;        /* elements of the run: rows * len */
    u64 offset;   /* shard element of the run's first */
    u64 len;      /* elements per row of the run */
    u64 stride;   /* shard elements from one row of the run to the next */
    u64 rows;     /* the shard's rows (its second to last dimension; 1 for 1-D) */
    u64 cols;     /* the shard's columns (its last dimension) */
    u64 row0;     /* the box's first row and column in the global tensor */
    u64 col0;
    u64 brows;    /* block rows and columns the box spans */
    u64 bcols;
    u32 dtype;    /* 0 bf16, 1 f16, 2 f32 */
    u32 blocked;  /* 1: 128 x 128 blocks; 2: MXFP8, 1 x 32; 0: one block */
    u32 small;    /* 1: every shard element index fits 32 bits */
    u32 unused;
};

/* IEEE half to single, exactly. */
WM_DEVICE float wm_half(u16 h) {
    u32 sign = (u32)(h & 0x8000u) << 16;
    u32 e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
        if (m == 0) return wm_float(sign);
        return wm_float(sign | wm_bits(wm_mul((float)m, 5.9604644775390625e-8f)));
    }
    if (e == 31) return wm_float(sign | 0x7f800000u | (m << 13));
    return wm_float(sign | ((e + 112u) << 23) | (m << 13));
}

WM_DEVICE float wm_load(const struct wm_fp8_run *r, u64 e) {
    if (r->dtype == 0) return wm_float((u32)((const u16 *)r->src)[e] << 16);
    if (r->dtype == 1) return wm_half(((const u16 *)r->src)[e]);
    return ((const float *)r->src)[e];
}

/* PyTorch's cast to float8_e4m3fn: nearest even, saturating at 448, NaN
 * kept (quant/e4m3.rs from_f32). */
WM_DEVICE u8 wm_e4m3(float f) {
    u32 bits = wm_bits(f), sign = bits & 0x80000000u, a = bits ^ sign, r;
    if (a > 0x7f800000u) {
        r = 0x7f;
    } else if (a >= 0x43e00000u) {
        r = 0x7e;
    } else if (a < (121u << 23)) {
        r = (wm_bits(wm_add(wm_float(a), wm_float(141u << 23))) - (141u << 23)) & 0xffu;
    } else {
        a = a + ((u32)(7 - 127) << 23) + 0x7ffffu + ((a >> 20) & 1u);
        r = (a >> 20) & 0xffu;
    }
    return (u8)(r | (sign >> 24));
}

/* The shard element of the run's element i (32-bit divisions, several
 * times cheaper on a GPU, when the indices fit). */
WM_DEVICE u64 wm_element(const struct wm_fp8_run *r, u64 i) {
    if (r->small) {
        u32 k = (u32)i, len = (u32)r->len;
        return (u32)r->offset + (k / len) * (u32)r->stride + k % len;
    }
    return r->offset + (i / r->len) * r->stride + i % r->len;
}

/* The local block of shard element e. */
WM_DEVICE u64 wm_block(const struct wm_fp8_run *r, u64 e) {
    if (!r->blocked) return 0;
    u64 col, row, batch;
    if (r->small) {
        u32 k = (u32)e, cols = (u32)r->cols, rows = (u32)r->rows, t = k / cols;
        col = k % cols;
        row = t % rows;
        batch = t / rows;
    } else {
        col = e % r->cols;
        row = (e / r->cols) % r->rows;
        batch = e / (r->cols * r->rows);
    }
    /* Constant divisors on each path (a GPU divides by a variable slowly). */
    u64 brow, bcol;
    if (r->blocked == 2) {
        brow = row;
        bcol = (r->col0 + col) / 32 - r->col0 / 32;
    } else {
        brow = (r->row0 + row) / 128 - r->row0 / 128;
        bcol = (r->col0 + col) / 128 - r->col0 / 128;
    }
    return (batch * r->brows + brow) * r->bcols + bcol;
}

/* Elements a thread takes at a time: the index arithmetic (64-bit
 * divisions, the costly part on a GPU) is done once for them when they
 * lie in one row and one block, as nearly all do. */
#define WM_CHUNK 16

/* The WM_CHUNK shard elements from e, widened: two 16-byte loads of 16
 * bf16 or f16 where they are aligned so, else one load each. */
WM_DEVICE void wm_load_chunk(const struct wm_fp8_run *r, u64 e, float *x) {
    u64 at = r->src + e * 2;
    if (r->dtype < 2 && (at & 15) == 0) {
        u32 w[8];
        wm_load32((const void *)at, w);
        for (int k = 0; k < WM_CHUNK; k++) {
            u16 h = (u16)(w[k / 2] >> (16 * (k & 1)));
            x[k] = r->dtype == 0 ? wm_float((u32)h << 16) : wm_half(h);
        }
        return;
    }
    for (int k = 0; k < WM_CHUNK; k++) x[k] = wm_load(r, e + k);
}

/* Whether the run's elements i .. i + n (shard elements from e) lie in
 * one row of the run, one row of the shard and one block. */
WM_DEVICE int wm_one_block(const struct wm_fp8_run *r, u64 i, u64 e, u64 n) {
    u64 col = r->small ? (u32)e % (u32)r->cols : e % r->cols;
    u64 in_row = r->small ? (u32)i % (u32)r->len : i % r->len;
    if (in_row + n > r->len || col + n > r->cols) return 0;
    if (!r->blocked) return 1;
    u64 first = r->col0 + col, last = first + n - 1;
    return r->blocked == 2 ? first / 32 == last / 32 : first / 128 == last / 128;
}

/* Each block's amax over the run, as f32 bit patterns (|x|'s bits order as
 * the values do), maxed into amax_bits; the smallest shard element that is
 * NaN or infinite into *bad (left alone when there is none). */
WM_KERNEL void wm_fp8_amax(struct wm_fp8_run r, u32 *amax_bits, u64 *bad) {
    u64 chunks = (r.n + WM_CHUNK - 1) / WM_CHUNK;
    for (u64 c = WM_FIRST_THREAD; c < chunks; c += WM_THREADS) {
        u64 i = c * WM_CHUNK, e = wm_element(&r, i);
        u64 n = r.n - i < WM_CHUNK ? r.n - i : WM_CHUNK;
        int one = wm_one_block(&r, i, e, n);
        u32 m = 0;
        if (one && n == WM_CHUNK) {
            float x[WM_CHUNK];
            wm_load_chunk(&r, e, x);
            for (int k = 0; k < WM_CHUNK; k++) {
                u32 a = wm_bits(x[k]) & 0x7fffffffu;
                if (a >= 0x7f800000u) {
                    wm_min_u64(bad, e + k);
                    a = 0;
                }
                m = a > m ? a : m;
            }
            n = 0; /* done: only the group's maximum is left */
        }
        for (u64 k = 0; k < n; k++) {
            u64 ek = one ? e + k : wm_element(&r, i + k);
            u32 a = wm_bits(wm_load(&r, ek)) & 0x7fffffffu;
            if (a >= 0x7f800000u) {
                wm_min_u64(bad, ek);
                a = 0;
            }
            if (one) {
                m = a > m ? a : m;
            } else {
                u64 b = wm_block(&r, ek);
                wm_group_max(&amax_bits[b], b, a);
            }
        }
        /* Lanes whose chunk crossed a block did theirs above: key ~0. */
        u64 b = one ? wm_block(&r, e) : ~0ull;
        wm_group_max(one ? &amax_bits[b] : amax_bits, b, one ? m : 0);
    }
}

/* The run's elements times their block's factor (448 / amax, or MXFP8's
 * 2^-e, from the host), cast to E4M3: element i of the run into out[i]. */
WM_KERNEL void wm_fp8_quantize(struct wm_fp8_run r, const float *factor, u8 *out) {
    u64 chunks = (r.n + WM_CHUNK - 1) / WM_CHUNK;
    for (u64 c = WM_FIRST_THREAD; c < chunks; c += WM_THREADS) {
        u64 i = c * WM_CHUNK, e = wm_element(&r, i);
        u64 n = r.n - i < WM_CHUNK ? r.n - i : WM_CHUNK;
        if (wm_one_block(&r, i, e, n)) {
            float f = factor[wm_block(&r, e)];
            if (n == WM_CHUNK && ((u64)(out + i) & 15) == 0) {
                float x[WM_CHUNK];
                u32 w[4] = {0, 0, 0, 0};
                wm_load_chunk(&r, e, x);
                for (int k = 0; k < WM_CHUNK; k++)
                    w[k / 4] |= (u32)wm_e4m3(wm_mul(x[k], f)) << (8 * (k & 3));
                wm_store16(out + i, w);
                continue;
            }
            for (u64 k = 0; k < n; k++) out[i + k] = wm_e4m3(wm_mul(wm_load(&r, e + k), f));
            continue;
        }
        for (u64 k = 0; k < n; k++) {
            u64 ek = wm_element(&r, i + k);
            out[i + k] = wm_e4m3(wm_mul(wm_load(&r, ek), factor[wm_block(&r, ek)]));
        }
    }
}
