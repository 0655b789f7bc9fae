/* The CUDA runtime subset rvod loads (libcudart's C ABI), on host memory, for tests: devices, memory that the
 * host cannot read, streams that run their work on worker threads in order, events, and the standin_*
 * test hooks. See README.md for the exported functions and the settings. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "standin.h"

#define ALLOC_ALIGN 256
#define STREAM_MAGIC 0x5354524du
#define EVENT_MAGIC 0x45564e54u
#define CUDA_VERSION_CODE 12080

pthread_mutex_t si_lock = PTHREAD_MUTEX_INITIALIZER;
pthread_cond_t si_progress = PTHREAD_COND_INITIALIZER;
/* A stream's thread waits for work on this one (new items, a destroy), so that completions do not wake idle
   streams' threads. */
static pthread_cond_t si_work = PTHREAD_COND_INITIALIZER;

/* ---- settings, read once ---- */

static pthread_once_t settings_once = PTHREAD_ONCE_INIT;
static int physical_count = 2;
static int visible_count;
static int visible[SI_MAX_DEVICES];
static int no_driver;
static int init_failed;
static size_t capacity;
static uint8_t *device_view; /* PROT_NONE: what device pointers point into */
static uint8_t *library_view; /* read-write: the same bytes as this library reaches them */
static atomic_uint delay_us;
static atomic_int kernel_us; /* < 0: three times delay_us */
/* RVOD_STANDIN_INLINE: work enqueued on an idle stream with nothing to wait for runs at once, on the caller's
   thread (no handoff to the stream's thread): a GPU that costs nothing, to time what rvod itself adds. */
static int run_inline;

long si_env_long(const char *name, long fallback) {
    const char *v = getenv(name);
    if (!v || !*v) return fallback;
    char *end;
    long n = strtol(v, &end, 10);
    return *end ? fallback : n;
}

static size_t env_size(const char *name, size_t fallback) {
    const char *v = getenv(name);
    if (!v || !*v) return fallback;
    char *end;
    unsigned long long n = strtoull(v, &end, 10);
    switch (*end) {
    case 'k': case 'K': n <<= 10; break;
    case 'm': case 'M': n <<= 20; break;
    case 'g': case 'G': n <<= 30; break;
    default: break;
    }
    return (size_t)n;
}

static int fault_add(const char *spec);

static void read_settings(void) {
    long n = si_env_long("RVOD_STANDIN_DEVICES", 2);
    physical_count = n < 0 ? 0 : n > SI_MAX_DEVICES ? SI_MAX_DEVICES : (int)n;
    no_driver = si_env_long("RVOD_STANDIN_NO_DRIVER", 0) != 0;
    long page = sysconf(_SC_PAGESIZE);
    capacity = env_size("RVOD_STANDIN_DEVICE_MEMORY", (size_t)1 << 30);
    capacity = (capacity + (size_t)page - 1) / (size_t)page * (size_t)page;
    atomic_store(&delay_us, (unsigned)si_env_long("RVOD_STANDIN_STREAM_DELAY_US", 0));
    atomic_store(&kernel_us, (int)si_env_long("RVOD_STANDIN_KERNEL_US", -1));
    run_inline = si_env_long("RVOD_STANDIN_INLINE", 0) != 0;
    const char *list = getenv("CUDA_VISIBLE_DEVICES");
    if (list) { /* as CUDA: the listed ordinals, up to the first invalid or repeated one */
        const char *p = list;
        while (*p && visible_count < SI_MAX_DEVICES) {
            char *end;
            long d = strtol(p, &end, 10);
            if (end == p || d < 0 || d >= physical_count) break;
            int repeated = 0;
            for (int i = 0; i < visible_count; i++) repeated |= visible[i] == d;
            if (repeated) break;
            visible[visible_count++] = (int)d;
            p = *end == ',' ? end + 1 : end;
            if (*end != ',') break;
        }
    } else {
        for (int d = 0; d < physical_count; d++) visible[visible_count++] = d;
    }
    if (visible_count > 0 && capacity > 0) {
        size_t total = capacity * (size_t)visible_count;
        int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
        void *dv = mmap(NULL, total, PROT_NONE, flags, -1, 0);
        void *lv = mmap(NULL, total, PROT_READ | PROT_WRITE, flags, -1, 0);
        if (dv == MAP_FAILED || lv == MAP_FAILED) init_failed = 1;
        device_view = dv == MAP_FAILED ? NULL : dv;
        library_view = lv == MAP_FAILED ? NULL : lv;
    }
    const char *faults = getenv("RVOD_STANDIN_FAIL");
    if (faults && *faults) {
        char *copy = strdup(faults), *save = NULL;
        for (char *one = strtok_r(copy, ";", &save); one; one = strtok_r(NULL, ";", &save)) {
            if (fault_add(one) != 0) fprintf(stderr, "rvod GPU stand-in: ignoring malformed RVOD_STANDIN_FAIL entry '%s'\n", one);
        }
        free(copy);
    }
}

int si_ready(void) {
    pthread_once(&settings_once, read_settings);
    if (no_driver) return SI_CUDA_INSUFFICIENT_DRIVER;
    if (init_failed) return SI_CUDA_INITIALIZATION;
    if (visible_count == 0) return SI_CUDA_NO_DEVICE;
    return SI_CUDA_SUCCESS;
}

static __thread int current_device;
static __thread int last_error;

int si_current_device(void) { return current_device; }

