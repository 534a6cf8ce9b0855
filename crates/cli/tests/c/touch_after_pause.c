/* Fills 32 MiB with a pattern, says "filled", waits for a line on stdin, then reads it all
 * back and says "checked" (or "wrong" and exit 1). Under `netram run` with a small budget most of
 * it is on the servers by the time it waits: a test kills them in between. */
#include <stdio.h>
#include <stdlib.h>

int main(void) {
    enum { SIZE = 32 << 20 };
    unsigned char *p = malloc(SIZE);
    if (!p) return 2;
    for (size_t i = 0; i < SIZE; i += 4096) p[i] = (unsigned char)(i / 4096 * 7 + 1);
    printf("filled\n");
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) return 3;
    for (size_t i = 0; i < SIZE; i += 4096)
        if (p[i] != (unsigned char)(i / 4096 * 7 + 1)) {
            printf("wrong\n");
            return 1;
        }
    printf("checked\n");
    free(p);
    return 0;
}
