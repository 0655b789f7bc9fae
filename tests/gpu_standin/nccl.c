/* The NCCL subset rvod loads (libnccl's C ABI), for tests: communicators among the ranks (processes or
 * threads) of one host through a POSIX shared-memory segment the unique id names, collectives and
 * send/receive run in stream order by the stream's worker, and NCCL's failures (duplicate GPU, a peer that
 * dies or aborts, injected errors) as NCCL reports them. See README.md. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "standin.h"

enum {
    NCCL_SUCCESS = 0,
    NCCL_UNHANDLED_CUDA_ERROR = 1,
    NCCL_SYSTEM_ERROR = 2,
    NCCL_INTERNAL_ERROR = 3,
    NCCL_INVALID_ARGUMENT = 4,
    NCCL_INVALID_USAGE = 5,
    NCCL_REMOTE_ERROR = 6,
    NCCL_IN_PROGRESS = 7,
};
enum { OP_SUM, OP_PROD, OP_MAX, OP_MIN, OP_AVG, BUILTIN_OPS, OP_PREMULSUM = BUILTIN_OPS };
enum { K_ALLREDUCE = 1, K_BROADCAST, K_ALLGATHER, K_REDUCESCATTER, K_SEND, K_RECV };
enum { RANK_NONE, RANK_ALIVE, RANK_ABORTED, RANK_DESTROYED };

#define MAX_RANKS 64
#define MAX_CUSTOM_OPS 64
#define COMM_MAGIC 0x434f4d4du
#define ID_MAGIC "rvod-standin-id"
#define SHM_PREFIX "/rvod-standin-"
#define DEFAULT_VERSION 22105

/* ---- the shared segment ---- */

struct desc { /* what a rank runs at one step, checked against every other rank's */
    int32_t kind, dtype, op, root;
    uint64_t count;
    double scale; /* PreMulSum's factor for this rank's input */
};

struct rank_info {
    atomic_int arrived;
    atomic_int state;
    int32_t pid, device, physical, pad;
    _Atomic uint64_t published, consumed;
    struct desc desc;
    char pad2[40];
};

struct header {
    char magic[16];
    atomic_int ready, arrivals;
    int32_t nranks, pad;
    uint64_t slot_bytes, channel_bytes, total;
    struct rank_info ranks[];
};

struct channel {
    atomic_int full;
    int32_t pad;
    uint64_t total, len;
    char pad2[40];
};

struct custom_op {
    int used, dtype;
    double scale; /* host-immediate */
    const uint8_t *device_scalar; /* device residence: read when the collective runs */
};

struct comm {
    uint32_t magic;
    int rank, nranks, device, physical;
    struct header *shm;
    size_t mapped;
    atomic_int aborted;
    int dead; /* destroyed or aborted: calls on it are refused */
    atomic_int async_error;
    atomic_int pending; /* enqueued items not yet finished */
    pthread_mutex_t order; /* keeps enqueue order = execution order across streams */
    si_stream *last_stream;
    uint64_t last_seq, step;
    struct custom_op ops[MAX_CUSTOM_OPS];
    char error[1024];
    struct comm *next;
};

static struct comm *comms; /* every communicator ever made; never freed, so stale handles are recognised */
static pthread_mutex_t comms_lock = PTHREAD_MUTEX_INITIALIZER;
static char last_error[1024];
static pthread_mutex_t error_lock = PTHREAD_MUTEX_INITIALIZER;

static size_t header_bytes(int n) { return (sizeof(struct header) + (size_t)n * sizeof(struct rank_info) + 63) / 64 * 64; }
static uint8_t *slot(struct comm *c, int rank) { return (uint8_t *)c->shm + header_bytes(c->nranks) + (size_t)rank * c->shm->slot_bytes; }
static struct channel *channel(struct comm *c, int from, int to) {
    uint8_t *base = (uint8_t *)c->shm + header_bytes(c->nranks) + (size_t)c->nranks * c->shm->slot_bytes;
    return (struct channel *)(base + (size_t)(from * c->nranks + to) * (sizeof(struct channel) + c->shm->channel_bytes));
}

/* Record an error's text (for ncclGetLastError, globally and on `c`) and return its code. */
static int fail(struct comm *c, int code, const char *fmt, ...) {
    char text[1024];
    va_list args;
    va_start(args, fmt);
    vsnprintf(text, sizeof text, fmt, args);
    va_end(args);
    pthread_mutex_lock(&error_lock);
    snprintf(last_error, sizeof last_error, "%s", text);
    if (c) snprintf(c->error, sizeof c->error, "%s", text);
    pthread_mutex_unlock(&error_lock);
    return code;
}

static int injected(const char *name, int device, struct comm *c) {
    char text[512];
    int code = si_injected(name, device, text, sizeof text);
    return code ? fail(c, code, "%s", text) : 0;
}

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static void pause_briefly(unsigned *spins) {
    if (++*spins < 64) {
        sched_yield();
        return;
    }
    struct timespec t = {0, *spins < 1000 ? 20000 : 200000};
    nanosleep(&t, NULL);
}

/* Whether process `pid` has exited (a zombie counts: it is dead, only not yet reaped). */
static int process_gone(int pid) {
    if (pid == getpid()) return 0;
    if (kill(pid, 0) != 0 && errno == ESRCH) return 1;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *close = strrchr(buf, ')');
    return close && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X');
}

static const char *call_name(int kind) {
    static const char *names[] = {"?", "ncclAllReduce", "ncclBroadcast", "ncclAllGather", "ncclReduceScatter", "ncclSend", "ncclRecv"};
    return kind >= 1 && kind <= 6 ? names[kind] : "?";
}

