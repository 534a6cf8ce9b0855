/* A program linked with jemalloc, as Redis is on Debian: it mixes the standard entry points
 * (which LD_PRELOAD gives to netram's library first) with jemalloc's own (mallocx, sdallocx,
 * rallocx, sallocx, nallocx), frees with one what the other allocated, and asks
 * malloc_usable_size of everything. Under `netram run` nothing may crash, every byte must read
 * back as written, and its large memory must go out to the cluster (through mmap, which
 * jemalloc calls for all of its memory). Prints "jemalloc_mix: ok". */
#include <jemalloc/jemalloc.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures;

#define CHECK(cond, ...)                                                                     \
    do {                                                                                     \
        if (!(cond)) {                                                                       \
            fprintf(stderr, "jemalloc_mix: " __VA_ARGS__);                                   \
            fputc('\n', stderr);                                                             \
            failures++;                                                                      \
        }                                                                                    \
    } while (0)

static unsigned char fill(size_t i, size_t seed) { return (unsigned char)((i * 31 + seed) | 1); }

static void write_block(unsigned char *p, size_t n, size_t seed) {
    for (size_t i = 0; i < n; i += 512) p[i] = fill(i, seed);
    p[n - 1] = fill(n - 1, seed);
}

static int check_block(const unsigned char *p, size_t n, size_t seed) {
    for (size_t i = 0; i < n; i += 512)
        if (p[i] != fill(i, seed)) return 0;
    return p[n - 1] == fill(n - 1, seed);
}

int main(void) {
    /* Small and medium blocks, each freed through a different entry point than the one that
     * allocated it, as Redis does (zmalloc: malloc, then sdallocx with the usable size). */
    enum { N = 20000 };
    static void *small[N];
    static size_t sizes[N];
    for (size_t i = 0; i < N; i++) {
        sizes[i] = 8 + (i * 37) % 3000;
        small[i] = (i % 2) ? malloc(sizes[i]) : mallocx(sizes[i], 0);
        CHECK(small[i] != NULL, "allocation %zu failed", i);
        write_block(small[i], sizes[i], i);
        CHECK(malloc_usable_size(small[i]) >= sizes[i], "usable size of block %zu", i);
        CHECK(sallocx(small[i], 0) == malloc_usable_size(small[i]), "sallocx of block %zu", i);
    }
    for (size_t i = 0; i < N; i++) {
        CHECK(check_block(small[i], sizes[i], i), "block %zu changed", i);
        size_t usable = malloc_usable_size(small[i]);
        switch (i % 3) {
        case 0: sdallocx(small[i], usable, 0); break;
        case 1: free(small[i]); break;
        default: dallocx(small[i], 0); break;
        }
    }
    /* rallocx and realloc of the same block in turn. */
    unsigned char *r = malloc(100);
    write_block(r, 100, 7);
    r = rallocx(r, 5000, 0);
    CHECK(r && check_block(r, 100, 7), "rallocx lost the contents");
    r = realloc(r, 300000);
    CHECK(r && check_block(r, 100, 7), "realloc lost the contents");
    CHECK(nallocx(300000, 0) <= malloc_usable_size(r), "nallocx");
    sdallocx(r, 300000, 0);

    /* Large arrays, far more than netram run's local memory in the test: they go out to the
     * cluster and come back. */
    enum { BIG = 8, BIG_SIZE = 8 << 20 };
    unsigned char *big[BIG];
    for (size_t i = 0; i < BIG; i++) {
        big[i] = (i % 2) ? malloc(BIG_SIZE) : mallocx(BIG_SIZE, MALLOCX_ZERO);
        CHECK(big[i] != NULL, "large allocation %zu failed", i);
        if (!big[i]) return 1;
        CHECK(big[i][BIG_SIZE / 2] == 0 || i % 2, "mallocx(MALLOCX_ZERO) not zero");
        write_block(big[i], BIG_SIZE, 100 + i);
    }
    for (int round = 0; round < 2; round++)
        for (size_t i = 0; i < BIG; i++)
            CHECK(check_block(big[i], BIG_SIZE, 100 + i), "large block %zu changed", i);
    for (size_t i = 0; i < BIG; i++) {
        if (i % 2) free(big[i]);
        else sdallocx(big[i], BIG_SIZE, 0);
    }
    if (failures) {
        fprintf(stderr, "jemalloc_mix: %d failures\n", failures);
        return 1;
    }
    printf("jemalloc_mix: ok\n");
    return 0;
}