int si_physical_device(int ordinal) {
    return ordinal >= 0 && ordinal < visible_count ? visible[ordinal] : -1;
}

/* Every runtime call's return goes through here: cudaGetLastError reports the last failure. */
static int done(int status) {
    if (status != SI_CUDA_SUCCESS && status != SI_CUDA_NOT_READY) last_error = status;
    return status;
}

/* ---- injected failures ---- */

struct fault {
    char name[64];
    int device; /* -1: any */
    long nth, seen;
    int code;
    char text[512];
};
static struct fault faults[32];
static int fault_count;
static pthread_mutex_t fault_lock = PTHREAD_MUTEX_INITIALIZER;

/* Calls counted by name (standin_calls), under fault_lock: every call that reaches its injection point. */
static struct {
    char name[64];
    long n;
} call_counts[64];
static int call_count_used;

/* Under fault_lock. A name that does not fit (or a full table) is not counted: standin_calls says 0. */
static void count_call(const char *name) {
    for (int i = 0; i < call_count_used; i++) {
        if (strcmp(call_counts[i].name, name) == 0) {
            call_counts[i].n++;
            return;
        }
    }
    if (call_count_used == (int)(sizeof call_counts / sizeof call_counts[0]) || strlen(name) >= sizeof call_counts[0].name)
        return;
    snprintf(call_counts[call_count_used].name, sizeof call_counts[0].name, "%s", name);
    call_counts[call_count_used++].n = 1;
}

/* "name[@device]:nth:code[:text]" */
static int fault_add(const char *spec) {
    struct fault f = {.device = -1};
    const char *colon = strchr(spec, ':');
    if (!colon || colon == spec || (size_t)(colon - spec) >= sizeof f.name) return -1;
    memcpy(f.name, spec, (size_t)(colon - spec));
    char *at = strchr(f.name, '@');
    if (at) {
        *at = 0;
        f.device = atoi(at + 1);
    }
    char *end;
    f.nth = strtol(colon + 1, &end, 10);
    if (*end != ':' || f.nth < 1) return -1;
    f.code = (int)strtol(end + 1, &end, 10);
    if ((*end != ':' && *end != 0) || f.code == 0) return -1;
    if (*end == ':') snprintf(f.text, sizeof f.text, "%s", end + 1);
    pthread_mutex_lock(&fault_lock);
    int ok = fault_count < (int)(sizeof faults / sizeof faults[0]);
    if (ok) faults[fault_count++] = f;
    pthread_mutex_unlock(&fault_lock);
    return ok ? 0 : -1;
}

int si_injected(const char *name, int device, char *text, size_t cap) {
    pthread_once(&settings_once, read_settings);
    int code = 0;
    pthread_mutex_lock(&fault_lock);
    count_call(name);
    for (int i = 0; i < fault_count && !code; i++) {
        struct fault *f = &faults[i];
        if (strcmp(f->name, name) != 0 || (f->device >= 0 && f->device != device)) continue;
        if (++f->seen == f->nth) {
            code = f->code;
            if (text && cap)
                snprintf(text, cap, "%s", f->text[0] ? f->text : "failure injected by the GPU stand-in (RVOD_STANDIN_FAIL)");
        }
    }
    pthread_mutex_unlock(&fault_lock);
    return code;
}

#define INJECT(name)                                                          \
    do {                                                                      \
        int injected_ = si_injected(name, current_device, NULL, 0);           \
        if (injected_) return done(injected_);                                \
    } while (0)

/* ---- streams ---- */

struct dep {
    si_stream *stream;
    uint64_t seq;
};

struct item {
    struct item *next;
    uint64_t seq;
    int ndeps;
    struct dep *deps;
    void (*run)(void *);
    void *arg;
};

enum { USER_STREAM, LEGACY_STREAM, PER_THREAD_STREAM };

struct si_stream {
    uint32_t magic;
    int device;
    int nonblocking;
    int kind;
    int destroyed;
    int inline_busy; /* an item runs on its caller's thread (RVOD_STANDIN_INLINE): the worker waits */
    uint64_t enqueued, completed;
    struct item *head, *tail;
    si_stream *next_all;
};

/* Every stream ever made (destroyed ones stay: events may still name them). */
static si_stream *streams;
static si_stream *legacy[SI_MAX_DEVICES];
static __thread si_stream *per_thread[SI_MAX_DEVICES];

static void *worker(void *arg) {
    si_stream *s = arg;
    pthread_mutex_lock(&si_lock);
    for (;;) {
        while ((!s->head || s->inline_busy) && !s->destroyed) pthread_cond_wait(&si_work, &si_lock);
        struct item *it = s->head;
        if (!it) break;
        s->head = it->next;
        if (!s->head) s->tail = NULL;
        for (int i = 0; i < it->ndeps; i++)
            while (it->deps[i].stream->completed < it->deps[i].seq) pthread_cond_wait(&si_progress, &si_lock);
        pthread_mutex_unlock(&si_lock);
        if (it->run) {
            unsigned delay = atomic_load(&delay_us);
            if (delay) usleep(delay);
            it->run(it->arg);
        }
        pthread_mutex_lock(&si_lock);
        s->completed = it->seq;
        pthread_cond_broadcast(&si_progress);
        free(it->deps);
        free(it);
    }
    pthread_mutex_unlock(&si_lock);
    return NULL;
}