/* Whether peer `q` can still take part; 0, or the NCCL error naming it. `*checked` paces the process check. */
static int peer_alive(struct comm *c, int q, const char *what, double *checked) {
    struct rank_info *p = &c->shm->ranks[q];
    int state = atomic_load(&p->state);
    if (state == RANK_ABORTED || state == RANK_DESTROYED)
        return fail(c, NCCL_REMOTE_ERROR, "rank %d (pid %d, GPU %d) %s its communicator while rank %d (GPU %d) waited for it in %s",
                    q, p->pid, p->device, state == RANK_ABORTED ? "aborted" : "destroyed", c->rank, c->device, what);
    double t = now_ms();
    if (t - *checked > 20) {
        *checked = t;
        if (process_gone(p->pid))
            return fail(c, NCCL_REMOTE_ERROR, "rank %d (pid %d, GPU %d) exited while rank %d (GPU %d) waited for it in %s",
                        q, p->pid, p->device, c->rank, c->device, what);
    }
    return 0;
}

#define ABORTED (-1)

/* Wait until every rank's `published` (or `consumed`) counter reaches `k`: 0, ABORTED, or an NCCL error. */
static int wait_ranks(struct comm *c, int consumed, uint64_t k, const char *what) {
    unsigned spins = 0;
    double checked = now_ms();
    for (;;) {
        int lagging = -1;
        for (int q = 0; q < c->nranks && lagging < 0; q++) {
            struct rank_info *p = &c->shm->ranks[q];
            uint64_t v = consumed ? atomic_load_explicit(&p->consumed, memory_order_acquire)
                                  : atomic_load_explicit(&p->published, memory_order_acquire);
            if (v < k) lagging = q;
        }
        if (lagging < 0) return 0;
        if (atomic_load(&c->aborted)) return ABORTED;
        int error = peer_alive(c, lagging, what, &checked);
        if (error) return error;
        pause_briefly(&spins);
    }
}

static const char *dtype_name(int dtype) {
    static const char *names[] = {"int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64", "bfloat16"};
    return dtype >= 0 && dtype <= 9 ? names[dtype] : "?";
}

static void describe(char *out, size_t cap, int q, const struct desc *d) {
    static const char *ops[] = {"sum", "prod", "max", "min", "avg", "premulsum"};
    if (d->kind == K_BROADCAST)
        snprintf(out, cap, "rank %d called %s(%llu x %s, root %d)", q, call_name(d->kind), (unsigned long long)d->count, dtype_name(d->dtype), d->root);
    else if (d->kind == K_ALLGATHER)
        snprintf(out, cap, "rank %d called %s(%llu x %s)", q, call_name(d->kind), (unsigned long long)d->count, dtype_name(d->dtype));
    else
        snprintf(out, cap, "rank %d called %s(%llu x %s, %s)", q, call_name(d->kind), (unsigned long long)d->count, dtype_name(d->dtype),
                 d->op >= 0 && d->op <= OP_PREMULSUM ? ops[d->op] : "?");
}

/* One step of a collective: wait until every rank has read the previous step, put `len` bytes (from
 * `pieces` of `piece` bytes each, `stride` apart in `src`) and the description in this rank's slot, and wait
 * until every rank has published this step with the same description. */
static int publish(struct comm *c, const struct desc *d, const uint8_t *src, size_t pieces, size_t piece, size_t stride) {
    uint64_t k = c->step + 1;
    int status = wait_ranks(c, 1, k - 1, call_name(d->kind));
    if (status) return status;
    struct rank_info *me = &c->shm->ranks[c->rank];
    me->desc = *d;
    for (size_t i = 0; i < pieces && src; i++) memcpy(slot(c, c->rank) + i * piece, src + i * stride, piece);
    atomic_store_explicit(&me->published, k, memory_order_release);
    status = wait_ranks(c, 0, k, call_name(d->kind));
    if (status) return status;
    c->step = k;
    for (int q = 0; q < c->nranks; q++) {
        const struct desc *o = &c->shm->ranks[q].desc;
        if (o->kind != d->kind || o->dtype != d->dtype || o->count != d->count || o->root != d->root || o->op != d->op) {
            char mine[160], theirs[160];
            describe(mine, sizeof mine, c->rank, d);
            describe(theirs, sizeof theirs, q, o);
            return fail(c, NCCL_INVALID_USAGE, "collective mismatch on a communicator of %d ranks: %s, %s", c->nranks, mine, theirs);
        }
    }
    return 0;
}

static void consume(struct comm *c) {
    atomic_store_explicit(&c->shm->ranks[c->rank].consumed, c->step, memory_order_release);
}

/* ---- element types and reductions ---- */

