/* A C program on netram.h: three allocations four times the local budget, written, read back
 * and freed; the counters and the error paths checked. argv[1]: the page servers. */
#include "netram.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MIB (1024u * 1024u)

static int failures;

#define CHECK(cond, ...)                                                                  \
    do {                                                                                  \
        if (!(cond)) {                                                                    \
            fprintf(stderr, "FAILED %s:%d: %s: ", __FILE__, __LINE__, #cond);             \
            fprintf(stderr, __VA_ARGS__);                                                 \
            fprintf(stderr, "\n");                                                        \
            failures++;                                                                   \
        }                                                                                 \
    } while (0)

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s SERVERS\n", argv[0]);
        return 2;
    }
    /* Bad input: clear errors, no region. */
    CHECK(netram_region_create(argv[1], "tape", 16 * MIB, MIB) == NULL, "bad backing");
    CHECK(strstr(netram_last_error(), "unknown backing") != NULL, "%s", netram_last_error());
    CHECK(netram_region_create(argv[1], NULL, 16 * MIB, 100) == NULL, "budget below a page");
    CHECK(netram_region_create("127.0.0.1:1", NULL, 16 * MIB, MIB) == NULL, "no server");
    CHECK(strstr(netram_last_error(), "no page server") != NULL, "%s", netram_last_error());

    netram_region *r = netram_region_create(argv[1], NULL, 64 * MIB, 4 * MIB);
    CHECK(r != NULL, "create: %s", netram_last_error());
    if (r == NULL)
        return 1;
    CHECK(netram_region_base(r) != NULL, "base");

    size_t n = 4 * MIB / sizeof(uint64_t);
    uint64_t *a[3];
    for (int k = 0; k < 3; k++) {
        a[k] = netram_alloc(r, n * sizeof(uint64_t) + 1);
        CHECK(a[k] != NULL, "alloc %d: %s", k, netram_last_error());
        if (a[k] == NULL)
            return 1;
        CHECK(a[k][0] == 0 && a[k][n - 1] == 0, "fresh memory reads as zeros");
        for (size_t i = 0; i < n; i++)
            a[k][i] = i * 2654435761u + (uint64_t)k;
    }
    for (int k = 0; k < 3; k++)
        for (size_t i = 0; i < n; i++)
            if (a[k][i] != i * 2654435761u + (uint64_t)k) {
                CHECK(0, "allocation %d word %zu reads %llu", k, i, (unsigned long long)a[k][i]);
                break;
            }

    struct netram_counters c;
    CHECK(netram_counters(r, &c) == 0, "counters");
    /* Fetched on a fault, or ahead of one by the prefetcher. */
    CHECK(c.evictions > 1000 && c.fetches + c.prefetch_installed > 1000,
          "evictions %llu fetches %llu mapped ahead %llu", (unsigned long long)c.evictions,
          (unsigned long long)c.fetches, (unsigned long long)c.prefetch_installed);
    CHECK(c.resident_bytes <= 4 * MIB, "resident %llu", (unsigned long long)c.resident_bytes);
    CHECK(c.budget_bytes == 4 * MIB, "budget %llu", (unsigned long long)c.budget_bytes);

    CHECK(netram_set_budget(r, MIB) == 0, "set_budget");
    CHECK(netram_counters(r, &c) == 0 && c.resident_bytes <= MIB, "resident after lowering %llu",
          (unsigned long long)c.resident_bytes);

    int local;
    CHECK(netram_free(r, &local) == -1, "freeing memory not from the region");
    CHECK(strstr(netram_last_error(), "not allocated") != NULL, "%s", netram_last_error());
    for (int k = 0; k < 3; k++)
        CHECK(netram_free(r, a[k]) == 0, "free %d: %s", k, netram_last_error());
    CHECK(netram_counters(r, &c) == 0 && c.released >= 3 * n * sizeof(uint64_t) / 4096,
          "released %llu", (unsigned long long)c.released);
    /* Freed memory handed out again reads as zeros. */
    uint64_t *again = netram_alloc(r, 8 * MIB);
    CHECK(again != NULL && again[12345] == 0, "reused memory is zeroed");
    CHECK(netram_alloc(r, 1024 * MIB) == NULL, "larger than the region");
    netram_region_destroy(r);
    netram_region_destroy(NULL);

    if (failures) {
        fprintf(stderr, "%d checks failed\n", failures);
        return 1;
    }
    printf("netram.h: all checks passed\n");
    return 0;
}
