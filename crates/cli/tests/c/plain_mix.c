/* Small and large blocks through the standard entry points only, malloc_usable_size asked of
 * each: linked with tcmalloc or mimalloc (which replace glibc's __libc_malloc too) or with
 * nothing, it must run the same under `netram run`. Prints "plainmix: ok". */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <malloc.h>
int main(void) {
    enum { N = 50000, BIG = 8, BS = 8 << 20 };
    static char *s[N];
    for (int i = 0; i < N; i++) { size_t n = 16 + (i * 37) % 2000; s[i] = malloc(n); memset(s[i], i & 0xff, n); if (malloc_usable_size(s[i]) < n) return 5; }
    char *b[BIG];
    for (int i = 0; i < BIG; i++) { b[i] = malloc(BS); memset(b[i], i + 1, BS); }
    for (int r = 0; r < 2; r++) for (int i = 0; i < BIG; i++) for (size_t j = 0; j < BS; j += 4096) if (b[i][j] != i + 1) { printf("wrong\n"); return 1; }
    for (int i = 0; i < N; i++) { size_t n = 16 + (i * 37) % 2000; if (s[i][n-1] != (char)(i & 0xff)) { printf("wrong small\n"); return 1; } free(s[i]); }
    for (int i = 0; i < BIG; i++) free(b[i]);
    printf("plainmix: ok\n"); return 0;
}
