/* A child that closes every descriptor it inherited (as daemons and some workers do), in
 * three ways: it does not (0), it does (1: its netram agent's socket goes with them), it
 * does after forking a grandchild that keeps a copy of everything for a minute or until the
 * child ends (2: the socket stays open, nobody answers on it). Each time the child reads its 64 MiB as they
 * were at the fork, twice, while the parent rewrites them, then writes and reads back its
 * own. Exits 0 when every child saw exactly its memory. */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <sys/prctl.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

static unsigned char at(size_t i) { return (unsigned char)(i * 7 + 3); }

int main(void) {
    size_t n = 64 << 20;
    unsigned char *p = malloc(n);
    if (!p) return 2;
    for (size_t i = 0; i < n; i++) p[i] = at(i);
    int failed = 0;
    for (int mode = 0; mode < 3; mode++) {
        pid_t c = fork();
        if (c < 0) return 3;
        if (c == 0) {
            if (mode == 2 && fork() == 0) {
                /* Holds every descriptor but the standard ones for a minute, or until the
                 * child ends. */
                prctl(PR_SET_PDEATHSIG, SIGKILL);
                close(0);
                close(1);
                close(2);
                sleep(60);
                _exit(0);
            }
            if (mode >= 1) syscall(SYS_close_range, 3, ~0U, 0);
            unsigned long bad = 0;
            for (int r = 0; r < 2; r++)
                for (size_t i = 0; i < n; i += 97)
                    if (p[i] != at(i)) bad++;
            for (size_t i = 0; i < n; i += 4096) p[i] = 1;
            for (size_t i = 0; i < n; i += 4096)
                if (p[i] != 1) bad++;
            _exit(bad != 0);
        }
        for (size_t i = 0; i < n; i += 8192) p[i] = 9;
        int st;
        if (waitpid(c, &st, 0) != c || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            printf("mode %d: the child saw other memory (status %#x)\n", mode, st);
            failed = 1;
        }
        for (size_t i = 0; i < n; i += 8192) p[i] = at(i);
    }
    printf(failed ? "children: failed\n" : "children: ok\n");
    return failed;
}