/* Under si_lock. */
static si_stream *stream_new(int device, int nonblocking, int kind) {
    si_stream *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    *s = (si_stream){.magic = STREAM_MAGIC, .device = device, .nonblocking = nonblocking, .kind = kind};
    pthread_t thread;
    if (pthread_create(&thread, NULL, worker, s) != 0) {
        free(s);
        return NULL;
    }
    pthread_detach(thread);
    s->next_all = streams;
    streams = s;
    return s;
}

/* Under si_lock. */
static int stream_of_locked(void *handle, int device, si_stream **out) {
    uintptr_t h = (uintptr_t)handle;
    if (h <= 2) {
        if (device < 0 || device >= visible_count) return SI_CUDA_INVALID_DEVICE;
        si_stream **slot = h == 2 ? &per_thread[device] : &legacy[device];
        if (!*slot) *slot = stream_new(device, 0, h == 2 ? PER_THREAD_STREAM : LEGACY_STREAM);
        *out = *slot;
        return *out ? SI_CUDA_SUCCESS : SI_CUDA_MEMORY_ALLOCATION;
    }
    for (si_stream *s = streams; s; s = s->next_all) {
        if (s == handle && s->magic == STREAM_MAGIC && !s->destroyed && s->kind == USER_STREAM) {
            *out = s;
            return SI_CUDA_SUCCESS;
        }
    }
    return SI_CUDA_INVALID_RESOURCE_HANDLE;
}

int si_stream_of(void *handle, int device, si_stream **out) {
    pthread_mutex_lock(&si_lock);
    int status = stream_of_locked(handle, device, out);
    pthread_mutex_unlock(&si_lock);
    return status;
}

int si_stream_device(const si_stream *stream) { return stream->device; }

uint64_t si_enqueue(si_stream *s, void (*run)(void *), void *arg, si_stream *after, uint64_t after_seq) {
    pthread_mutex_lock(&si_lock);
    int cap = 1;
    for (si_stream *o = streams; o; o = o->next_all) cap++;
    struct item *it = calloc(1, sizeof *it);
    struct dep *deps = calloc((size_t)cap, sizeof *deps);
    if (!it || !deps) abort(); /* a test library out of memory: nothing sensible to report */
    int n = 0;
    if (after && after->completed < after_seq) deps[n++] = (struct dep){after, after_seq};
    /* The legacy default stream waits for the blocking streams of its device, and they wait for it. */
    if (s->kind == LEGACY_STREAM) {
        for (si_stream *o = streams; o; o = o->next_all)
            if (o != s && o->device == s->device && !o->nonblocking && o->completed < o->enqueued)
                deps[n++] = (struct dep){o, o->enqueued};
    } else if (!s->nonblocking) {
        si_stream *l = legacy[s->device];
        if (l && l->completed < l->enqueued) deps[n++] = (struct dep){l, l->enqueued};
    }
    uint64_t seq = ++s->enqueued;
    if (run_inline && n == 0 && !s->head && s->completed + 1 == seq && atomic_load(&delay_us) == 0) {
        /* Nothing before it on this stream and nothing to wait for: run it here (the stream's thread sees
           completed == enqueued and stays asleep). */
        free(it);
        free(deps);
        s->inline_busy = 1;
        pthread_mutex_unlock(&si_lock);
        if (run) run(arg);
        pthread_mutex_lock(&si_lock);
        s->inline_busy = 0;
        s->completed = seq;
        pthread_cond_broadcast(&si_progress);
        if (s->head) pthread_cond_broadcast(&si_work); /* queued behind it meanwhile */
        pthread_mutex_unlock(&si_lock);
        return seq;
    }
    *it = (struct item){.seq = seq, .ndeps = n, .deps = deps, .run = run, .arg = arg};
    if (s->tail) s->tail->next = it;
    else s->head = it;
    s->tail = it;
    pthread_cond_broadcast(&si_work);
    pthread_cond_broadcast(&si_progress);
    pthread_mutex_unlock(&si_lock);
    return seq; /* not it->seq: the worker may have run and freed `it` already */
}

/* Under si_lock: block until `s` has run its first `seq` items. */
static void wait_for(si_stream *s, uint64_t seq) {
    while (s->completed < seq) pthread_cond_wait(&si_progress, &si_lock);
}

/* Under si_lock: block until every stream of `device` (-1: of every device) has run what it holds now. */
static void wait_device(int device) {
    for (si_stream *s = streams; s; s = s->next_all)
        if (device < 0 || s->device == device) wait_for(s, s->enqueued);
}

/* ---- device memory ---- */

struct allocation {
    size_t offset, size; /* within its device's range */
    struct allocation *next; /* sorted by offset */
};
static struct allocation *allocations[SI_MAX_DEVICES];
static size_t in_use[SI_MAX_DEVICES];

struct pinned {
    void *ptr;
    size_t size;
    struct pinned *next;
};
static struct pinned *pinned_list;

/* Under si_lock. */
static int locate_locked(const void *ptr, size_t len, int *device, uint8_t **bytes, struct allocation **found) {
    uintptr_t p = (uintptr_t)ptr, base = (uintptr_t)device_view;
    if (!device_view || p < base || p >= base + capacity * (size_t)visible_count) return SI_HOST;
    int d = (int)((p - base) / capacity);
    size_t offset = (p - base) % capacity;
    for (struct allocation *a = allocations[d]; a; a = a->next) {
        if (offset >= a->offset && offset - a->offset <= a->size && len <= a->size - (offset - a->offset)) {
            if (device) *device = d;
            if (bytes) *bytes = library_view + (p - base);
            if (found) *found = a;
            return SI_DEVICE;
        }
    }
    return SI_BAD_RANGE;
}

