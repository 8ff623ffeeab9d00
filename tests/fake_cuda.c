/* A test-only CUDA driver: one "GPU" whose memory is host memory, with the
 * virtual memory management calls (cuMemAddressReserve, cuMemCreate,
 * cuMemMap, ...) done with real mappings, so a device address is a host
 * address and a range unmapped is really unmapped. Built by
 * tests/device_swap.rs and found first through LD_LIBRARY_PATH by that
 * test's child process. Copies are synchronous; streams and events are
 * tokens.
 *
 * Control (looked up with dlsym by the test):
 *   fake_cuda_fail(name, skip)   the call `name` after `skip` more calls of
 *                                it fails (CUDA_ERROR_INVALID_VALUE); up
 *                                to 8 rules, each used once
 *   fake_cuda_set_total(bytes)   device memory size (cuMemCreate past it:
 *                                CUDA_ERROR_OUT_OF_MEMORY)
 *   fake_cuda_used / _peak()     bytes of physical allocations alive now /
 *                                at most since the last reset_peak
 *   fake_cuda_handle_at(ptr)     the allocation mapped at ptr (0: none)
 * FAKE_CUDA_NO_DEVICE=1 in the environment: cuInit finds no device.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef unsigned long long u64;
enum { OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NO_DEVICE = 100 };
#define GRANULE (2u << 20)
#define MAX 4096

struct alloc { int fd; size_t size; int maps; int released; };
struct mapping { u64 ptr; size_t size; u64 handle; };
static struct alloc allocs[MAX];
static struct mapping maps[MAX];
static u64 total = 1ull << 30, used, peak;

struct rule { char name[64]; int skip; int armed; };
static struct rule rules[8];

void fake_cuda_fail(const char *name, int skip) {
    for (int i = 0; i < 8; i++)
        if (!rules[i].armed) {
            strncpy(rules[i].name, name, 63);
            rules[i].skip = skip;
            rules[i].armed = 1;
            return;
        }
}
void fake_cuda_set_total(u64 bytes) { total = bytes; }
u64 fake_cuda_used(void) { return used; }
u64 fake_cuda_peak(void) { return peak; }
void fake_cuda_reset_peak(void) { peak = used; }
u64 fake_cuda_handle_at(u64 ptr) {
    for (int i = 0; i < MAX; i++)
        if (maps[i].size && maps[i].ptr == ptr) return maps[i].handle;
    return 0;
}

/* True when this call of `name` is to fail. */
static int failing(const char *name) {
    for (int i = 0; i < 8; i++)
        if (rules[i].armed && !strcmp(rules[i].name, name)) {
            if (rules[i].skip-- == 0) {
                rules[i].armed = 0;
                return 1;
            }
            return 0;
        }
    return 0;
}

static void unaccount(u64 h) {
    struct alloc *a = &allocs[h - 1];
    if (a->released && a->maps == 0 && a->fd >= 0) {
        close(a->fd);
        a->fd = -1;
        used -= a->size;
    }
}

int cuDriverGetVersion(int *v) { *v = 12080; return OK; }
int cuInit(unsigned flags) {
    (void)flags;
    const char *none = getenv("FAKE_CUDA_NO_DEVICE");
    return none && *none == '1' ? NO_DEVICE : OK;
}
int cuDeviceGetCount(int *n) { *n = 1; return OK; }
int cuDeviceGet(int *dev, int ordinal) { *dev = ordinal; return ordinal == 0 ? OK : INVALID_VALUE; }
int cuDeviceGetName(char *name, int len, int dev) { (void)dev; strncpy(name, "Fake GPU", len); return OK; }
int cuDeviceTotalMem_v2(size_t *bytes, int dev) { (void)dev; *bytes = total; return OK; }
int cuDevicePrimaryCtxRetain(void **ctx, int dev) { (void)dev; *ctx = (void *)0x1; return OK; }
int cuCtxSetCurrent(void *ctx) { (void)ctx; return OK; }
int cuCtxSynchronize(void) { return failing("cuCtxSynchronize") ? INVALID_VALUE : OK; }
int cuMemGetInfo_v2(size_t *free_, size_t *total_) { *free_ = total - used; *total_ = total; return OK; }

int cuMemGetAllocationGranularity(size_t *g, const void *prop, int flags) {
    (void)prop; (void)flags; *g = GRANULE; return OK;
}
int cuMemAddressReserve(u64 *ptr, size_t size, size_t align, u64 addr, u64 flags) {
    (void)align; (void)addr; (void)flags;
    if (failing("cuMemAddressReserve")) return INVALID_VALUE;
    void *p = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return OUT_OF_MEMORY;
    *ptr = (u64)(uintptr_t)p;
    return OK;
}
int cuMemAddressFree(u64 ptr, size_t size) { munmap((void *)(uintptr_t)ptr, size); return OK; }

