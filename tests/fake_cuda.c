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
 *   fake_cuda_hold_freeing(on)   while on, cuMemUnmap, cuMemAddressFree
 *                                and cuMemRelease called from the library's
 *                                deferred-release thread ("wm-device-free")
 *                                wait (at most 20 s; then
 *                                fake_cuda_hold_expired() says 1)
 *   fake_cuda_calls(name)        how many times `name` was called (the
 *                                copies, launches and unmaps only:
 *                                cuMemcpy2D, cuMemcpy2DAsync,
 *                                cuMemcpyAsync, cuMemcpyDtoH,
 *                                cuLaunchKernel, cuMemUnmap)
 *   fake_cuda_pinned_peak()      the most page-locked host bytes alive
 *                                at once (cuMemHostAlloc / cuMemFreeHost)
 *   fake_cuda_event_delay(n)     an event recorded answers NOT_READY to
 *                                its next n queries (copies in flight)
 * FAKE_CUDA_NO_DEVICE=1 in the environment: cuInit finds no device.
 *
 * Kernels: the same file answers as NVRTC (libnvrtc.so is a link to it):
 * a "compiled" program is its source, a module loaded from it has the
 * FP8 quantizer's and the GPU deltas' kernels, and cuLaunchKernel runs a
 * launch's threads one after another on the kernels' own source
 * (crates/core/src/quant/fp8.cu and crates/core/src/delta/device.cu,
 * compiled into this file with the prelude below), so the
 * library's launches, arguments and arithmetic are checked without a GPU.
 *
 * Linear memory (cuMemAlloc) is a memory file mapped shared, so CUDA IPC
 * works between real processes: a handle names the exporting process and
 * the file's descriptor, and cuIpcOpenMemHandle maps /proc/<pid>/fd/<fd>
 * (the same memory, as on a GPU).
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <pthread.h>

typedef unsigned long long u64;
enum { OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NO_DEVICE = 100 };
#define GRANULE (2u << 20)
#define MAX 4096

struct alloc { int fd; size_t size; int maps; int released; };
struct mapping { u64 ptr; size_t size; u64 handle; };
static struct alloc allocs[MAX];
static struct mapping maps[MAX];
/* Linear memory: cuMemAlloc'd (exportable) or opened from a handle. */
struct linear { u64 ptr; size_t size; int fd; int imported; };
static struct linear linears[MAX];
static struct linear *linear_at(u64 ptr);
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
/* The allocation and mapping tables are shared by every thread: two
 * managers in one process (the fan-out tests) allocate at once. */
static pthread_mutex_t vmm_lock = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;

u64 fake_cuda_handle_at(u64 ptr) {
    pthread_mutex_lock(&vmm_lock);
    u64 h = 0;
    for (int i = 0; i < MAX && !h; i++)
        if (maps[i].size && maps[i].ptr == ptr) h = maps[i].handle;
    pthread_mutex_unlock(&vmm_lock);
    return h;
}