int si_device_memory(const void *ptr, size_t len, int *device, uint8_t **bytes) {
    pthread_once(&settings_once, read_settings);
    pthread_mutex_lock(&si_lock);
    int where = locate_locked(ptr, len, device, bytes, NULL);
    pthread_mutex_unlock(&si_lock);
    return where;
}

SI_EXPORT int cudaMalloc(void **ptr, size_t size) {
    int status = si_ready();
    if (status) return done(status);
    INJECT("cudaMalloc");
    if (!ptr) return done(SI_CUDA_INVALID_VALUE);
    *ptr = NULL;
    if (size == 0) return SI_CUDA_SUCCESS;
    int d = current_device;
    size_t want = (size + ALLOC_ALIGN - 1) / ALLOC_ALIGN * ALLOC_ALIGN;
    if (want < size) return done(SI_CUDA_MEMORY_ALLOCATION);
    pthread_mutex_lock(&si_lock);
    struct allocation **link = &allocations[d];
    size_t at = 0;
    while (*link && (*link)->offset - at < want) {
        at = (*link)->offset + (*link)->size;
        link = &(*link)->next;
    }
    struct allocation *a = NULL;
    if (want <= capacity && at <= capacity - want) a = malloc(sizeof *a);
    if (a) {
        *a = (struct allocation){.offset = at, .size = want, .next = *link};
        *link = a;
        in_use[d] += want;
        *ptr = device_view + (size_t)d * capacity + at;
    }
    pthread_mutex_unlock(&si_lock);
    if (!a) return done(SI_CUDA_MEMORY_ALLOCATION);
    /* cudaMalloc's memory holds garbage, not zeros: poison it so code that assumes zeros fails here too. */
    memset(library_view + (size_t)d * capacity + at, 0xff, want);
    return SI_CUDA_SUCCESS;
}

SI_EXPORT int cudaFree(void *ptr) {
    int status = si_ready();
    if (status) return done(status);
    INJECT("cudaFree");
    if (!ptr) return SI_CUDA_SUCCESS;
    pthread_mutex_lock(&si_lock);
    int d;
    struct allocation *a = NULL;
    uint8_t *bytes;
    if (locate_locked(ptr, 0, &d, &bytes, &a) != SI_DEVICE || device_view + (size_t)d * capacity + a->offset != ptr) {
        pthread_mutex_unlock(&si_lock);
        return done(SI_CUDA_INVALID_VALUE);
    }
    wait_device(d); /* as cudaFree: it waits for the device's work first */
    struct allocation **link = &allocations[d];
    while (*link != a) link = &(*link)->next;
    *link = a->next;
    in_use[d] -= a->size;
    /* Give the pages back (the next cudaMalloc poisons what it hands out anyway). */
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), start = (uintptr_t)library_view + (size_t)d * capacity + a->offset;
    uintptr_t lo = (start + page - 1) / page * page, hi = (start + a->size) / page * page;
    if (hi > lo) madvise((void *)lo, hi - lo, MADV_DONTNEED);
    free(a);
    pthread_mutex_unlock(&si_lock);
    return SI_CUDA_SUCCESS;
}

static int pinned_alloc(void **ptr, size_t size) {
    int status = si_ready();
    if (status) return done(status);
    if (!ptr) return done(SI_CUDA_INVALID_VALUE);
    struct pinned *p = malloc(sizeof *p);
    void *mem = NULL;
    if (!p || posix_memalign(&mem, 4096, size ? size : 1) != 0) {
        free(p);
        return done(SI_CUDA_MEMORY_ALLOCATION);
    }
    memset(mem, 0xff, size); /* garbage, as cudaMallocHost's */
    pthread_mutex_lock(&si_lock);
    *p = (struct pinned){.ptr = mem, .size = size, .next = pinned_list};
    pinned_list = p;
    pthread_mutex_unlock(&si_lock);
    *ptr = mem;
    return SI_CUDA_SUCCESS;
}

SI_EXPORT int cudaMallocHost(void **ptr, size_t size) {
    INJECT("cudaMallocHost");
    return pinned_alloc(ptr, size);
}

SI_EXPORT int cudaHostAlloc(void **ptr, size_t size, unsigned flags) {
    (void)flags;
    INJECT("cudaHostAlloc");
    return pinned_alloc(ptr, size);
}

SI_EXPORT int cudaFreeHost(void *ptr) {
    int status = si_ready();
    if (status) return done(status);
    INJECT("cudaFreeHost");
    if (!ptr) return SI_CUDA_SUCCESS;
    pthread_mutex_lock(&si_lock);
    struct pinned **link = &pinned_list;
    while (*link && (*link)->ptr != ptr) link = &(*link)->next;
    struct pinned *p = *link;
    if (p) {
        wait_device(-1); /* cudaFreeHost synchronizes like cudaFree */
        *link = p->next;
    }
    pthread_mutex_unlock(&si_lock);
    if (!p) return done(SI_CUDA_INVALID_VALUE);
    free(p->ptr);
    free(p);
    return SI_CUDA_SUCCESS;
}

SI_EXPORT int cudaMemGetInfo(size_t *free_bytes, size_t *total) {
    int status = si_ready();
    if (status) return done(status);
    pthread_mutex_lock(&si_lock);
    if (free_bytes) *free_bytes = capacity - in_use[current_device];
    if (total) *total = capacity;
    pthread_mutex_unlock(&si_lock);
    return SI_CUDA_SUCCESS;
}

