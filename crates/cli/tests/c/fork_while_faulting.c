/* A program that forks while two of its threads keep faulting, three times: each child checks
 * that it sees the memory (a large array and 200,000 small blocks) as it was at its fork while
 * the parent rewrites all of it at once, and that its own writes stay its own. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define MIB (1024 * 1024)
#define N (32 * MIB)
#define NODES 200000
#define C (16 * MIB)

static atomic_int stop;

static uint8_t pat(size_t i, int round) { return (uint8_t)(i * 31 + 7 * round + (i >> 12)); }

static void *toucher(void *arg) {
    volatile uint8_t *c = arg;
    size_t i = (size_t)(uintptr_t)arg % 4096;
    unsigned long sum = 0;
    while (!atomic_load(&stop)) {
        sum += c[i];
        c[i] = (uint8_t)(c[i] + 1);
        i = (i * 7 + 4096 * 13) % C;
    }
    return (void *)(uintptr_t)sum;
}

int main(void) {
    uint8_t *a = malloc(N);
    uint64_t **nodes = malloc(NODES * sizeof *nodes);
    uint8_t *c = malloc(C);
    if (!a || !nodes || !c) return 2;
    for (size_t i = 0; i < N; i++) a[i] = pat(i, 0);
    for (size_t i = 0; i < NODES; i++) {
        nodes[i] = malloc(4 * sizeof(uint64_t));
        if (!nodes[i]) return 2;
        nodes[i][0] = i * 3;
    }
    memset(c, 9, C);
    pthread_t t[2];
    for (int k = 0; k < 2; k++) pthread_create(&t[k], NULL, toucher, c + k * 4096);
    int failures = 0;
    for (int round = 0; round < 3; round++) {
        pid_t pid = fork();
        if (pid < 0) return 3;
        if (pid == 0) {
            int bad = 0;
            for (size_t i = 0; i < N; i++)
                if (a[i] != pat(i, round)) { bad |= 1; break; }
            for (size_t i = 0; i < NODES; i++)
                if (nodes[i][0] != i * 3 + (uint64_t)round) { bad |= 2; break; }
            memset(a, 0x55, N);
            for (size_t i = 0; i < N; i += 4096)
                if (a[i] != 0x55) bad |= 4;
            _exit(bad);
        }
        /* The parent rewrites everything while the child reads. */
        for (size_t i = 0; i < N; i++) a[i] = pat(i, round + 1);
        for (size_t i = 0; i < NODES; i++) nodes[i][0] = i * 3 + (uint64_t)round + 1;
        int st = 0;
        if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            fprintf(stderr, "fork_while_faulting: round %d: child status %#x (1: array, 2: "
                    "blocks, 4: own writes)\n", round, st);
            failures++;
        }
    }
    atomic_store(&stop, 1);
    for (int k = 0; k < 2; k++) pthread_join(t[k], NULL);
    for (size_t i = 0; i < N; i++)
        if (a[i] != pat(i, 3)) { fprintf(stderr, "parent's array at %zu\n", i); failures++; break; }
    for (size_t i = 0; i < NODES; i++) free(nodes[i]);
    free(nodes); free(a); free(c);
    if (failures) return 1;
    printf("fork_while_faulting: ok\n");
    return 0;
}