static const char *counted[] = {"cuMemcpy2D", "cuMemcpy2DAsync", "cuMemcpyAsync", "cuMemcpyDtoH", "cuLaunchKernel", "cuMemUnmap"};
static u64 counts[6];
static void count(const char *name) {
    for (int i = 0; i < 6; i++)
        if (!strcmp(counted[i], name)) __atomic_fetch_add(&counts[i], 1, __ATOMIC_RELAXED);
}
u64 fake_cuda_calls(const char *name) {
    for (int i = 0; i < 6; i++)
        if (!strcmp(counted[i], name)) return __atomic_load_n(&counts[i], __ATOMIC_RELAXED);
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

static int hold_freeing, hold_expired;
void fake_cuda_hold_freeing(int on) { __atomic_store_n(&hold_freeing, on, __ATOMIC_SEQ_CST); }
u64 fake_cuda_hold_expired(void) { return (u64)__atomic_load_n(&hold_expired, __ATOMIC_SEQ_CST); }
/* A call from the deferred-release thread waits while freeing is held. */
static void hold_point(void) {
    char name[32] = {0};
    if (pthread_getname_np(pthread_self(), name, sizeof name) != 0 || strcmp(name, "wm-device-free"))
        return;
    for (int i = 0; i < 20000 && __atomic_load_n(&hold_freeing, __ATOMIC_SEQ_CST); i++) usleep(1000);
    if (__atomic_load_n(&hold_freeing, __ATOMIC_SEQ_CST)) __atomic_store_n(&hold_expired, 1, __ATOMIC_SEQ_CST);
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
int cuMemAddressFree(u64 ptr, size_t size) { hold_point(); munmap((void *)(uintptr_t)ptr, size); return OK; }

static int cuMemCreate_locked(u64 *handle, size_t size, const void *prop, u64 flags) {
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

int cuMemCreate(u64 *handle, size_t size, const void *prop, u64 flags) {
    pthread_mutex_lock(&vmm_lock);
    int r = cuMemCreate_locked(handle, size, prop, flags);
    pthread_mutex_unlock(&vmm_lock);
    return r;
}
static int cuMemRelease_locked(u64 h) {
    if (h == 0 || h > MAX || allocs[h - 1].released) return INVALID_VALUE;
    allocs[h - 1].released = 1;
    unaccount(h);
    return OK;
}

int cuMemRelease(u64 h) {
    hold_point();
    pthread_mutex_lock(&vmm_lock);
    int r = cuMemRelease_locked(h);
    pthread_mutex_unlock(&vmm_lock);
    return r;
}
static int cuMemMap_locked(u64 ptr, size_t size, size_t offset, u64 h, u64 flags) {
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

int cuMemMap(u64 ptr, size_t size, size_t offset, u64 h, u64 flags) {
    pthread_mutex_lock(&vmm_lock);
    int r = cuMemMap_locked(ptr, size, offset, h, flags);
    pthread_mutex_unlock(&vmm_lock);
    return r;
}
int cuMemSetAccess(u64 ptr, size_t size, const void *desc, size_t count) {
    (void)desc; (void)count;
    if (failing("cuMemSetAccess")) return INVALID_VALUE;
    return fake_cuda_handle_at(ptr) && size ? OK : INVALID_VALUE;
}
static int cuMemUnmap_locked(u64 ptr, size_t size) {
    count("cuMemUnmap");
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

int cuMemUnmap(u64 ptr, size_t size) {
    hold_point();
    pthread_mutex_lock(&vmm_lock);
    int r = cuMemUnmap_locked(ptr, size);
    pthread_mutex_unlock(&vmm_lock);
    return r;
}

int cuMemsetD8_v2(u64 ptr, unsigned char v, size_t n) { memset((void *)(uintptr_t)ptr, v, n); return OK; }
int cuMemcpyAsync(u64 dst, u64 src, size_t n, void *stream) {
    (void)stream;
    count("cuMemcpyAsync");
    if (failing("cuMemcpyAsync")) return INVALID_VALUE;
    memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    return OK;
}
int cuMemcpyDtoH_v2(void *dst, u64 src, size_t n) {
    count("cuMemcpyDtoH");
    if (failing("cuMemcpyDtoH")) return INVALID_VALUE;
    memcpy(dst, (const void *)(uintptr_t)src, n);
    return OK;
}
/* Page-locked host memory is malloc'd; its bytes alive are counted. */
static struct { void *p; size_t n; } pinned_blocks[1024];
static u64 pinned_now, pinned_top;
static pthread_mutex_t pinned_lock = PTHREAD_MUTEX_INITIALIZER;
u64 fake_cuda_pinned_peak(void) { return __atomic_load_n(&pinned_top, __ATOMIC_RELAXED); }
int cuMemHostAlloc(void **p, size_t n, unsigned flags) {
    (void)flags;
    *p = malloc(n ? n : 1);
    if (!*p) return OUT_OF_MEMORY;
    pthread_mutex_lock(&pinned_lock);
    for (int i = 0; i < 1024; i++)
        if (!pinned_blocks[i].p) {
            pinned_blocks[i].p = *p;
            pinned_blocks[i].n = n;
            pinned_now += n;
            if (pinned_now > pinned_top) pinned_top = pinned_now;
            break;
        }
    pthread_mutex_unlock(&pinned_lock);
    return OK;
}
int cuMemFreeHost(void *p) {
    pthread_mutex_lock(&pinned_lock);
    for (int i = 0; i < 1024; i++)
        if (pinned_blocks[i].p == p) {
            pinned_now -= pinned_blocks[i].n;
            pinned_blocks[i].p = NULL;
            break;
        }
    pthread_mutex_unlock(&pinned_lock);
    free(p);
    return OK;
}

int cuStreamCreate(void **s, unsigned flags) { (void)flags; *s = (void *)0x2; return OK; }
int cuStreamDestroy_v2(void *s) { (void)s; return OK; }
int cuStreamSynchronize(void *s) { (void)s; return OK; }
int cuStreamQuery(void *s) { (void)s; return OK; }
int cuEventCreate(void **e, unsigned flags) { (void)flags; *e = (void *)0x3; return OK; }
/* With fake_cuda_event_delay(n), an event recorded is NOT_READY for its
 * next n queries (one countdown shared by every event: a copy "in
 * flight" for a while, so buffers waiting on events stay busy). */
static u64 event_delay, event_left;
void fake_cuda_event_delay(u64 n) { __atomic_store_n(&event_delay, n, __ATOMIC_RELAXED); }
int cuEventRecord(void *e, void *s) {
    (void)e; (void)s;
    __atomic_store_n(&event_left, __atomic_load_n(&event_delay, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
    return OK;
}
int cuEventQuery(void *e) {
    (void)e;
    u64 left = __atomic_load_n(&event_left, __ATOMIC_RELAXED);
    while (left > 0) {
        if (__atomic_compare_exchange_n(&event_left, &left, left - 1, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            return 600; /* CUDA_ERROR_NOT_READY */
    }
    return OK;
}
int cuEventDestroy_v2(void *e) { (void)e; return OK; }

/* Device memory is what is mapped (VMM or linear): its type, GPU 0, the
 * mapping's range. */
static int attribute(void *out, int attr, u64 start, size_t size) {
    switch (attr) {
    case 2: *(unsigned *)out = 2; return OK;   /* MEMORY_TYPE: DEVICE */
    case 9: *(int *)out = 0; return OK;        /* DEVICE_ORDINAL */
    case 11: *(u64 *)out = start; return OK;   /* RANGE_START_ADDR */
    case 12: *(size_t *)out = size; return OK; /* RANGE_SIZE */
    default: return INVALID_VALUE;
    }
}
int cuPointerGetAttribute(void *out, int attr, u64 ptr) {
    for (int i = 0; i < MAX; i++)
        if (maps[i].size && ptr >= maps[i].ptr && ptr < maps[i].ptr + maps[i].size)
            return attribute(out, attr, maps[i].ptr, maps[i].size);
    struct linear *l = linear_at(ptr);
    return l ? attribute(out, attr, l->ptr, l->size) : INVALID_VALUE;
}

/* ---- Linear memory and CUDA IPC between processes. ---- */


/* The table is shared by every thread of the process (publishers and an
 * engine allocate at once in one test process): one lock around finding a
 * free entry and filling it, and around emptying one, or two threads
 * could take the same entry and be handed the same memory. */
static pthread_mutex_t linear_lock = PTHREAD_MUTEX_INITIALIZER;

static struct linear *linear_at(u64 ptr) {
    struct linear *found = NULL;
    pthread_mutex_lock(&linear_lock);
    for (int i = 0; i < MAX && !found; i++)
        if (linears[i].size && ptr >= linears[i].ptr && ptr < linears[i].ptr + linears[i].size)
            found = &linears[i];
    pthread_mutex_unlock(&linear_lock);
    return found;
}

static int add_linear(u64 *out, int fd, size_t size, int imported) {
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return OUT_OF_MEMORY;
    pthread_mutex_lock(&linear_lock);
    for (int i = 0; i < MAX; i++)
        if (!linears[i].size) {
            linears[i] = (struct linear){(u64)(uintptr_t)p, size, fd, imported};
            *out = linears[i].ptr;
            pthread_mutex_unlock(&linear_lock);
            return OK;
        }
    pthread_mutex_unlock(&linear_lock);
    munmap(p, size);
    return OUT_OF_MEMORY;
}

static void drop_linear(struct linear *l) {
    pthread_mutex_lock(&linear_lock);
    u64 ptr = l->ptr;
    size_t size = l->size;
    int fd = l->fd;
    l->size = 0;
    pthread_mutex_unlock(&linear_lock);
    munmap((void *)(uintptr_t)ptr, size);
    close(fd);
}

int cuMemAlloc_v2(u64 *ptr, size_t size) {
    if (failing("cuMemAlloc") || size == 0) return INVALID_VALUE;
    int fd = memfd_create("fake_cuda_linear", 0);
    if (fd < 0 || ftruncate(fd, size) != 0) return OUT_OF_MEMORY;
    int r = add_linear(ptr, fd, size, 0);
    if (r != OK) close(fd);
    return r;
}
/* UCX's CUDA memory hooks (libucm_cuda), when they patch this library's
 * cuMemFree, ask it for the freed range. */
int cuMemGetAddressRange_v2(u64 *base, size_t *size, u64 ptr) {
    struct linear *l = linear_at(ptr);
    if (!l) return INVALID_VALUE;
    if (base) *base = l->ptr;
    if (size) *size = l->size;
    return OK;
}
int cuMemFree_v2(u64 ptr) {
    struct linear *l = linear_at(ptr);
    if (!l || l->ptr != ptr || l->imported) return INVALID_VALUE;
    drop_linear(l);
    return OK;
}

/* What a handle holds (CUipcMemHandle: 64 bytes). */
typedef struct { char reserved[64]; } ipc_handle;
struct handle_body { char magic[8]; int pid; int fd; u64 size; };

int cuIpcGetMemHandle(ipc_handle *h, u64 ptr) {
    struct linear *l = linear_at(ptr);
    if (!l || l->ptr != ptr || l->imported) return INVALID_VALUE;
    struct handle_body b = {"fakecud", getpid(), l->fd, l->size};
    memset(h, 0, sizeof *h);
    memcpy(h->reserved, &b, sizeof b);
    return OK;
}
int cuIpcOpenMemHandle_v2(u64 *ptr, ipc_handle h, unsigned flags) {
    (void)flags;
    struct handle_body b;
    memcpy(&b, h.reserved, sizeof b);
    if (memcmp(b.magic, "fakecud", 8)) return INVALID_VALUE;
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", b.pid, b.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    struct stat st;
    if (fd < 0) return INVALID_VALUE;
    if (fstat(fd, &st) != 0 || (u64)st.st_size != b.size) { close(fd); return INVALID_VALUE; }
    int r = add_linear(ptr, fd, b.size, 1);
    if (r != OK) close(fd);
    return r;
}
int cuIpcCloseMemHandle(u64 ptr) {
    struct linear *l = linear_at(ptr);
    if (!l || l->ptr != ptr || !l->imported) return INVALID_VALUE;
    drop_linear(l);
    return OK;
}

/* ---- Copies by address (device memory is host memory here). ---- */

int cuMemcpy(u64 dst, u64 src, size_t n) {
    memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    return OK;
}
int cuMemcpyHtoD_v2(u64 dst, const void *src, size_t n) {
    memcpy((void *)(uintptr_t)dst, src, n);
    return OK;
}
/* The fan-out's small copies (votes, message lengths): synchronous too. */
int cuMemcpyHtoDAsync_v2(u64 dst, const void *src, size_t n, void *stream) {
    (void)stream;
    return cuMemcpyHtoD_v2(dst, src, n);
}
int cuMemcpyDtoHAsync_v2(void *dst, u64 src, size_t n, void *stream) {
    (void)stream;
    memcpy(dst, (const void *)(uintptr_t)src, n);
    return OK;
}

/* CUDA_MEMCPY2D. Memory types: 1 host, 2 device, 4 unified. */
typedef struct {
    size_t srcXInBytes, srcY;
    int srcMemoryType;
    const void *srcHost;
    u64 srcDevice;
    void *srcArray;
    size_t srcPitch;
    size_t dstXInBytes, dstY;
    int dstMemoryType;
    void *dstHost;
    u64 dstDevice;
    void *dstArray;
    size_t dstPitch;
    size_t WidthInBytes, Height;
} memcpy2d;

static int copy_2d(const memcpy2d *p) {
    if (p->srcPitch < p->WidthInBytes || p->dstPitch < p->WidthInBytes) return INVALID_VALUE;
    if (p->srcMemoryType == 3 || p->dstMemoryType == 3) return INVALID_VALUE; /* arrays */
    const char *src = p->srcMemoryType == 1 ? (const char *)p->srcHost
                                             : (const char *)(uintptr_t)p->srcDevice;
    char *dst = p->dstMemoryType == 1 ? (char *)p->dstHost : (char *)(uintptr_t)p->dstDevice;
    src += p->srcY * p->srcPitch + p->srcXInBytes;
    dst += p->dstY * p->dstPitch + p->dstXInBytes;
    for (size_t r = 0; r < p->Height; r++)
        memcpy(dst + r * p->dstPitch, src + r * p->srcPitch, p->WidthInBytes);
    return OK;
}
int cuMemcpy2D_v2(const memcpy2d *p) {
    count("cuMemcpy2D");
    return failing("cuMemcpy2D") ? INVALID_VALUE : copy_2d(p);
}
int cuMemcpy2DAsync_v2(const memcpy2d *p, void *stream) {
    (void)stream;
    count("cuMemcpy2DAsync");
    return failing("cuMemcpy2DAsync") ? INVALID_VALUE : copy_2d(p);
}

/* ---- NVRTC and kernels ---- */

int cuDeviceGetAttribute(int *v, int attr, int dev) {
    (void)dev;
    *v = attr == 75 ? 9 : 0; /* compute capability 9.0 */
    return OK;
}

struct program { char *src; char name[64]; };
int nvrtcVersion(int *major, int *minor) { *major = 12; *minor = 8; return 0; }
int nvrtcCreateProgram(struct program **p, const char *src, const char *name, int nh, const char *const *h, const char *const *n) {
    (void)nh; (void)h; (void)n;
    *p = calloc(1, sizeof **p);
    (*p)->src = strdup(src);
    strncpy((*p)->name, name ? name : "", 63);
    return 0;
}
/* Fails (NVRTC_ERROR_COMPILATION, 6) without an architecture option. */
int nvrtcCompileProgram(struct program *p, int n, const char *const *opts) {
    (void)p;
    for (int i = 0; i < n; i++)
        if (!strncmp(opts[i], "--gpu-architecture=compute_", 27)) return failing("nvrtcCompileProgram") ? 6 : 0;
    return 6;
}
static const char PTX[] = "// fake PTX: the kernels of fp8.cu and delta.cu";
int nvrtcGetPTXSize(struct program *p, size_t *n) { (void)p; *n = sizeof PTX; return 0; }
int nvrtcGetPTX(struct program *p, char *out) { (void)p; memcpy(out, PTX, sizeof PTX); return 0; }
int nvrtcGetProgramLogSize(struct program *p, size_t *n) { (void)p; *n = 32; return 0; }
int nvrtcGetProgramLog(struct program *p, char *out) { (void)p; strcpy(out, "fake: compilation refused"); return 0; }
int nvrtcDestroyProgram(struct program **p) { free((*p)->src); free(*p); *p = 0; return 0; }

int cuModuleLoadData(void **m, const void *image) {
    if (strcmp(image, PTX)) return INVALID_VALUE;
    *m = (void *)0x4;
    return OK;
}
static const char *kernel_names[] = {"wm_fp8_amax", "wm_fp8_quantize", "wm_xxh3_blocks",
                                     "wm_xxh3_chain", "wm_delta_scatter"};
static int kernel_ids[5] = {1, 2, 3, 4, 5};
int cuModuleGetFunction(void **f, void *m, const char *name) {
    (void)m;
    for (int i = 0; i < 5; i++)
        if (!strcmp(name, kernel_names[i])) {
            *f = &kernel_ids[i];
            return OK;
        }
    return 500; /* CUDA_ERROR_NOT_FOUND */
}

/* The kernels' prelude on the host: a thread is a call. */
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
struct wm_dim { unsigned x; };
static __thread struct wm_dim blockIdx, threadIdx, blockDim, gridDim;
#define WM_KERNEL static
#define WM_DEVICE static inline
#define WM_FIRST_THREAD ((u64)blockIdx.x * blockDim.x + threadIdx.x)
#define WM_THREADS ((u64)gridDim.x * blockDim.x)
static inline float wm_mul(float a, float b) { return a * b; }
static inline float wm_add(float a, float b) { return a + b; }
static inline u32 wm_bits(float f) { u32 u; memcpy(&u, &f, 4); return u; }
static inline float wm_float(u32 u) { float f; memcpy(&f, &u, 4); return f; }
static inline void wm_min_u64(u64 *at, u64 v) { if (v < *at) *at = v; }
static inline void wm_group_max(u32 *at, u64 key, u32 v) { (void)key; if (v > *at) *at = v; }
static inline void wm_load32(const void *p, u32 *w) { memcpy(w, p, 32); }
static inline void wm_store16(void *p, const u32 *w) { memcpy(p, w, 16); }
#include "fp8.cu"
#include "delta.cu"

#define ARG(i, type) (*(type *)params[i])
/* One thread of kernel `id`'s launch. */
static void run_thread(int id, void **params) {
    switch (id) {
    case 1: wm_fp8_amax(ARG(0, struct wm_fp8_run), ARG(1, u32 *), ARG(2, u64 *)); break;
    case 2: wm_fp8_quantize(ARG(0, struct wm_fp8_run), ARG(1, const float *), ARG(2, u8 *)); break;
    case 3:
        wm_xxh3_blocks(ARG(0, const struct wm_hash_piece *), ARG(1, u64), ARG(2, u64),
                       ARG(3, const u8 *), ARG(4, u64 *));
        break;
    case 4:
        wm_xxh3_chain(ARG(0, const struct wm_hash_piece *), ARG(1, u64), ARG(2, const u8 *),
                      ARG(3, const u64 *), ARG(4, u64 *));
        break;
    default:
        wm_delta_scatter(ARG(0, u8 *), ARG(1, const u32 *), ARG(2, const u8 *), ARG(3, u64),
                         ARG(4, u32));
    }
}

int cuLaunchKernel(int *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned shared, void *stream, void **params, void **extra) {
    (void)shared; (void)stream; (void)extra;
    count("cuLaunchKernel");
    if (failing("cuLaunchKernel") || gy != 1 || gz != 1 || by != 1 || bz != 1 || !gx || !bx || bx > 1024)
        return INVALID_VALUE;
    gridDim.x = gx;
    blockDim.x = bx;
    for (blockIdx.x = 0; blockIdx.x < gx; blockIdx.x++)
        for (threadIdx.x = 0; threadIdx.x < bx; threadIdx.x++) run_thread(*f, params);
    return OK;
}
