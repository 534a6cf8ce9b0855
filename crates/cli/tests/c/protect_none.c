/* Guard pages in the heap: 1 MiB of a 32 MiB block, written and resident, is made
 * PROT_NONE while the rest is rewritten three times over (with 4M local, every page of the
 * block is chosen as a victim meanwhile), then made readable again and checked; the rest is
 * checked too. The fault handler copies victims out: a plain load of a PROT_NONE page would
 * kill the process with SIGSEGV (it did). Prints "protect_none: ok". */
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

static unsigned char pattern(size_t i, int round) { return (unsigned char)(i * 7 + 1 + round); }

int main(void) {
    const size_t n = 32 << 20, guard = 1 << 20;
    unsigned char *a = aligned_alloc(4096, n);
    if (!a) return 2;
    for (size_t i = 0; i < n; i++) a[i] = pattern(i, 0);
    /* Back in local memory, dirty, when it becomes unreadable. */
    for (size_t i = 0; i < guard; i += 4096) a[i] = pattern(i, 0);
    if (mprotect(a, guard, PROT_NONE)) { perror("mprotect"); return 3; }
    for (int r = 1; r <= 3; r++)
        for (size_t i = guard; i < n; i += 512) a[i] = pattern(i, r);
    if (mprotect(a, guard, PROT_READ | PROT_WRITE)) { perror("mprotect back"); return 3; }
    for (size_t i = 0; i < guard; i++)
        if (a[i] != pattern(i, 0)) { printf("guarded byte %zu wrong\n", i); return 1; }
    for (size_t i = guard; i < n; i++)
        if (a[i] != pattern(i, i % 512 == 0 ? 3 : 0)) { printf("byte %zu wrong\n", i); return 1; }
    printf("protect_none: ok\n");
    return 0;
}