static size_t dtype_size(int dtype) {
    static const size_t sizes[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};
    return dtype >= 0 && dtype <= 9 ? sizes[dtype] : 0;
}

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0 && man == 0) bits = sign;
    else if (exp == 0) {
        exp = 113;
        while (!(man & 0x400)) {
            man <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    } else if (exp == 31) bits = sign | 0x7f800000u | (man << 13);
    else bits = sign | ((exp + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint16_t float_to_half(float f) { /* round to nearest even */
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000, man = x & 0x7fffff;
    int exp = (int)((x >> 23) & 0xff);
    if (exp == 0xff) return (uint16_t)(sign | 0x7c00 | (man ? 0x200 : 0));
    int e = exp - 127 + 15;
    if (e >= 31) return (uint16_t)(sign | 0x7c00);
    if (e <= 0) {
        if (e < -10) return (uint16_t)sign;
        man |= 0x800000;
        int shift = 14 - e;
        uint32_t h = man >> shift, rest = man & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rest > half || (rest == half && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((uint32_t)e << 10) | (man >> 13), rest = man & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;
    return (uint16_t)(sign | h);
}

static float bf16_to_float(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint16_t float_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffff) > 0x7f800000) return (uint16_t)((x >> 16) | 0x40);
    return (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

static double load_float(int dtype, const uint8_t *p) {
    uint16_t h;
    float f;
    double d;
    switch (dtype) {
    case 6: memcpy(&h, p, 2); return half_to_float(h);
    case 9: memcpy(&h, p, 2); return bf16_to_float(h);
    case 7: memcpy(&f, p, 4); return f;
    default: memcpy(&d, p, 8); return d;
    }
}

static void store_float(int dtype, uint8_t *p, double v) {
    uint16_t h;
    float f = (float)v;
    switch (dtype) {
    case 6: h = float_to_half(f); memcpy(p, &h, 2); break;
    case 9: h = float_to_bf16(f); memcpy(p, &h, 2); break;
    case 7: memcpy(p, &f, 4); break;
    default: memcpy(p, &v, 8); break;
    }
}

/* One value of `dtype` at `p`, as a double (a PreMulSum factor). */
static double scalar_value(int dtype, const uint8_t *p) {
    int8_t i8;
    uint8_t u8;
    int32_t i32;
    uint32_t u32;
    int64_t i64;
    uint64_t u64;
    switch (dtype) {
    case 0: memcpy(&i8, p, 1); return i8;
    case 1: memcpy(&u8, p, 1); return u8;
    case 2: memcpy(&i32, p, 4); return i32;
    case 3: memcpy(&u32, p, 4); return u32;
    case 4: memcpy(&i64, p, 8); return (double)i64;
    case 5: memcpy(&u64, p, 8); return (double)u64;
    default: return load_float(dtype, p);
    }
}

/* out[i] = op over ranks q of in[q][i] (times scale[q] for PreMulSum), in rank order. Integers wrap. */
#define REDUCE_INT(T, U)                                                                                  \
    for (size_t i = 0; i < count; i++) {                                                                  \
        T acc = 0, v;                                                                                     \
        for (int q = 0; q < n; q++) {                                                                     \
            memcpy(&v, in[q] + i * sizeof(T), sizeof(T));                                                 \
            if (op == OP_PREMULSUM) v = (T)((U)v * (U)(T)scale[q]);                                       \
            if (q == 0) acc = v;                                                                          \
            else if (op == OP_PROD) acc = (T)((U)acc * (U)v);                                             \
            else if (op == OP_MAX) acc = v > acc ? v : acc;                                               \
            else if (op == OP_MIN) acc = v < acc ? v : acc;                                               \
            else acc = (T)((U)acc + (U)v);                                                                \
        }                                                                                                 \
        if (op == OP_AVG) acc = (T)(acc / (T)n);                                                          \
        memcpy(out + i * sizeof(T), &acc, sizeof(T));                                                     \
    }

static void reduce(int dtype, int op, uint8_t *out, const uint8_t **in, const double *scale, int n, size_t count) {
    switch (dtype) {
    case 0: REDUCE_INT(int8_t, uint8_t) break;
    case 1: REDUCE_INT(uint8_t, uint8_t) break;
    case 2: REDUCE_INT(int32_t, uint32_t) break;
    case 3: REDUCE_INT(uint32_t, uint32_t) break;
    case 4: REDUCE_INT(int64_t, uint64_t) break;
    case 5: REDUCE_INT(uint64_t, uint64_t) break;
    default: {
        size_t size = dtype_size(dtype);
        for (size_t i = 0; i < count; i++) {
            double acc = 0;
            for (int q = 0; q < n; q++) {
                double v = load_float(dtype, in[q] + i * size);
                if (op == OP_PREMULSUM) v *= scale[q];
                if (q == 0) acc = v;
                else if (op == OP_PROD) acc *= v;
                else if (op == OP_MAX) acc = v > acc ? v : acc;
                else if (op == OP_MIN) acc = v < acc ? v : acc;
                else acc += v;
            }
            if (op == OP_AVG) acc /= n;
            store_float(dtype, out + i * size, acc);
        }
    }
    }
}

/* ---- running operations (on a stream's worker) ---- */

struct op {
    int kind, dtype, op, root, peer;
    uint64_t count;
    const uint8_t *send; /* the library's view of the device buffers */
    uint8_t *recv;
    double scale;
    const uint8_t *device_scalar;
};

static int run_collective(struct comm *c, struct op *o) {
    int n = c->nranks, r = c->rank;
    size_t size = dtype_size(o->dtype), slot_bytes = c->shm->slot_bytes;
    double scale = o->device_scalar ? scalar_value(o->dtype, o->device_scalar) : o->scale;
    struct desc d = {.kind = o->kind, .dtype = o->dtype, .op = o->op, .root = o->root, .count = o->count, .scale = scale};
    if (o->kind == K_BROADCAST || o->kind == K_ALLGATHER) d.op = 0;
    if (o->kind != K_BROADCAST) d.root = 0;
    const uint8_t *in[MAX_RANKS];
    double scales[MAX_RANKS];
    size_t per = o->kind == K_REDUCESCATTER ? slot_bytes / ((size_t)n * size) : slot_bytes / size;
    for (uint64_t at = 0; at < o->count; at += per) {
        size_t m = o->count - at < per ? (size_t)(o->count - at) : per, bytes = m * size;
        int status;
        switch (o->kind) {
        case K_ALLREDUCE:
            status = publish(c, &d, o->send + at * size, 1, bytes, 0);
            if (status) return status;
            for (int q = 0; q < n; q++) {
                in[q] = slot(c, q);
                scales[q] = c->shm->ranks[q].desc.scale;
            }
            reduce(o->dtype, o->op, o->recv + at * size, in, scales, n, m);
            break;
        case K_BROADCAST:
            status = publish(c, &d, r == o->root ? o->send + at * size : NULL, 1, bytes, 0);
            if (status) return status;
            memmove(o->recv + at * size, slot(c, o->root), bytes);
            break;
        case K_ALLGATHER:
            status = publish(c, &d, o->send + at * size, 1, bytes, 0);
            if (status) return status;
            for (int q = 0; q < n; q++) memcpy(o->recv + ((size_t)q * o->count + at) * size, slot(c, q), bytes);
            break;
        default: /* K_REDUCESCATTER: block b of this step's slot holds this rank's part for rank b */
            status = publish(c, &d, o->send + at * size, (size_t)n, bytes, o->count * size);
            if (status) return status;
            for (int q = 0; q < n; q++) {
                in[q] = slot(c, q) + (size_t)r * bytes;
                scales[q] = c->shm->ranks[q].desc.scale;
            }
            reduce(o->dtype, o->op, o->recv + at * size, in, scales, n, m);
            break;
        }
        consume(c);
    }
    return 0;
}

/* Every send and receive of a group, progressed together (their order on each peer is kept). */
static int run_p2p(struct comm *c, struct op *ops, int nops) {
    uint64_t done_bytes[nops > 0 ? nops : 1];
    memset(done_bytes, 0, sizeof done_bytes);
    unsigned spins = 0;
    double checked = now_ms();
    for (;;) {
        int remaining = 0, progressed = 0, waiting_on = -1;
        for (int i = 0; i < nops; i++) {
            struct op *o = &ops[i];
            uint64_t total = o->count * dtype_size(o->dtype);
            if ((o->kind != K_SEND && o->kind != K_RECV) || done_bytes[i] >= total) continue;
            int earlier = 0;
            for (int j = 0; j < i; j++)
                earlier |= ops[j].kind == o->kind && ops[j].peer == o->peer && done_bytes[j] < ops[j].count * dtype_size(ops[j].dtype);
            remaining++;
            waiting_on = o->peer;
            if (earlier) continue;
            if (o->kind == K_SEND) {
                struct channel *ch = channel(c, c->rank, o->peer);
                if (atomic_load_explicit(&ch->full, memory_order_acquire)) continue;
                uint64_t len = total - done_bytes[i] < c->shm->channel_bytes ? total - done_bytes[i] : c->shm->channel_bytes;
                memcpy((uint8_t *)(ch + 1), o->send + done_bytes[i], len);
                ch->total = total;
                ch->len = len;
                atomic_store_explicit(&ch->full, 1, memory_order_release);
                done_bytes[i] += len;
            } else {
                struct channel *ch = channel(c, o->peer, c->rank);
                if (!atomic_load_explicit(&ch->full, memory_order_acquire)) continue;
                if (ch->total != total)
                    return fail(c, NCCL_INVALID_USAGE, "rank %d sent a message of %llu bytes to rank %d, which expected %llu bytes (ncclSend and ncclRecv counts or types differ)",
                                o->peer, (unsigned long long)ch->total, c->rank, (unsigned long long)total);
                memcpy(o->recv + done_bytes[i], (uint8_t *)(ch + 1), ch->len);
                done_bytes[i] += ch->len;
                atomic_store_explicit(&ch->full, 0, memory_order_release);
            }
            progressed = 1;
            if (done_bytes[i] >= total) remaining--;
        }
        if (!remaining) return 0;
        if (progressed) {
            spins = 0;
            continue;
        }
        if (atomic_load(&c->aborted)) return ABORTED;
        int error = peer_alive(c, waiting_on, "ncclSend/ncclRecv", &checked);
        if (error) return error;
        pause_briefly(&spins);
    }
}

struct group_item {
    struct comm *c;
    int nops;
    struct op ops[];
};

static void run_group(void *arg) {
    struct group_item *g = arg;
    struct comm *c = g->c;
    int status = atomic_load(&c->aborted) ? ABORTED : run_p2p(c, g->ops, g->nops);
    for (int i = 0; i < g->nops && !status; i++)
        if (g->ops[i].kind != K_SEND && g->ops[i].kind != K_RECV) status = run_collective(c, &g->ops[i]);
    if (status > 0) {
        /* As on a GPU: the kernel cannot finish; the error shows in ncclCommGetAsyncError, and the stream
         * stays stuck until ncclCommAbort. */
        int none = NCCL_SUCCESS;
        atomic_compare_exchange_strong(&c->async_error, &none, status);
        while (!atomic_load(&c->aborted)) {
            struct timespec t = {0, 1000000};
            nanosleep(&t, NULL);
        }
    }
    atomic_fetch_sub(&c->pending, 1);
    free(g);
}

/* ---- groups and enqueueing ---- */

struct queued {
    struct comm *c;
    si_stream *stream;
    struct op op;
};
static __thread int group_depth, group_error, group_count, group_cap;
static __thread struct queued *group_ops;

static int submit(struct queued *ops, int n) {
    for (int i = 0; i < n; i++) {
        if (!ops[i].c) continue; /* taken with an earlier communicator */
        struct comm *c = ops[i].c;
        int count = 0;
        for (int j = i; j < n; j++) count += ops[j].c == c;
        struct group_item *g = malloc(sizeof *g + (size_t)count * sizeof(struct op));
        if (!g) return fail(c, NCCL_SYSTEM_ERROR, "out of host memory");
        g->c = c;
        g->nops = 0;
        si_stream *stream = ops[i].stream;
        for (int j = i; j < n; j++) {
            if (ops[j].c != c) continue;
            if (ops[j].stream != stream) {
                free(g);
                return fail(c, NCCL_INVALID_USAGE, "the GPU stand-in runs one group's operations on one communicator on one stream; rank %d used two", c->rank);
            }
            g->ops[g->nops++] = ops[j].op;
            ops[j].c = NULL;
        }
        pthread_mutex_lock(&c->order);
        atomic_fetch_add(&c->pending, 1);
        c->last_seq = si_enqueue(stream, run_group, g, c->last_stream, c->last_seq);
        c->last_stream = stream;
        pthread_mutex_unlock(&c->order);
    }
    return NCCL_SUCCESS;
}

static struct comm *live_comm(void *handle) {
    pthread_mutex_lock(&comms_lock);
    struct comm *found = NULL;
    for (struct comm *c = comms; c && !found; c = c->next)
        if (c == handle && c->magic == COMM_MAGIC) found = c;
    pthread_mutex_unlock(&comms_lock);
    return found;
}

/* The checks NCCL makes (and the pointer checks it makes with NCCL_CHECK_POINTERS=1), then the operation,
 * queued in the open group or enqueued now. */
static int enqueue(const char *call, void *handle, struct op o, const void *send, size_t send_bytes, void *recv,
                   size_t recv_bytes, void *stream) {
    struct comm *c = live_comm(handle);
    if (!c) return fail(NULL, NCCL_INVALID_ARGUMENT, "%s: invalid communicator %p", call, handle);
    int status = injected(call, c->device, c);
    if (status) return status;
    if (c->dead) return fail(c, NCCL_INVALID_ARGUMENT, "%s: the communicator of rank %d was destroyed or aborted", call, c->rank);
    status = atomic_load(&c->async_error);
    if (status) return status;
    size_t size = dtype_size(o.dtype);
    if (!size) return fail(c, NCCL_INVALID_ARGUMENT, "%s: invalid data type %d", call, o.dtype);
    if (o.kind == K_ALLREDUCE || o.kind == K_REDUCESCATTER) {
        int version = (int)si_env_long("RVOD_STANDIN_NCCL_VERSION", DEFAULT_VERSION);
        if (o.op < 0 || (o.op == OP_AVG && version < 21000)) return fail(c, NCCL_INVALID_ARGUMENT, "%s: invalid reduction operation %d", call, o.op);
        if (o.op >= BUILTIN_OPS) {
            int i = o.op - BUILTIN_OPS;
            if (i >= MAX_CUSTOM_OPS || !c->ops[i].used)
                return fail(c, NCCL_INVALID_ARGUMENT, "%s: reduction operation %d was not created on this communicator", call, o.op);
            if (c->ops[i].dtype != o.dtype)
                return fail(c, NCCL_INVALID_ARGUMENT, "%s: reduction operation %d was created for %s, used with %s", call, o.op,
                            dtype_name(c->ops[i].dtype), dtype_name(o.dtype));
            o.scale = c->ops[i].scale;
            o.device_scalar = c->ops[i].device_scalar;
            o.op = OP_PREMULSUM;
        }
    }
    if (o.kind == K_BROADCAST && (o.root < 0 || o.root >= c->nranks))
        return fail(c, NCCL_INVALID_ARGUMENT, "%s: root %d is not a rank of this communicator of %d", call, o.root, c->nranks);
    if ((o.kind == K_SEND || o.kind == K_RECV) && (o.peer < 0 || o.peer >= c->nranks))
        return fail(c, NCCL_INVALID_ARGUMENT, "%s: peer %d is not a rank of this communicator of %d", call, o.peer, c->nranks);
    if (o.count > SIZE_MAX / size / (size_t)c->nranks)
        return fail(c, NCCL_INVALID_ARGUMENT, "%s: count %llu is too large", call, (unsigned long long)o.count);
    const void *buffers[2] = {send, recv};
    size_t lengths[2] = {send_bytes, recv_bytes};
    const char *names[2] = {"sendbuff", "recvbuff"};
    uint8_t *views[2] = {NULL, NULL};
    for (int b = 0; b < 2; b++) {
        if (lengths[b] == 0) continue;
        int device;
        int where = si_device_memory(buffers[b], lengths[b], &device, &views[b]);
        if (where == SI_HOST)
            return fail(c, NCCL_INVALID_ARGUMENT, "%s: %s %p is not device memory (rank %d, GPU %d)", call, names[b], buffers[b], c->rank, c->device);
        if (where == SI_BAD_RANGE)
            return fail(c, NCCL_INVALID_ARGUMENT, "%s: %s %p + %zu bytes is not inside one cudaMalloc allocation (rank %d, GPU %d)", call,
                        names[b], buffers[b], lengths[b], c->rank, c->device);
        if (device != c->device)
            return fail(c, NCCL_INVALID_ARGUMENT, "%s: %s %p allocated on device %d mismatches with NCCL device %d (rank %d)", call,
                        names[b], buffers[b], device, c->device, c->rank);
    }
    o.send = views[0];
    o.recv = views[1];
    si_stream *s;
    if (si_stream_of(stream, c->device, &s) != 0)
        return fail(c, NCCL_UNHANDLED_CUDA_ERROR, "%s: Cuda failure 'invalid resource handle': stream %p is not a live stream", call, stream);
    if (si_stream_device(s) != c->device)
        return fail(c, NCCL_UNHANDLED_CUDA_ERROR, "%s: Cuda failure 'invalid resource handle': the stream is on GPU %d and the communicator of rank %d on GPU %d",
                    call, si_stream_device(s), c->rank, c->device);
    if (o.count == 0 && o.kind != K_SEND && o.kind != K_RECV) return NCCL_SUCCESS; /* NCCL skips empty collectives */
    struct queued q = {c, s, o};
    if (group_depth == 0) return submit(&q, 1);
    if (group_count == group_cap) {
        int cap = group_cap ? group_cap * 2 : 16;
        struct queued *grown = realloc(group_ops, (size_t)cap * sizeof *grown);
        if (!grown) return fail(c, NCCL_SYSTEM_ERROR, "out of host memory");
        group_ops = grown;
        group_cap = cap;
    }
    group_ops[group_count++] = q;
    return NCCL_SUCCESS;
}

/* A failed call inside a group fails the group too (ncclGroupEnd returns it). */
static int grouped(int status) {
    if (status && group_depth > 0 && !group_error) group_error = status;
    return status;
}

SI_EXPORT int ncclAllReduce(const void *send, void *recv, size_t count, int dtype, int op, void *comm, void *stream) {
    struct op o = {.kind = K_ALLREDUCE, .dtype = dtype, .op = op, .count = count};
    size_t bytes = count * dtype_size(dtype);
    return grouped(enqueue("ncclAllReduce", comm, o, send, bytes, recv, bytes, stream));
}

SI_EXPORT int ncclBroadcast(const void *send, void *recv, size_t count, int dtype, int root, void *comm, void *stream) {
    struct comm *c = live_comm(comm);
    struct op o = {.kind = K_BROADCAST, .dtype = dtype, .root = root, .count = count};
    size_t bytes = count * dtype_size(dtype);
    return grouped(enqueue("ncclBroadcast", comm, o, send, c && c->rank == root ? bytes : 0, recv, bytes, stream));
}

SI_EXPORT int ncclAllGather(const void *send, void *recv, size_t count, int dtype, void *comm, void *stream) {
    struct comm *c = live_comm(comm);
    struct op o = {.kind = K_ALLGATHER, .dtype = dtype, .count = count};
    size_t bytes = count * dtype_size(dtype);
    return grouped(enqueue("ncclAllGather", comm, o, send, bytes, recv, bytes * (size_t)(c ? c->nranks : 1), stream));
}

SI_EXPORT int ncclReduceScatter(const void *send, void *recv, size_t count, int dtype, int op, void *comm, void *stream) {
    struct comm *c = live_comm(comm);
    struct op o = {.kind = K_REDUCESCATTER, .dtype = dtype, .op = op, .count = count};
    size_t bytes = count * dtype_size(dtype);
    return grouped(enqueue("ncclReduceScatter", comm, o, send, bytes * (size_t)(c ? c->nranks : 1), recv, bytes, stream));
}

SI_EXPORT int ncclSend(const void *send, size_t count, int dtype, int peer, void *comm, void *stream) {
    struct op o = {.kind = K_SEND, .dtype = dtype, .peer = peer, .count = count};
    return grouped(enqueue("ncclSend", comm, o, send, count * dtype_size(dtype), NULL, 0, stream));
}

SI_EXPORT int ncclRecv(void *recv, size_t count, int dtype, int peer, void *comm, void *stream) {
    struct op o = {.kind = K_RECV, .dtype = dtype, .peer = peer, .count = count};
    return grouped(enqueue("ncclRecv", comm, o, NULL, 0, recv, count * dtype_size(dtype), stream));
}

SI_EXPORT int ncclGroupStart(void) {
    int status = injected("ncclGroupStart", si_current_device(), NULL);
    if (status) return status;
    group_depth++;
    return NCCL_SUCCESS;
}

SI_EXPORT int ncclGroupEnd(void) {
    if (group_depth == 0) return fail(NULL, NCCL_INVALID_USAGE, "ncclGroupEnd: no group was started");
    int status = injected("ncclGroupEnd", si_current_device(), NULL);
    if (--group_depth > 0) return status;
    if (!status) status = group_error;
    if (!status) status = submit(group_ops, group_count);
    group_count = 0;
    group_error = 0;
    return status;
}

/* ---- pre-multiplied sums ---- */

SI_EXPORT int ncclRedOpCreatePreMulSum(int *op, void *scalar, int dtype, int residence, void *handle) {
    struct comm *c = live_comm(handle);
    if (!c || c->dead) return fail(c, NCCL_INVALID_ARGUMENT, "ncclRedOpCreatePreMulSum: invalid communicator %p", handle);
    int status = injected("ncclRedOpCreatePreMulSum", c->device, c);
    if (status) return status;
    size_t size = dtype_size(dtype);
    if (!op || !scalar || !size || (residence != 0 && residence != 1))
        return fail(c, NCCL_INVALID_ARGUMENT, "ncclRedOpCreatePreMulSum: invalid argument (op %p, scalar %p, type %d, residence %d)", (void *)op, scalar, dtype, residence);
    struct custom_op made = {.used = 1, .dtype = dtype};
    if (residence == 1) { /* ncclScalarHostImmediate: read now */
        made.scale = scalar_value(dtype, scalar);
    } else { /* ncclScalarDevice: read when the collective runs */
        int device;
        uint8_t *view;
        if (si_device_memory(scalar, size, &device, &view) != SI_DEVICE || device != c->device)
            return fail(c, NCCL_INVALID_ARGUMENT, "ncclRedOpCreatePreMulSum: scalar %p is not device memory of GPU %d", scalar, c->device);
        made.device_scalar = view;
    }
    pthread_mutex_lock(&c->order);
    int i = 0;
    while (i < MAX_CUSTOM_OPS && c->ops[i].used) i++;
    if (i < MAX_CUSTOM_OPS) c->ops[i] = made;
    pthread_mutex_unlock(&c->order);
    if (i == MAX_CUSTOM_OPS) return fail(c, NCCL_INVALID_USAGE, "ncclRedOpCreatePreMulSum: too many live custom operations");
    *op = BUILTIN_OPS + i;
    return NCCL_SUCCESS;
}

SI_EXPORT int ncclRedOpDestroy(int op, void *handle) {
    struct comm *c = live_comm(handle);
    if (!c || c->dead) return fail(c, NCCL_INVALID_ARGUMENT, "ncclRedOpDestroy: invalid communicator %p", handle);
    int i = op - BUILTIN_OPS;
    if (i < 0 || i >= MAX_CUSTOM_OPS || !c->ops[i].used)
        return fail(c, NCCL_INVALID_ARGUMENT, "ncclRedOpDestroy: operation %d is not a custom operation of this communicator", op);
    pthread_mutex_lock(&c->order);
    c->ops[i].used = 0; /* queued collectives keep what they captured */
    pthread_mutex_unlock(&c->order);
    return NCCL_SUCCESS;
}

/* ---- communicators ---- */

struct unique_id {
    char internal[128];
};

SI_EXPORT int ncclGetVersion(int *version) {
    if (!version) return NCCL_INVALID_ARGUMENT;
    *version = (int)si_env_long("RVOD_STANDIN_NCCL_VERSION", DEFAULT_VERSION);
    return NCCL_SUCCESS;
}

SI_EXPORT int ncclGetUniqueId(struct unique_id *id) {
    int status = injected("ncclGetUniqueId", si_current_device(), NULL);
    if (status) return status;
    if (!id) return fail(NULL, NCCL_INVALID_ARGUMENT, "ncclGetUniqueId: null id");
    static atomic_uint counter;
    uint64_t random = 0;
    if (getrandom(&random, sizeof random, 0) != (ssize_t)sizeof random) random = (uint64_t)now_ms();
    memset(id, 0, sizeof *id);
    memcpy(id->internal, ID_MAGIC, sizeof ID_MAGIC);
    snprintf(id->internal + 16, 100, SHM_PREFIX "%d-%u-%016llx", (int)getpid(), atomic_fetch_add(&counter, 1), (unsigned long long)random);
    return NCCL_SUCCESS;
}

/* Open (or create) the segment and map it; 0 or an NCCL error. */
static int attach(struct comm *c, const char *name, int nranks, double deadline) {
    size_t slot_bytes = (size_t)si_env_long("RVOD_STANDIN_NCCL_SLOT_BYTES", 256 << 10), channel_bytes = slot_bytes / 4;
    slot_bytes = slot_bytes < 4096 ? 4096 : (slot_bytes + 63) / 64 * 64;
    channel_bytes = channel_bytes < 1024 ? 1024 : (channel_bytes + 63) / 64 * 64;
    int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd >= 0) { /* the first rank here makes it */
        size_t total = header_bytes(nranks) + (size_t)nranks * slot_bytes + (size_t)nranks * nranks * (sizeof(struct channel) + channel_bytes);
        void *m = ftruncate(fd, (off_t)total) == 0 ? mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
        close(fd);
        if (m == MAP_FAILED) {
            shm_unlink(name);
            return fail(c, NCCL_SYSTEM_ERROR, "ncclCommInitRank: cannot map shared memory %s of %zu bytes: %s", name, total, strerror(errno));
        }
        struct header *h = m;
        memcpy(h->magic, ID_MAGIC, sizeof ID_MAGIC);
        h->nranks = nranks;
        h->slot_bytes = slot_bytes;
        h->channel_bytes = channel_bytes;
        h->total = total;
        atomic_store(&h->ready, 1);
        c->shm = h;
        c->mapped = total;
        return 0;
    }
    unsigned spins = 0;
    while (now_ms() < deadline) { /* another rank makes it: wait until it is ready */
        fd = shm_open(name, O_RDWR, 0600);
        struct stat st;
        if (fd >= 0 && fstat(fd, &st) == 0 && (size_t)st.st_size >= sizeof(struct header)) {
            struct header *h = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            close(fd);
            if (h != MAP_FAILED && atomic_load(&h->ready)) {
                c->shm = h;
                c->mapped = (size_t)st.st_size;
                return 0;
            }
            if (h != MAP_FAILED) munmap(h, (size_t)st.st_size);
        } else if (fd >= 0) close(fd);
        pause_briefly(&spins);
    }
    return -2; /* timed out */
}

static void detach(struct comm *c, int state) {
    if (!c->shm) return;
    atomic_store(&c->shm->ranks[c->rank].state, state);
    munmap(c->shm, c->mapped);
    c->shm = NULL;
}

SI_EXPORT int ncclCommInitRank(void **out, int nranks, struct unique_id id, int rank) {
    int device = si_current_device();
    int status = injected("ncclCommInitRank", device, NULL);
    if (status) return status;
    if (!out) return fail(NULL, NCCL_INVALID_ARGUMENT, "ncclCommInitRank: null communicator pointer");
    *out = NULL;
    if (group_depth > 0) return fail(NULL, NCCL_INVALID_USAGE, "ncclCommInitRank: the GPU stand-in does not initialise communicators inside a group");
    if (memcmp(id.internal, ID_MAGIC, sizeof ID_MAGIC) != 0 || strncmp(id.internal + 16, SHM_PREFIX, strlen(SHM_PREFIX)) != 0)
        return fail(NULL, NCCL_INVALID_ARGUMENT, "ncclCommInitRank: the unique id was not made by this library's ncclGetUniqueId");
    if (nranks < 1 || nranks > MAX_RANKS || rank < 0 || rank >= nranks)
        return fail(NULL, NCCL_INVALID_ARGUMENT, "ncclCommInitRank: rank %d of %d is invalid (the stand-in takes 1 to %d ranks)", rank, nranks, MAX_RANKS);
    if (si_ready() != 0) return fail(NULL, NCCL_UNHANDLED_CUDA_ERROR, "ncclCommInitRank: no CUDA device");
    char name[112];
    snprintf(name, sizeof name, "%s", id.internal + 16);
    struct comm *c = calloc(1, sizeof *c);
    if (!c) return fail(NULL, NCCL_SYSTEM_ERROR, "out of host memory");
    c->rank = rank;
    c->nranks = nranks;
    c->device = device;
    c->physical = si_physical_device(device);
    pthread_mutex_init(&c->order, NULL);
    long timeout = si_env_long("RVOD_STANDIN_NCCL_INIT_TIMEOUT_MS", 30000);
    double deadline = now_ms() + (double)timeout;
    status = attach(c, name, nranks, deadline);
    if (status == -2) status = fail(NULL, NCCL_SYSTEM_ERROR, "ncclCommInitRank: rank %d (GPU %d) timed out after %ld ms waiting for rank 0 of %d to arrive", rank, device, timeout, nranks);
    if (status) {
        free(c);
        return status;
    }
    struct header *h = c->shm;
    struct rank_info *me = &h->ranks[rank];
    int expected = 0;
    if (h->nranks != nranks) status = fail(NULL, NCCL_INVALID_ARGUMENT, "ncclCommInitRank: rank %d was given %d ranks, another rank %d", rank, nranks, h->nranks);
    else if (!atomic_compare_exchange_strong(&me->arrived, &expected, 1))
        status = fail(NULL, NCCL_INVALID_USAGE, "ncclCommInitRank: rank %d was claimed twice with one unique id", rank);
    if (status) {
        munmap(h, c->mapped);
        free(c);
        return status;
    }
    me->pid = (int)getpid();
    me->device = device;
    me->physical = c->physical;
    atomic_store(&me->state, RANK_ALIVE);
    atomic_fetch_add(&h->arrivals, 1);
    unsigned spins = 0;
    double checked = now_ms();
    while (atomic_load(&h->arrivals) < nranks && !status) {
        for (int q = 0; q < nranks && !status; q++)
            if (q != rank && atomic_load(&h->ranks[q].arrived) && atomic_load(&h->ranks[q].state) == RANK_ALIVE)
                status = peer_alive(c, q, "ncclCommInitRank", &checked);
        if (!status && now_ms() > deadline) {
            int missing = 0;
            while (missing < nranks && atomic_load(&h->ranks[missing].arrived)) missing++;
            status = fail(NULL, NCCL_SYSTEM_ERROR, "ncclCommInitRank: rank %d (GPU %d) timed out after %ld ms waiting for rank %d of %d to arrive",
                          rank, device, timeout, missing, nranks);
        }
        if (!status) pause_briefly(&spins);
    }
    shm_unlink(name); /* everyone has it mapped (or it failed): the name is no longer needed */
    for (int a = 0; a < nranks && !status; a++)
        for (int b = a + 1; b < nranks && !status; b++)
            if (h->ranks[a].physical == h->ranks[b].physical) {
                char bus[32];
                snprintf(bus, sizeof bus, "00000000:%02X:00.0", 0x10 + h->ranks[a].physical);
                status = fail(NULL, NCCL_INVALID_USAGE, "Duplicate GPU detected : rank %d and rank %d both on CUDA device %d (bus id %s)", a, b,
                              h->ranks[a].device, bus);
            }
    if (status) {
        detach(c, RANK_DESTROYED);
        free(c);
        return status;
    }
    c->magic = COMM_MAGIC;
    pthread_mutex_lock(&comms_lock);
    c->next = comms;
    comms = c;
    pthread_mutex_unlock(&comms_lock);
    *out = c;
    return NCCL_SUCCESS;
}

static void wait_idle(struct comm *c) {
    while (atomic_load(&c->pending) > 0) {
        struct timespec t = {0, 200000};
        nanosleep(&t, NULL);
    }
}

SI_EXPORT int ncclCommDestroy(void *handle) {
    struct comm *c = live_comm(handle);
    if (!c || c->dead) return fail(c, NCCL_INVALID_ARGUMENT, "ncclCommDestroy: invalid communicator %p", handle);
    int status = injected("ncclCommDestroy", c->device, c);
    if (status) return status;
    wait_idle(c); /* as NCCL: the queued operations finish first (and a stuck one keeps this waiting) */
    c->dead = 1;
    detach(c, RANK_DESTROYED);
    return NCCL_SUCCESS;
}

SI_EXPORT int ncclCommAbort(void *handle) {
    struct comm *c = live_comm(handle);
    if (!c || c->dead) return fail(c, NCCL_INVALID_ARGUMENT, "ncclCommAbort: invalid communicator %p", handle);
    atomic_store(&c->aborted, 1);
    if (c->shm) atomic_store(&c->shm->ranks[c->rank].state, RANK_ABORTED);
    wait_idle(c); /* the stuck operations see the abort and end */
    c->dead = 1;
    detach(c, RANK_ABORTED);
    return NCCL_SUCCESS;
}

SI_EXPORT int ncclCommGetAsyncError(void *handle, int *error) {
    struct comm *c = live_comm(handle);
    if (!c || !error) return fail(c, NCCL_INVALID_ARGUMENT, "ncclCommGetAsyncError: invalid argument");
    *error = atomic_load(&c->async_error);
    return NCCL_SUCCESS;
}

SI_EXPORT int ncclCommCount(void *handle, int *count) {
    struct comm *c = live_comm(handle);
    if (!c || !count) return NCCL_INVALID_ARGUMENT;
    *count = c->nranks;
    return NCCL_SUCCESS;
}

SI_EXPORT int ncclCommCuDevice(void *handle, int *device) {
    struct comm *c = live_comm(handle);
    if (!c || !device) return NCCL_INVALID_ARGUMENT;
    *device = c->device;
    return NCCL_SUCCESS;
}

SI_EXPORT int ncclCommUserRank(void *handle, int *rank) {
    struct comm *c = live_comm(handle);
    if (!c || !rank) return NCCL_INVALID_ARGUMENT;
    *rank = c->rank;
    return NCCL_SUCCESS;
}

SI_EXPORT const char *ncclGetErrorString(int code) {
    switch (code) {
    case NCCL_SUCCESS: return "no error";
    case NCCL_UNHANDLED_CUDA_ERROR: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case NCCL_SYSTEM_ERROR: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case NCCL_INTERNAL_ERROR: return "internal error - please report this issue to the NCCL developers";
    case NCCL_INVALID_ARGUMENT: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case NCCL_INVALID_USAGE: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case NCCL_REMOTE_ERROR: return "remote process exited or there was a network error";
    case NCCL_IN_PROGRESS: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}

/* The last error's text: the communicator's own when it has one, else the process's last. */
SI_EXPORT const char *ncclGetLastError(void *handle) {
    struct comm *c = handle ? live_comm(handle) : NULL;
    return c && c->error[0] ? c->error : last_error;
}

long si_live_comms(void) {
    long n = 0;
    pthread_mutex_lock(&comms_lock);
    for (struct comm *c = comms; c; c = c->next) n += !c->dead;
    pthread_mutex_unlock(&comms_lock);
    return n;
}
