/* System V shared memory attached read-only (SHM_RDONLY), written elsewhere: a test program
 * that knows nothing of netram. "write KEY": makes the segment and writes a string into it.
 * "read KEY": attaches it read-only, checks the string, checks that a store through that
 * attachment is a SIGSEGV (in a forked child) while one through a read-write attachment of
 * the same segment is seen through it, then removes the segment; prints "ok". */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ipc.h>
#include <sys/shm.h>
#include <sys/wait.h>
#include <unistd.h>

static const char *const WRITTEN = "written on another machine";

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s write|read KEY\n", argv[0]);
        return 2;
    }
    key_t key = (key_t)strtol(argv[2], NULL, 0);
    if (strcmp(argv[1], "write") == 0) {
        int id = shmget(key, 2 * 4096, IPC_CREAT | IPC_EXCL | 0600);
        if (id < 0) { perror("shmget"); return 1; }
        char *p = shmat(id, NULL, 0);
        if (p == (void *)-1) { perror("shmat"); return 1; }
        strcpy(p + 4096, WRITTEN);
        if (shmdt(p) != 0) { perror("shmdt"); return 1; }
        puts("written");
        return 0;
    }
    int id = shmget(key, 0, 0);
    if (id < 0) { perror("shmget"); return 1; }
    char *ro = shmat(id, NULL, SHM_RDONLY);
    if (ro == (void *)-1) { perror("shmat SHM_RDONLY"); return 1; }
    if (strcmp(ro + 4096, WRITTEN) != 0) {
        fprintf(stderr, "read %.40s\n", ro + 4096);
        return 1;
    }
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) { perror("fork"); return 1; }
    if (pid == 0) {
        alarm(20);
        ((volatile char *)ro)[4096] = 'X';
        _exit(0); /* not reached if the attachment is read-only */
    }
    int status;
    if (waitpid(pid, &status, 0) != pid) { perror("waitpid"); return 1; }
    if (!WIFSIGNALED(status) || WTERMSIG(status) != SIGSEGV) {
        fprintf(stderr, "a store through a read-only attachment did not fault: %#x\n", status);
        return 1;
    }
    char *rw = shmat(id, NULL, 0);
    if (rw == (void *)-1) { perror("shmat"); return 1; }
    rw[4096] = 'W';
    if (ro[4096] != 'W' || strcmp(ro + 4097, WRITTEN + 1) != 0) {
        fprintf(stderr, "the read-write attachment's store is not seen read-only\n");
        return 1;
    }
    if (shmdt(rw) != 0 || shmdt(ro) != 0) { perror("shmdt"); return 1; }
    if (shmctl(id, IPC_RMID, NULL) != 0) { perror("shmctl IPC_RMID"); return 1; }
    puts("ok");
    return 0;
}
