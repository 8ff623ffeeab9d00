# What the old worker loop paid per step on CPU: rank 0 publishes the control
# value, every rank passes a barrier and reads it (Python multiprocessing).
# Prints "p50_ns p99_ns" of rank 0's per-step time.
import multiprocessing as mp
import sys
import time


def rank(r, steps, value, barrier, out):
    lat = []
    for i in range(steps):
        t = time.perf_counter_ns()
        if r == 0:
            value.value = 0
        barrier.wait()
        _ = value.value
        lat.append(time.perf_counter_ns() - t)
    if r == 0:
        lat.sort()
        out.put((lat[len(lat) // 2], lat[len(lat) * 99 // 100]))


if __name__ == "__main__":
    n, steps = int(sys.argv[1]), int(sys.argv[2])
    value, barrier, out = mp.Value("i", 0, lock=False), mp.Barrier(n), mp.Queue()
    procs = [mp.Process(target=rank, args=(r, steps, value, barrier, out)) for r in range(n)]
    for p in procs:
        p.start()
    p50, p99 = out.get(timeout=300)
    for p in procs:
        p.join()
    print(p50, p99)
