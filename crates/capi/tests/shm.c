/* netram.h's shared segments from C: made, written, attached again in this process and in a
 * second one (a child that attaches after fork), checked, destroyed. Prints "ok" and exits 0
 * only if every check passed. */
#define _DEFAULT_SOURCE
#include <netram.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define CHECK(c) do { if (!(c)) { printf("failed: %s (%s)\n", #c, netram_last_error()); return 1; } } while (0)

int main(void) {
    netram_shm *a = netram_shm_create("capi-segment", 100000, 0600, 0);
    CHECK(a != NULL);
    CHECK(netram_shm_size(a) == 102400);
    unsigned char *p = netram_shm_base(a);
    for (int i = 0; i < 100000; i++) p[i] = (unsigned char)(i * 7);
    CHECK(netram_shm_create("capi-segment", 4096, 0600, 0) == NULL);
    CHECK(strstr(netram_last_error(), "exists") != NULL);
    netram_shm *b = netram_shm_attach("capi-segment");
    CHECK(b != NULL);
    unsigned char *q = netram_shm_base(b);
    CHECK(q != p && memcmp(p, q, 100000) == 0);
    pid_t child = fork();
    if (child == 0) {
        /* The inherited attachment stays coherent: a store through it is seen by the parent. */
        if (q[100] != (unsigned char)(100 * 7)) _exit(4);
        netram_shm *c = netram_shm_attach("capi-segment");
        if (!c) _exit(2);
        unsigned char *r = netram_shm_base(c);
        for (int i = 0; i < 100000; i++) if (r[i] != (unsigned char)(i * 7)) _exit(3);
        q[60000] = 0xab;
        memcpy(r + 50000, "child was here", 14);
        netram_shm_detach(c);
        _exit(0);
    }
    int status = 0;
    CHECK(waitpid(child, &status, 0) == child);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        printf("failed: the child ended with status %d\n", status);
        return 1;
    }
    CHECK(memcmp(q + 50000, "child was here", 14) == 0);
    CHECK(p[60000] == 0xab);
    CHECK(netram_shm_detach(a) == 0 && netram_shm_detach(b) == 0);
    CHECK(netram_shm_destroy("capi-segment") == 0);
    CHECK(netram_shm_attach("capi-segment") == NULL);
    CHECK(strstr(netram_last_error(), "no segment") != NULL);
    printf("ok\n");
    return 0;
}