struct cuda_pointer_attributes { /* cudaPointerAttributes, CUDA 11 and later */
    int type; /* cudaMemoryType: 0 unregistered, 1 host, 2 device */
    int device;
    void *device_pointer;
    void *host_pointer;
};

SI_EXPORT int cudaPointerGetAttributes(struct cuda_pointer_attributes *attributes, const void *ptr) {
    int status = si_ready();
    if (status) return done(status);
    if (!attributes) return done(SI_CUDA_INVALID_VALUE);
    pthread_mutex_lock(&si_lock);
    int d = -2, where = locate_locked(ptr, 0, &d, NULL, NULL), host = 0;
    for (struct pinned *p = pinned_list; p && where == SI_HOST; p = p->next)
        host |= (uintptr_t)ptr >= (uintptr_t)p->ptr && (uintptr_t)ptr < (uintptr_t)p->ptr + p->size;
    pthread_mutex_unlock(&si_lock);
    if (where == SI_BAD_RANGE) return done(SI_CUDA_INVALID_VALUE);
    *attributes = (struct cuda_pointer_attributes){.type = 0, .device = -2};
    if (where == SI_DEVICE) *attributes = (struct cuda_pointer_attributes){2, d, (void *)ptr, NULL};
    else if (host) *attributes = (struct cuda_pointer_attributes){1, current_device, (void *)ptr, (void *)ptr};
    return SI_CUDA_SUCCESS;
}

/* ---- copies and kernels: work items ---- */

struct copy {
    uint8_t *dst;
    const uint8_t *src;
    size_t len;
    int fill; /* >= 0: memset with this byte instead */
    uint8_t *owned; /* freed after the copy (a kernel's captured arguments) */
    int kernel; /* a framework kernel: it takes RVOD_STANDIN_KERNEL_US to run */
};

static void run_copy(void *arg) {
    struct copy *c = arg;
    if (c->kernel) {
        int us = atomic_load(&kernel_us);
        us = us < 0 ? 3 * (int)atomic_load(&delay_us) : us;
        if (us > 0) usleep((useconds_t)us);
    }
    if (c->fill >= 0) memset(c->dst, c->fill, c->len);
    else memmove(c->dst, c->src, c->len);
    free(c->owned);
    free(c);
}

/* Resolve one side of a copy: device memory becomes the library's view of it. */
static int side(const void *ptr, size_t len, int want_device, int any, uint8_t **out) {
    int d;
    uint8_t *bytes;
    int where = si_device_memory(ptr, len, &d, &bytes);
    if (where == SI_BAD_RANGE) return SI_CUDA_INVALID_VALUE;
    if (!any && (where == SI_DEVICE) != want_device) return SI_CUDA_INVALID_VALUE;
    *out = where == SI_DEVICE ? bytes : (uint8_t *)ptr;
    return SI_CUDA_SUCCESS;
}

/* Queue one copy or fill on stream s; with wait, block the host until it has run (cudaMemcpy, cudaMemset). */
static int submit_copy(si_stream *s, struct copy what, int wait) {
    struct copy *c = malloc(sizeof *c);
    if (!c) return done(SI_CUDA_MEMORY_ALLOCATION);
    *c = what;
    uint64_t seq = si_enqueue(s, run_copy, c, NULL, 0);
    if (wait) {
        pthread_mutex_lock(&si_lock);
        wait_for(s, seq);
        pthread_mutex_unlock(&si_lock);
    }
    return SI_CUDA_SUCCESS;
}

static int enqueue_copy(void *dst, const void *src, size_t len, int kind, void *stream, int wait) {
    int status = si_ready();
    if (status) return done(status);
    if (kind < 0 || kind > 4) return done(SI_CUDA_INVALID_MEMCPY_DIRECTION);
    si_stream *s;
    status = si_stream_of(wait ? NULL : stream, current_device, &s);
    if (status) return done(status);
    if (len == 0) return SI_CUDA_SUCCESS;
    uint8_t *to, *from;
    /* kinds: 0 host to host, 1 host to device, 2 device to host, 3 device to device, 4 inferred */
    status = side(dst, len, kind == 1 || kind == 3, kind == 4, &to);
    if (!status) status = side(src, len, kind == 2 || kind == 3, kind == 4, &from);
    if (status) return done(status);
    return submit_copy(s, (struct copy){.dst = to, .src = from, .len = len, .fill = -1}, wait);
}

SI_EXPORT int cudaMemcpyAsync(void *dst, const void *src, size_t len, int kind, void *stream) {
    INJECT("cudaMemcpyAsync");
    return enqueue_copy(dst, src, len, kind, stream, 0);
}

SI_EXPORT int cudaMemcpy(void *dst, const void *src, size_t len, int kind) {
    INJECT("cudaMemcpy");
    return enqueue_copy(dst, src, len, kind, NULL, 1);
}

static int enqueue_fill(void *dst, int value, size_t len, void *stream, int wait) {
    int status = si_ready();
    if (status) return done(status);
    si_stream *s;
    status = si_stream_of(wait ? NULL : stream, current_device, &s);
    uint8_t *to;
    if (!status) status = side(dst, len, 1, 0, &to);
    if (status) return done(status);
    return submit_copy(s, (struct copy){.dst = to, .len = len, .fill = value & 0xff}, wait);
}

SI_EXPORT int cudaMemsetAsync(void *dst, int value, size_t len, void *stream) {
    INJECT("cudaMemsetAsync");
    return enqueue_fill(dst, value, len, stream, 0);
}

