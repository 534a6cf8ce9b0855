# A parallel reduction written against System V IPC with Python's sysv_ipc (Debian's
# python3-sysv-ipc), for `netram bench dsm` (issue 40): nothing in it knows about netram.
#
#   sysv_reduce.py coordinator KEY WORKERS     makes the segment and the semaphores, fills the
#                                              input, times the workers, checks their sums
#   sysv_reduce.py worker KEY WORKERS INDEX    sums its slice of the input
#
# Page 0 holds one double per worker (written by each: the page goes from worker to worker);
# the input, 2^16 doubles (128 pages), follows. The coordinator prints "ok SUM SECONDS".
import math
import struct
import sys
import time

import sysv_ipc

N = 1 << 16
HEAD = 4096
PASSES = 4


def value(i):
    return ((i * 7919) % 1000003) / 1000.0


def part(xs):
    s = 0.0
    for _ in range(PASSES):
        for x in xs:
            s += math.sqrt(x)
    return s


def main():
    role, key, workers = sys.argv[1], int(sys.argv[2], 0), int(sys.argv[3])
    per = N // workers
    if role == "coordinator":
        m = sysv_ipc.SharedMemory(key, sysv_ipc.IPC_CREX, mode=0o600, size=HEAD + N * 8)
        ready = sysv_ipc.Semaphore(key, sysv_ipc.IPC_CREX, mode=0o600, initial_value=0)
        go = sysv_ipc.Semaphore(key + 1, sysv_ipc.IPC_CREX, mode=0o600, initial_value=0)
        done = sysv_ipc.Semaphore(key + 2, sysv_ipc.IPC_CREX, mode=0o600, initial_value=0)
        data = [value(i) for i in range(N)]
        m.write(struct.pack("%dd" % N, *data), HEAD)
        want = [part(data[w * per:(w + 1) * per]) for w in range(workers)]
        for _ in range(workers):
            ready.acquire(timeout=120)
        t0 = time.monotonic()
        for _ in range(workers):
            go.release()
        for _ in range(workers):
            done.acquire(timeout=120)
        seconds = time.monotonic() - t0
        got = list(struct.unpack("%dd" % workers, m.read(workers * 8, 0)))
        for s in (ready, go, done):
            s.remove()
        m.detach()
        m.remove()
        if got != want:
            print("wrong sums: got %r, want %r" % (got, want))
            sys.exit(1)
        print("ok %r %.6f" % (sum(got), seconds))
    else:
        index = int(sys.argv[4])
        for _ in range(1200):
            try:
                m = sysv_ipc.SharedMemory(key)
                ready = sysv_ipc.Semaphore(key)
                go = sysv_ipc.Semaphore(key + 1)
                done = sysv_ipc.Semaphore(key + 2)
                break
            except sysv_ipc.ExistentialError:
                time.sleep(0.05)
        else:
            sys.exit("the coordinator's segment never came")
        ready.release()
        go.acquire(timeout=120)
        raw = m.read(per * 8, HEAD + index * per * 8)
        s = part(struct.unpack("%dd" % per, raw))
        m.write(struct.pack("d", s), index * 8)
        done.release()


main()
