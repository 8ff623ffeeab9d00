/* A test-only NCCL for the fan-out under the fake CUDA driver
 * (tests/fake_cuda.c, whose device memory is host memory): the ranks of a
 * communicator are real processes meeting in a shared memory file named by
 * the unique id, and every collective runs at once on the calling thread
 * (streams are the fake driver's tokens, its copies synchronous), so the
 * library's fan-out runs end to end between processes on a machine
 * without GPUs. Only what `crates/core/src/fanout/nccl.rs` calls: version
 * 2.19, non-blocking communicators (every call returns done), in-place
 * int8 broadcast and int32 MIN all-reduce. Every wait is bounded
 * (FAKE_NCCL_WAIT_S seconds, default 60); a rank that aborts fails the
 * others' waits at once (ncclRemoteError).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

enum { SUCCESS = 0, SYSTEM_ERROR = 2, INVALID_ARGUMENT = 4, REMOTE_ERROR = 6 };
enum { ID_BYTES = 128, MAX_RANKS = 64, CHUNK = 4 << 20 };

typedef struct { char internal[ID_BYTES]; } ncclUniqueId;

struct shared {
    unsigned joined;
    unsigned aborted;
    unsigned arrived;
    unsigned generation;
    int32_t values[MAX_RANKS];
    unsigned char data[CHUNK];
};

struct comm {
    struct shared *s;
    int ranks, rank;
    int error;
};

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static double wait_s(void) {
    const char *e = getenv("FAKE_NCCL_WAIT_S");
    return e ? atof(e) : 60.0;
}

/* Wait while *word == value: SUCCESS, or an error when a rank aborted or
 * the wait ran out. */
static int wait_while(struct comm *c, unsigned *word, unsigned value) {
    double until = now() + wait_s();
    while (__atomic_load_n(word, __ATOMIC_ACQUIRE) == value) {
        if (__atomic_load_n(&c->s->aborted, __ATOMIC_ACQUIRE))
            return c->error = REMOTE_ERROR;
        if (now() > until)
            return c->error = SYSTEM_ERROR;
        usleep(20);
    }
    return SUCCESS;
}

/* Every rank of the communicator arrives before any leaves. */
static int barrier(struct comm *c) {
    unsigned g = __atomic_load_n(&c->s->generation, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&c->s->arrived, 1, __ATOMIC_ACQ_REL) == (unsigned)c->ranks) {
        __atomic_store_n(&c->s->arrived, 0, __ATOMIC_RELAXED);
        __atomic_add_fetch(&c->s->generation, 1, __ATOMIC_RELEASE);
        return SUCCESS;
    }
    return wait_while(c, &c->s->generation, g);
}

static void path_of(const ncclUniqueId *id, char *out, size_t n) {
    char hex[33];
    for (int i = 0; i < 16; i++)
        snprintf(hex + 2 * i, 3, "%02x", (unsigned char)id->internal[i]);
    snprintf(out, n, "/dev/shm/fake_nccl_%s", hex);
}

int ncclGetVersion(int *v) { *v = 21903; return SUCCESS; }

const char *ncclGetErrorString(int r) {
    switch (r) {
    case REMOTE_ERROR: return "fake NCCL: a peer aborted";
    case SYSTEM_ERROR: return "fake NCCL: a wait ran out";
    default: return "fake NCCL: error";
    }
}

int ncclGetUniqueId(ncclUniqueId *id) {
    int fd = open("/dev/urandom", O_RDONLY);
    if (fd < 0 || read(fd, id->internal, ID_BYTES) != ID_BYTES) {
        if (fd >= 0) close(fd);
        return SYSTEM_ERROR;
    }
    close(fd);
    return SUCCESS;
}

int ncclCommInitRankConfig(void **out, int ranks, ncclUniqueId id, int rank, void *config) {
    (void)config;
    *out = NULL;
    if (ranks < 1 || ranks > MAX_RANKS || rank < 0 || rank >= ranks)
        return INVALID_ARGUMENT;
    char path[64];
    path_of(&id, path, sizeof path);
    int fd = open(path, O_RDWR | O_CREAT, 0600);
    if (fd < 0)
        return SYSTEM_ERROR;
    if (ftruncate(fd, sizeof(struct shared)) != 0) {
        close(fd);
        return SYSTEM_ERROR;
    }
    void *m = mmap(NULL, sizeof(struct shared), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED)
        return SYSTEM_ERROR;
    struct comm *c = calloc(1, sizeof *c);
    c->s = m;
    c->ranks = ranks;
    c->rank = rank;
    __atomic_add_fetch(&c->s->joined, 1, __ATOMIC_ACQ_REL);
    double until = now() + wait_s();
    while (__atomic_load_n(&c->s->joined, __ATOMIC_ACQUIRE) < (unsigned)ranks) {
        if (now() > until) {
            munmap(c->s, sizeof(struct shared));
            free(c);
            return SYSTEM_ERROR;
        }
        usleep(50);
    }
    if (rank == 0)
        unlink(path); /* every rank has it mapped */
    *out = c;
    return SUCCESS;
}

int ncclCommGetAsyncError(void *comm, int *state) {
    *state = ((struct comm *)comm)->error;
    return SUCCESS;
}

int ncclBroadcast(const void *send, void *recv, size_t count, int dtype, int root, void *comm,
                  void *stream) {
    (void)stream;
    struct comm *c = comm;
    if (dtype != 0 || root < 0 || root >= c->ranks)
        return INVALID_ARGUMENT;
    if (c->error)
        return c->error;
    if (c->rank == root && send != recv)
        memmove(recv, send, count);
    for (size_t at = 0; at < count; at += CHUNK) {
        size_t n = count - at < CHUNK ? count - at : CHUNK;
        if (c->rank == root)
            memcpy(c->s->data, (const char *)send + at, n);
        int r = barrier(c);
        if (r == SUCCESS && c->rank != root)
            memcpy((char *)recv + at, c->s->data, n);
        if (r == SUCCESS)
            r = barrier(c);
        if (r != SUCCESS)
            return SUCCESS; /* the error is the communicator's state */
    }
    return SUCCESS;
}

int ncclAllReduce(const void *send, void *recv, size_t count, int dtype, int op, void *comm,
                  void *stream) {
    (void)stream;
    struct comm *c = comm;
    if (count != 1 || dtype != 2 || op != 3)
        return INVALID_ARGUMENT;
    if (c->error)
        return c->error;
    c->s->values[c->rank] = *(const int32_t *)send;
    if (barrier(c) != SUCCESS)
        return SUCCESS;
    int32_t min = c->s->values[0];
    for (int i = 1; i < c->ranks; i++)
        if (c->s->values[i] < min)
            min = c->s->values[i];
    if (barrier(c) != SUCCESS)
        return SUCCESS;
    *(int32_t *)recv = min;
    return SUCCESS;
}

int ncclCommFinalize(void *comm) { (void)comm; return SUCCESS; }

int ncclCommDestroy(void *comm) {
    struct comm *c = comm;
    munmap(c->s, sizeof(struct shared));
    free(c);
    return SUCCESS;
}

int ncclCommAbort(void *comm) {
    struct comm *c = comm;
    if (!c)
        return SUCCESS;
    __atomic_store_n(&c->s->aborted, 1, __ATOMIC_RELEASE);
    munmap(c->s, sizeof(struct shared));
    free(c);
    return SUCCESS;
}