SI_EXPORT int cudaMemset(void *dst, int value, size_t len) {
    INJECT("cudaMemset");
    return enqueue_fill(dst, value, len, NULL, 1);
}

/* ---- devices ---- */

SI_EXPORT int cudaRuntimeGetVersion(int *version) {
    if (!version) return SI_CUDA_INVALID_VALUE;
    *version = CUDA_VERSION_CODE;
    return SI_CUDA_SUCCESS;
}

SI_EXPORT int cudaDriverGetVersion(int *version) {
    if (!version) return SI_CUDA_INVALID_VALUE;
    pthread_once(&settings_once, read_settings);
    *version = no_driver ? 0 : CUDA_VERSION_CODE;
    return SI_CUDA_SUCCESS;
}

SI_EXPORT int cudaGetDeviceCount(int *count) {
    if (!count) return done(SI_CUDA_INVALID_VALUE);
    *count = 0;
    int status = si_ready();
    if (status) return done(status);
    INJECT("cudaGetDeviceCount");
    *count = visible_count;
    return SI_CUDA_SUCCESS;
}

SI_EXPORT int cudaSetDevice(int device) {
    int status = si_ready();
    if (status) return done(status);
    INJECT("cudaSetDevice");
    if (device < 0 || device >= visible_count) return done(SI_CUDA_INVALID_DEVICE);
    current_device = device;
    return SI_CUDA_SUCCESS;
}

SI_EXPORT int cudaGetDevice(int *device) {
    int status = si_ready();
    if (status) return done(status);
    if (!device) return done(SI_CUDA_INVALID_VALUE);
    *device = current_device;
    return SI_CUDA_SUCCESS;
}

SI_EXPORT int cudaDeviceGetPCIBusId(char *bus_id, int len, int device) {
    int status = si_ready();
    if (status) return done(status);
    INJECT("cudaDeviceGetPCIBusId");
    if (device < 0 || device >= visible_count) return done(SI_CUDA_INVALID_DEVICE);
    char text[32];
    int n = snprintf(text, sizeof text, "00000000:%02X:00.0", 0x10 + visible[device]);
    if (!bus_id || len <= n) return done(SI_CUDA_INVALID_VALUE);
    memcpy(bus_id, text, (size_t)n + 1);
    return SI_CUDA_SUCCESS;
}

SI_EXPORT int cudaDeviceSynchronize(void) {
    int status = si_ready();
    if (status) return done(status);
    INJECT("cudaDeviceSynchronize");
    pthread_mutex_lock(&si_lock);
    wait_device(current_device);
    pthread_mutex_unlock(&si_lock);
    return SI_CUDA_SUCCESS;
}

/* ---- streams: the API ---- */

SI_EXPORT int cudaStreamCreateWithFlags(void **stream, unsigned flags) {
    int status = si_ready();
    if (status) return done(status);
    INJECT("cudaStreamCreateWithFlags");
    if (!stream || (flags & ~1u)) return done(SI_CUDA_INVALID_VALUE);
    pthread_mutex_lock(&si_lock);
    si_stream *s = stream_new(current_device, flags & 1u, USER_STREAM);
    pthread_mutex_unlock(&si_lock);
    if (!s) return done(SI_CUDA_MEMORY_ALLOCATION);
    *stream = s;
    return SI_CUDA_SUCCESS;
}

SI_EXPORT int cudaStreamCreate(void **stream) { return cudaStreamCreateWithFlags(stream, 0); }

SI_EXPORT int cudaStreamDestroy(void *stream) {
    int status = si_ready();
    if (status) return done(status);
    INJECT("cudaStreamDestroy");
    pthread_mutex_lock(&si_lock);
    si_stream *s;
    status = (uintptr_t)stream <= 2 ? SI_CUDA_INVALID_RESOURCE_HANDLE : stream_of_locked(stream, 0, &s);
    if (!status) {
        s->destroyed = 1; /* its worker finishes the queued work, then exits */
        pthread_cond_broadcast(&si_work);
        pthread_cond_broadcast(&si_progress);
    }
    pthread_mutex_unlock(&si_lock);
    return done(status);
}

SI_EXPORT int cudaStreamSynchronize(void *stream) {
    int status = si_ready();
    if (status) return done(status);
    INJECT("cudaStreamSynchronize");
    pthread_mutex_lock(&si_lock);
    si_stream *s;
    status = stream_of_locked(stream, current_device, &s);
    if (!status) wait_for(s, s->enqueued);
    pthread_mutex_unlock(&si_lock);
    return done(status);
}

SI_EXPORT int cudaStreamQuery(void *stream) {
    int status = si_ready();
    if (status) return done(status);
    pthread_mutex_lock(&si_lock);
    si_stream *s;
    status = stream_of_locked(stream, current_device, &s);
    if (!status && s->completed < s->enqueued) status = SI_CUDA_NOT_READY;
    pthread_mutex_unlock(&si_lock);
    return done(status);
}

/* ---- events ---- */

struct event {
    uint32_t magic;
    int device;
    si_stream *stream; /* NULL until recorded: an event never recorded is complete */
    uint64_t seq;
    struct event *next;
};
static struct event *events;

/* Under si_lock. */
static struct event *event_of(void *handle) {
    for (struct event *e = events; e; e = e->next)
        if (e == handle && e->magic == EVENT_MAGIC) return e;
    return NULL;
}