int cuMemCreate(u64 *handle, size_t size, const void *prop, u64 flags) {
    (void)prop; (void)flags;
    if (failing("cuMemCreate")) return INVALID_VALUE;
    if (size % GRANULE || used + size > total) return OUT_OF_MEMORY;
    /* Handles are never reused, so a test can tell allocations apart. */
    static int next;
    if (next == MAX) return OUT_OF_MEMORY;
    int fd = memfd_create("fake_cuda", 0);
    if (fd < 0 || ftruncate(fd, size) != 0) return OUT_OF_MEMORY;
    allocs[next] = (struct alloc){fd, size, 0, 0};
    used += size;
    if (used > peak) peak = used;
    *handle = ++next;
    return OK;
}
int cuMemRelease(u64 h) {
    if (h == 0 || h > MAX || allocs[h - 1].released) return INVALID_VALUE;
    allocs[h - 1].released = 1;
    unaccount(h);
    return OK;
}
int cuMemMap(u64 ptr, size_t size, size_t offset, u64 h, u64 flags) {
    (void)flags;
    if (failing("cuMemMap")) return INVALID_VALUE;
    if (offset || h == 0 || h > MAX || allocs[h - 1].fd < 0 || allocs[h - 1].size != size)
        return INVALID_VALUE;
    for (int i = 0; i < MAX; i++)
        if (maps[i].size && maps[i].ptr == ptr) return INVALID_VALUE; /* already mapped */
    for (int i = 0; i < MAX; i++)
        if (!maps[i].size) {
            void *p = mmap((void *)(uintptr_t)ptr, size, PROT_READ | PROT_WRITE,
                           MAP_SHARED | MAP_FIXED, allocs[h - 1].fd, 0);
            if (p == MAP_FAILED) return INVALID_VALUE;
            maps[i] = (struct mapping){ptr, size, h};
            allocs[h - 1].maps++;
            return OK;
        }
    return OUT_OF_MEMORY;
}
int cuMemSetAccess(u64 ptr, size_t size, const void *desc, size_t count) {
    (void)desc; (void)count;
    if (failing("cuMemSetAccess")) return INVALID_VALUE;
    return fake_cuda_handle_at(ptr) && size ? OK : INVALID_VALUE;
}
int cuMemUnmap(u64 ptr, size_t size) {
    if (failing("cuMemUnmap")) return INVALID_VALUE;
    for (int i = 0; i < MAX; i++)
        if (maps[i].size && maps[i].ptr == ptr && maps[i].size == size) {
            /* Back to a reservation: touching it now faults. */
            mmap((void *)(uintptr_t)ptr, size, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
            u64 h = maps[i].handle;
            maps[i].size = 0;
            allocs[h - 1].maps--;
            unaccount(h);
            return OK;
        }
    return INVALID_VALUE;
}

int cuMemsetD8_v2(u64 ptr, unsigned char v, size_t n) { memset((void *)(uintptr_t)ptr, v, n); return OK; }
int cuMemcpyAsync(u64 dst, u64 src, size_t n, void *stream) {
    (void)stream;
    if (failing("cuMemcpyAsync")) return INVALID_VALUE;
    memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    return OK;
}
int cuMemcpyDtoH_v2(void *dst, u64 src, size_t n) { memcpy(dst, (const void *)(uintptr_t)src, n); return OK; }
int cuMemHostAlloc(void **p, size_t n, unsigned flags) { (void)flags; *p = malloc(n ? n : 1); return *p ? OK : OUT_OF_MEMORY; }
int cuMemFreeHost(void *p) { free(p); return OK; }

int cuStreamCreate(void **s, unsigned flags) { (void)flags; *s = (void *)0x2; return OK; }
int cuStreamDestroy_v2(void *s) { (void)s; return OK; }
int cuStreamSynchronize(void *s) { (void)s; return OK; }
int cuStreamQuery(void *s) { (void)s; return OK; }
int cuEventCreate(void **e, unsigned flags) { (void)flags; *e = (void *)0x3; return OK; }
int cuEventRecord(void *e, void *s) { (void)e; (void)s; return OK; }
int cuEventQuery(void *e) { (void)e; return OK; }
int cuEventDestroy_v2(void *e) { (void)e; return OK; }

/* Device memory is what is mapped: its type, GPU 0, the mapping's range. */
int cuPointerGetAttribute(void *out, int attr, u64 ptr) {
    for (int i = 0; i < MAX; i++)
        if (maps[i].size && ptr >= maps[i].ptr && ptr < maps[i].ptr + maps[i].size) {
            switch (attr) {
            case 2: *(unsigned *)out = 2; return OK;   /* MEMORY_TYPE: DEVICE */
            case 9: *(int *)out = 0; return OK;        /* DEVICE_ORDINAL */
            case 11: *(u64 *)out = maps[i].ptr; return OK; /* RANGE_START_ADDR */
            case 12: *(size_t *)out = maps[i].size; return OK; /* RANGE_SIZE */
            default: return INVALID_VALUE;
            }
        }
    return INVALID_VALUE;
}
