/* An ordinary program that knows nothing of netram: every allocation call the preload library
 * interposes, each block written and verified. Run by tests/run.rs under `netram run`. */
#define _GNU_SOURCE
#include <malloc.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#define MIB ((size_t)1 << 20)
static int failures;
#define CHECK(c, what)                                                                    \
    do {                                                                                  \
        if (!(c)) {                                                                       \
            fprintf(stderr, "alloc_mix: FAILED line %d: %s\n", __LINE__, what);           \
            failures++;                                                                   \
        }                                                                                 \
    } while (0)

static void fill(uint8_t *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i += 512) p[i] = (uint8_t)(i / 512 * 31 + seed);
}
/* Whether bytes [from, to) of a block filled by fill(p, _, seed) still hold the pattern. */
static int same_in(const uint8_t *p, size_t from, size_t to, unsigned seed) {
    for (size_t i = from; i < to; i += 512)
        if (p[i] != (uint8_t)(i / 512 * 31 + seed)) return 0;
    return 1;
}
static int same(const uint8_t *p, size_t n, unsigned seed) { return same_in(p, 0, n, seed); }
static int zero(const uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i += 512)
        if (p[i]) return 0;
    return 1;
}

int main(void) {
    uint8_t *a = malloc(24 * MIB);
    uint8_t *b = calloc(6, 4 * MIB);
    void *c = NULL;
    CHECK(posix_memalign(&c, 65536, 8 * MIB) == 0 && ((uintptr_t)c % 65536) == 0, "memalign");
    uint8_t *d = aligned_alloc(4096, 8 * MIB);
    uint8_t *m = mmap(NULL, 16 * MIB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(a && b && c && d && m != MAP_FAILED, "allocations");
    CHECK(zero(b, 24 * MIB) && zero(m, 16 * MIB), "fresh memory is zero");
    CHECK(malloc_usable_size(a) >= 24 * MIB, "usable size");
    fill(a, 24 * MIB, 1); fill(b, 24 * MIB, 2); fill(c, 8 * MIB, 3); fill(d, 8 * MIB, 4);
    fill(m, 16 * MIB, 5);
    CHECK(same(a, 24 * MIB, 1) && same(b, 24 * MIB, 2) && same(c, 8 * MIB, 3), "read back");
    CHECK(same(d, 8 * MIB, 4) && same(m, 16 * MIB, 5), "read back");

    /* Growing a block keeps its bytes; a small block grown past the threshold too. */
    a = realloc(a, 40 * MIB);
    CHECK(a && same(a, 24 * MIB, 1), "realloc keeps the contents");
    uint8_t *s = malloc(1000);
    memset(s, 7, 1000);
    s = realloc(s, 4 * MIB);
    CHECK(s && s[999] == 7, "small block grown");
    /* mremap grows a mapping; partial munmap and MADV_DONTNEED give pages back as zeros. */
    m = mremap(m, 16 * MIB, 32 * MIB, MREMAP_MAYMOVE);
    CHECK(m != MAP_FAILED && same(m, 16 * MIB, 5), "mremap keeps the contents");
    CHECK(madvise(m, 4 * MIB, MADV_DONTNEED) == 0 && zero(m, 4 * MIB), "MADV_DONTNEED zeroes");
    CHECK(same_in(m, 4 * MIB, 16 * MIB, 5), "the rest of the mapping is intact");
    CHECK(munmap(m + 16 * MIB, 16 * MIB) == 0, "partial munmap");
    CHECK(munmap(m, 16 * MIB) == 0, "munmap");

    /* A forked child does not inherit netram memory, but may allocate and exec. */
    pid_t pid = fork();
    if (pid == 0) {
        uint8_t *x = malloc(8 * MIB);
        if (!x) _exit(3);
        memset(x, 1, 8 * MIB);
        int ok = x[8 * MIB - 1] == 1;
        free(x);
        _exit(ok ? 0 : 4);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child allocates on its own");
    /* A child sees the parent's memory as it was at the fork, most of it on the servers (root:
     * forks are followed), and exits 5; where forks cannot be followed (an ordinary user,
     * ALLOC_MIX_FORK_SEGV set by the test) it dies of SIGSEGV, never reading wrong data. */
    pid = fork();
    if (pid == 0) {
        _exit(same(a, 24 * MIB, 1) ? 5 : 6);
    }
    waitpid(pid, &st, 0);
    int segv = getenv("NETRAM_LOCAL_MEM") != NULL && getenv("ALLOC_MIX_FORK_SEGV") != NULL;
    CHECK(segv ? (WIFSIGNALED(st) && WTERMSIG(st) == SIGSEGV) : (WIFEXITED(st) && WEXITSTATUS(st) == 5),
          "a child touching inherited memory");
    CHECK(same(a, 24 * MIB, 1), "parent's memory after fork");

    free(a); free(b); free(c); free(d); free(s);
    if (failures) return 1;
    printf("alloc_mix: ok\n");
    return 0;
}