SI_EXPORT int cudaEventCreateWithFlags(void **event, unsigned flags) {
    int status = si_ready();
    if (status) return done(status);
    INJECT("cudaEventCreateWithFlags");
    if (!event || (flags & ~7u)) return done(SI_CUDA_INVALID_VALUE);
    struct event *e = calloc(1, sizeof *e);
    if (!e) return done(SI_CUDA_MEMORY_ALLOCATION);
    pthread_mutex_lock(&si_lock);
    *e = (struct event){.magic = EVENT_MAGIC, .device = current_device, .next = events};
    events = e;
    pthread_mutex_unlock(&si_lock);
    *event = e;
    return SI_CUDA_SUCCESS;
}

SI_EXPORT int cudaEventCreate(void **event) { return cudaEventCreateWithFlags(event, 0); }

SI_EXPORT int cudaEventDestroy(void *event) {
    int status = si_ready();
    if (status) return done(status);
    pthread_mutex_lock(&si_lock);
    struct event **link = &events;
    while (*link && *link != event) link = &(*link)->next;
    struct event *e = *link;
    if (e) *link = e->next;
    pthread_mutex_unlock(&si_lock);
    if (!e) return done(SI_CUDA_INVALID_RESOURCE_HANDLE);
    e->magic = 0;
    free(e);
    return SI_CUDA_SUCCESS;
}

SI_EXPORT int cudaEventRecord(void *event, void *stream) {
    int status = si_ready();
    if (status) return done(status);
    INJECT("cudaEventRecord");
    pthread_mutex_lock(&si_lock);
    struct event *e = event_of(event);
    si_stream *s = NULL;
    status = e ? stream_of_locked(stream, current_device, &s) : SI_CUDA_INVALID_RESOURCE_HANDLE;
    if (!status && s->device != e->device) status = SI_CUDA_INVALID_RESOURCE_HANDLE; /* another device's stream */
    pthread_mutex_unlock(&si_lock);
    if (status) return done(status);
    /* A marker item: it carries the legacy stream's implicit ordering, as the real record does. */
    uint64_t seq = si_enqueue(s, NULL, NULL, NULL, 0);
    pthread_mutex_lock(&si_lock);
    if (event_of(event)) {
        e->stream = s;
        e->seq = seq;
    }
    pthread_mutex_unlock(&si_lock);
    return SI_CUDA_SUCCESS;
}

SI_EXPORT int cudaStreamWaitEvent(void *stream, void *event, unsigned flags) {
    int status = si_ready();
    if (status) return done(status);
    INJECT("cudaStreamWaitEvent");
    pthread_mutex_lock(&si_lock);
    struct event *e = event_of(event);
    si_stream *s = NULL, *after = NULL;
    uint64_t seq = 0;
    status = !e ? SI_CUDA_INVALID_RESOURCE_HANDLE : flags ? SI_CUDA_INVALID_VALUE : stream_of_locked(stream, current_device, &s);
    if (!status) { /* the record as it is now: a later record of the same event does not count */
        after = e->stream;
        seq = e->seq;
    }
    pthread_mutex_unlock(&si_lock);
    if (status) return done(status);
    if (after) si_enqueue(s, NULL, NULL, after, seq);
    return SI_CUDA_SUCCESS;
}

SI_EXPORT int cudaEventQuery(void *event) {
    int status = si_ready();
    if (status) return done(status);
    INJECT("cudaEventQuery");
    pthread_mutex_lock(&si_lock);
    struct event *e = event_of(event);
    status = !e ? SI_CUDA_INVALID_RESOURCE_HANDLE : e->stream && e->stream->completed < e->seq ? SI_CUDA_NOT_READY : 0;
    pthread_mutex_unlock(&si_lock);
    return done(status);
}

SI_EXPORT int cudaEventSynchronize(void *event) {
    int status = si_ready();
    if (status) return done(status);
    INJECT("cudaEventSynchronize");
    pthread_mutex_lock(&si_lock);
    struct event *e = event_of(event);
    if (e && e->stream) wait_for(e->stream, e->seq);
    pthread_mutex_unlock(&si_lock);
    return done(e ? SI_CUDA_SUCCESS : SI_CUDA_INVALID_RESOURCE_HANDLE);
}

/* ---- errors ---- */

