/*
 * netram.h: regions of cluster memory for C programs (libnetram.so).
 *
 * A region is a range of this process's address space whose pages live in the RAM of netram
 * page servers (`netram serve`): at most `budget` bytes of it are in local memory; the rest is
 * paged in on access through userfaultfd and out by an approximation of LRU. Allocate from it
 * with netram_alloc, or use it directly from netram_region_base. Works as an ordinary user.
 *
 * Errors: functions return NULL or -1 and leave a message for netram_last_error().
 * Threads: every function may be called from any thread.
 * fork(): a child does not inherit regions (touching one there is SIGSEGV).
 */
#ifndef NETRAM_H
#define NETRAM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct netram_region netram_region;

/* What a region has done so far. */
struct netram_counters {
    uint64_t faults;         /* page faults served */
    uint64_t zero_fills;     /* ... by mapping zeros (never written: no I/O) */
    uint64_t fetches;        /* ... by fetching the page from its server */
    uint64_t evictions;      /* pages sent out (or dropped) to stay within the budget */
    uint64_t evicted_clean;  /* ... of which unchanged since fetched: dropped, no I/O */
    uint64_t samples;        /* pages sampled for the LRU approximation */
    uint64_t sample_faults;  /* ... touched again (the approximation's cost) */
    uint64_t prefetched;     /* pages fetched ahead and left to be faulted on */
    uint64_t prefetch_hits;  /* ... that were then used (the prefetcher's hit rate) */
    uint64_t prefetch_installed; /* pages fetched ahead and mapped at once (no fault) */
    uint64_t released;       /* pages given back by netram_free */
    uint64_t errors;         /* faults that could not be served at once (retried) */
    uint64_t resident_bytes; /* in local memory now */
    uint64_t budget_bytes;   /* local memory allowed */
};

/*
 * Creates a region of `size` bytes, at most `budget` of them in local memory.
 *   servers: "host:port,host:port" of page servers; NULL: the NETRAM_SERVERS variable;
 *            empty (or neither): the other live members the local daemon knows
 *            (`netram serve` on this machine, asked at NETRAM_DAEMON or 127.0.0.1:9077).
 *   backing: "cluster" (spill to local disk only when the cluster is full), "disk" (local
 *            disk only, no servers needed) or "cluster+disk" (a copy on disk too); NULL:
 *            "cluster".
 * Returns NULL on error.
 */
netram_region *netram_region_create(const char *servers, const char *backing, uint64_t size,
                                    uint64_t budget);

/* Frees the region, its local memory and its pages on the servers. NULL is ignored. */
void netram_region_destroy(netram_region *region);

/* The region's first byte; its size is the `size` given, rounded up to whole pages. */
void *netram_region_base(netram_region *region);

/* `size` bytes of the region (whole pages, page-aligned, reading as zeros); NULL when the
 * region has no free range that large. */
void *netram_alloc(netram_region *region, size_t size);

/* Gives an allocation back: its pages leave local memory and their servers. 0, or -1 if
 * `ptr` is not an allocation of this region. NULL is ignored. */
int netram_free(netram_region *region, void *ptr);

/* Changes the local budget (at least one page); lowering it evicts at once. 0 or -1. */
int netram_set_budget(netram_region *region, uint64_t budget);

/* Fills `out`. 0 or -1. */
int netram_counters(netram_region *region, struct netram_counters *out);

/* The last error on this thread, or "" if none. Valid until the next call on this thread. */
const char *netram_last_error(void);

/*
 * Segments shared between machines (MIRAGE+): memory that processes on any machine of the
 * cluster attach by name and use with plain loads and stores; every load sees the latest
 * store, whichever machine made it (write-invalidate: one writer or many readers per page).
 * Through the local daemon (`netram serve`, asked beside its control socket NETRAM_DAEMON).
 * A segment lives in the daemons until destroyed, like a System V segment. A forked child
 * keeps its parent's attachments (registered again in the child before fork() returns there;
 * a child that cannot reach the daemon exits with status 127 rather than use them
 * incoherently).
 */
typedef struct netram_shm netram_shm;

/* Creates segment `name` (1-255 bytes, no spaces) of `size` bytes (rounded up to pages), every
 * byte zero, this machine its library; `mode`: permission bits as System V's (owner and
 * others, read and write together: 0600, 0666); `window_ms`: how long a machine keeps a page
 * it got before it must give it up (0 allowed). NULL on error (a segment of that name exists,
 * no daemon answers ...). */
netram_shm *netram_shm_create(const char *name, uint64_t size, uint32_t mode, uint32_t window_ms);

/* Attaches segment `name`, created on this machine or another. NULL on error. */
netram_shm *netram_shm_attach(const char *name);

/* Where the segment is in this process, and its size in bytes. */
void *netram_shm_base(netram_shm *shm);
uint64_t netram_shm_size(netram_shm *shm);

/* Detaches it: its memory is unmapped, the handle freed. 0, or -1. NULL is ignored. */
int netram_shm_detach(netram_shm *shm);

/* Takes segment `name`'s name away (System V's IPC_RMID): nobody attaches it by name any
 * more; processes attached keep it. 0, or -1. */
int netram_shm_destroy(const char *name);

#ifdef __cplusplus
}
#endif

#endif /* NETRAM_H */
