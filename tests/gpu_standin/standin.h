/* What runtime.c (the CUDA runtime subset) shares with nccl.c (the NCCL subset) inside the stand-in.
 * Nothing here is exported: the library's public symbols are the CUDA, NCCL and standin_* functions
 * listed in README.md. */
#ifndef RVOD_STANDIN_H
#define RVOD_STANDIN_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#pragma GCC visibility push(hidden)

#define SI_EXPORT __attribute__((visibility("default")))
#define SI_MAX_DEVICES 16

/* cudaError_t values (driver_types.h numbering, CUDA 10 and later). */
enum {
    SI_CUDA_SUCCESS = 0,
    SI_CUDA_INVALID_VALUE = 1,
    SI_CUDA_MEMORY_ALLOCATION = 2,
    SI_CUDA_INITIALIZATION = 3,
    SI_CUDA_INVALID_DEVICE_POINTER = 17,
    SI_CUDA_INVALID_MEMCPY_DIRECTION = 21,
    SI_CUDA_INSUFFICIENT_DRIVER = 35,
    SI_CUDA_NO_DEVICE = 100,
    SI_CUDA_INVALID_DEVICE = 101,
    SI_CUDA_INVALID_RESOURCE_HANDLE = 400,
    SI_CUDA_NOT_READY = 600,
};

/* The one lock over streams, events and allocations, and the condition every stream's progress signals. */
extern pthread_mutex_t si_lock;
extern pthread_cond_t si_progress;

typedef struct si_stream si_stream;

/* Lazily read the settings; SI_CUDA_SUCCESS, or why no device can be used (no driver, no device). */
int si_ready(void);
/* The calling thread's current device (cudaSetDevice). */
int si_current_device(void);
/* The physical GPU behind a visible ordinal (CUDA_VISIBLE_DEVICES), which NCCL's duplicate check compares. */
int si_physical_device(int ordinal);

/* The stream a handle names: 0 and cudaStreamLegacy (1) are the legacy default stream of `device`,
 * cudaStreamPerThread (2) this thread's default stream of `device`. SI_CUDA_INVALID_RESOURCE_HANDLE for a
 * handle that is no live stream. */
int si_stream_of(void *handle, int device, si_stream **out);
int si_stream_device(const si_stream *stream);
/* Enqueue `run(arg)` on `stream`, after (stream `after`, position `after_seq`) too when `after` is set;
 * `run` owns `arg`. Returns the item's position; the stream's worker runs it in order, after the delay. */
uint64_t si_enqueue(si_stream *stream, void (*run)(void *), void *arg, si_stream *after, uint64_t after_seq);

/* Where device memory at `ptr` (`len` bytes) is: SI_DEVICE (one live allocation holds it: `*device` and
 * `*bytes`, the library's own view of it, are set), SI_HOST (not device memory), SI_BAD_RANGE (device
 * memory, but not inside one live allocation). Takes si_lock. */
enum { SI_DEVICE, SI_HOST, SI_BAD_RANGE };
int si_device_memory(const void *ptr, size_t len, int *device, uint8_t **bytes);

/* Injected failures (RVOD_STANDIN_FAIL, standin_fail): the code the `nth` call of `name` (on `device`, or on
 * any device) returns, or 0; `text` receives the failure's last-error text. */
int si_injected(const char *name, int device, char *text, size_t cap);

/* A whole-number setting from the environment, or `fallback` when it is unset, empty or not a number. */
long si_env_long(const char *name, long fallback);

/* How many communicators are live (nccl.c), for standin_live("comms"). */
long si_live_comms(void);

#pragma GCC visibility pop

#endif