static const struct {
    int code;
    const char *name, *text;
} error_table[] = {
    {0, "cudaSuccess", "no error"},
    {1, "cudaErrorInvalidValue", "invalid argument"},
    {2, "cudaErrorMemoryAllocation", "out of memory"},
    {3, "cudaErrorInitializationError", "initialization error"},
    {17, "cudaErrorInvalidDevicePointer", "invalid device pointer"},
    {21, "cudaErrorInvalidMemcpyDirection", "invalid copy direction for memcpy"},
    {35, "cudaErrorInsufficientDriver", "CUDA driver version is insufficient for CUDA runtime version"},
    {100, "cudaErrorNoDevice", "no CUDA-capable device is detected"},
    {101, "cudaErrorInvalidDevice", "invalid device ordinal"},
    {400, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
    {600, "cudaErrorNotReady", "device not ready"},
    {700, "cudaErrorIllegalAddress", "an illegal memory access was encountered"},
    {719, "cudaErrorLaunchFailure", "unspecified launch failure"},
    {999, "cudaErrorUnknown", "unknown error"},
};

SI_EXPORT const char *cudaGetErrorString(int code) {
    for (size_t i = 0; i < sizeof error_table / sizeof error_table[0]; i++)
        if (error_table[i].code == code) return error_table[i].text;
    return "unrecognized error code";
}

SI_EXPORT const char *cudaGetErrorName(int code) {
    for (size_t i = 0; i < sizeof error_table / sizeof error_table[0]; i++)
        if (error_table[i].code == code) return error_table[i].name;
    return "unrecognized error code";
}

SI_EXPORT int cudaGetLastError(void) {
    int e = last_error;
    last_error = 0;
    return e;
}

SI_EXPORT int cudaPeekAtLastError(void) { return last_error; }

/* ---- test hooks ---- */

/* A framework's kernel that writes `len` bytes (captured now) at `dst` when `stream` reaches it. Launched
 * as CUDA launches kernels: the stream must belong to the current device. */
SI_EXPORT int standin_kernel_write(void *stream, void *dst, const void *src, size_t len) {
    int status = si_ready();
    if (status) return done(status);
    si_stream *s;
    status = si_stream_of(stream, current_device, &s);
    if (status) return done(status);
    if (s->device != current_device) return done(SI_CUDA_INVALID_RESOURCE_HANDLE);
    int d;
    uint8_t *to;
    if (si_device_memory(dst, len, &d, &to) != SI_DEVICE || d != current_device)
        return done(SI_CUDA_INVALID_DEVICE_POINTER); /* a kernel writing another GPU's or host memory */
    struct copy *c = malloc(sizeof *c);
    uint8_t *captured = malloc(len ? len : 1);
    if (!c || !captured) {
        free(c);
        free(captured);
        return done(SI_CUDA_MEMORY_ALLOCATION);
    }
    memcpy(captured, src, len);
    *c = (struct copy){.dst = to, .src = captured, .len = len, .fill = -1, .owned = captured, .kernel = 1};
    si_enqueue(s, run_copy, c, NULL, 0);
    return SI_CUDA_SUCCESS;
}

/* Device memory as it is now, whatever the streams still hold (no waiting). */
SI_EXPORT int standin_read(const void *device_ptr, void *host, size_t len) {
    uint8_t *bytes;
    int d;
    if (si_device_memory(device_ptr, len, &d, &bytes) != SI_DEVICE) return SI_CUDA_INVALID_DEVICE_POINTER;
    memcpy(host, bytes, len);
    return SI_CUDA_SUCCESS;
}

SI_EXPORT int standin_write(void *device_ptr, const void *host, size_t len) {
    uint8_t *bytes;
    int d;
    if (si_device_memory(device_ptr, len, &d, &bytes) != SI_DEVICE) return SI_CUDA_INVALID_DEVICE_POINTER;
    memcpy(bytes, host, len);
    return SI_CUDA_SUCCESS;
}

/* The device a pointer's allocation is on, or -1 for memory that is not device memory. */
SI_EXPORT int standin_device_of(const void *ptr) {
    int d;
    return si_device_memory(ptr, 0, &d, NULL) == SI_DEVICE ? d : -1;
}

SI_EXPORT int standin_set_stream_delay_us(unsigned us) {
    pthread_once(&settings_once, read_settings);
    atomic_store(&delay_us, us);
    return SI_CUDA_SUCCESS;
}

/* Add one injected failure, as an RVOD_STANDIN_FAIL entry; 0, or cudaErrorInvalidValue when malformed. */
SI_EXPORT int standin_fail(const char *spec) {
    pthread_once(&settings_once, read_settings);
    return spec && fault_add(spec) == 0 ? SI_CUDA_SUCCESS : SI_CUDA_INVALID_VALUE;
}

SI_EXPORT void standin_fail_clear(void) {
    pthread_mutex_lock(&fault_lock);
    fault_count = 0;
    pthread_mutex_unlock(&fault_lock);
}

/* How many times `name` (a CUDA runtime or NCCL function with an injection point) was called in this process,
 * counting the calls made once a driver and a device are there: what a test of per-op costs counts. */
SI_EXPORT long standin_calls(const char *name) {
    long n = 0;
    pthread_mutex_lock(&fault_lock);
    for (int i = 0; name && i < call_count_used; i++)
        if (strcmp(call_counts[i].name, name) == 0) n = call_counts[i].n;
    pthread_mutex_unlock(&fault_lock);
    return n;
}

/* How many of `what` are live: "streams" (created and not destroyed), "events", "allocations",
 * "device_bytes", "pinned", "comms"; -1 for another word. For leak checks. */
SI_EXPORT long standin_live(const char *what) {
    pthread_once(&settings_once, read_settings);
    if (what && strcmp(what, "comms") == 0) return si_live_comms();
    long n = 0;
    pthread_mutex_lock(&si_lock);
    if (!what) n = -1;
    else if (strcmp(what, "streams") == 0)
        for (si_stream *s = streams; s; s = s->next_all) n += s->kind == USER_STREAM && !s->destroyed;
    else if (strcmp(what, "events") == 0)
        for (struct event *e = events; e; e = e->next) n++;
    else if (strcmp(what, "allocations") == 0)
        for (int d = 0; d < visible_count; d++)
            for (struct allocation *a = allocations[d]; a; a = a->next) n++;
    else if (strcmp(what, "device_bytes") == 0)
        for (int d = 0; d < visible_count; d++) n += (long)in_use[d];
    else if (strcmp(what, "pinned") == 0)
        for (struct pinned *p = pinned_list; p; p = p->next) n++;
    else n = -1;
    pthread_mutex_unlock(&si_lock);
    return n;
}
