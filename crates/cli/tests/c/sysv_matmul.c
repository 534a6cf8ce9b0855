#define _DEFAULT_SOURCE
/* A parallel matrix multiply written against System V shared memory and semaphores, as
 * MIRAGE+'s Table 7 measured: it knows nothing of netram. One coordinator and W workers
 * (separate processes, on any machines) share A, B and C by key; semaphore 0 starts the
 * workers, semaphore 1 counts the finished ones. The coordinator checks C against its own
 * product and prints "ok CHECKSUM SECONDS"; exit 0 only if every entry is right.
 *
 *   sysv_matmul coordinator KEY WORKERS N
 *   sysv_matmul worker KEY WORKERS N INDEX
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ipc.h>
#include <sys/sem.h>
#include <sys/shm.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static void sem(int id, int num, int op) {
    struct sembuf b = {.sem_num = num, .sem_op = op, .sem_flg = 0};
    if (semop(id, &b, 1) != 0) { perror("semop"); exit(1); }
}

int main(int argc, char **argv) {
    if (argc < 5) { fprintf(stderr, "usage\n"); return 2; }
    int coord = strcmp(argv[1], "coordinator") == 0;
    key_t key = (key_t)strtol(argv[2], 0, 0);
    int workers = atoi(argv[3]), n = atoi(argv[4]);
    int index = coord ? 0 : atoi(argv[5]);
    size_t bytes = 3 * (size_t)n * n * sizeof(double);
    int flags = coord ? IPC_CREAT | IPC_EXCL | 0600 : 0;
    int shm = -1, sid = -1;
    for (int tries = 0; tries < 300; tries++) { /* a worker may start before the coordinator */
        shm = shmget(key, bytes, flags);
        if (shm >= 0 || coord) break;
        usleep(100000);
    }
    if (shm < 0) { perror("shmget"); return 1; }
    double *m = shmat(shm, 0, 0);
    if (m == (void *)-1) { perror("shmat"); return 1; }
    double *a = m, *b = m + (size_t)n * n, *c = m + 2 * (size_t)n * n;
    for (int tries = 0; tries < 300; tries++) {
        sid = semget(key, 2, coord ? IPC_CREAT | 0600 : 0);
        if (sid >= 0 || coord) break;
        usleep(100000);
    }
    if (sid < 0) { perror("semget"); return 1; }
    if (coord) {
        for (int i = 0; i < n * n; i++) {
            a[i] = (i % 17) - 8;
            b[i] = (i % 13) - 6;
        }
        double t0 = now();
        sem(sid, 0, workers); /* go */
        sem(sid, 1, -workers); /* all done */
        double t = now() - t0;
        double sum = 0;
        int bad = 0;
        for (int i = 0; i < n; i++)
            for (int j = 0; j < n; j++) {
                double s = 0;
                for (int k = 0; k < n; k++) s += a[i * n + k] * b[k * n + j];
                if (c[i * n + j] != s) bad++;
                sum += c[i * n + j];
            }
        shmdt(m);
        shmctl(shm, IPC_RMID, 0);
        semctl(sid, 0, IPC_RMID);
        if (bad) { printf("bad %d entries\n", bad); return 1; }
        printf("ok %.0f %.3f\n", sum, t);
        return 0;
    }
    sem(sid, 0, -1);
    for (int i = index; i < n; i += workers)
        for (int j = 0; j < n; j++) {
            double s = 0;
            for (int k = 0; k < n; k++) s += a[i * n + k] * b[k * n + j];
            c[i * n + j] = s;
        }
    sem(sid, 1, 1);
    shmdt(m);
    printf("worker %d done\n", index);
    return 0;
}
