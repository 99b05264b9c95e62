"""Four processes, eight threads each, admitting calls against one KV pool in Redis.

    python examples/shared_ledger.py --redis redis://127.0.0.1:6379/0 [--capacity 2000] [--seconds 8]

Each process is what one `uvicorn --workers 4` worker would be: its own RedisLedger on the same pool. Prints each
process's admissions and the pool's own high-water mark, which never passes the capacity (docs/scaling.md).
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import threading
import time

import contextkeeper as ck


def worker(url: str, pool: str, capacity: int, seconds: float, seed: int, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    ledger = ck.calls.RedisLedger(url, capacity, pool=pool)
    counts = {"admitted": 0, "timeouts": 0}
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def calls(index: int) -> None:
        rng = random.Random(seed * 100 + index)
        while time.monotonic() < end:
            try:
                with ledger.admit(rng.randint(50, 400), timeout=5):  # a call's prompt + max_tokens
                    time.sleep(rng.uniform(0.001, 0.02))  # the server generating
                key = "admitted"
            except ck.calls.AdmissionTimeout:
                key = "timeouts"
            with lock:
                counts[key] += 1

    threads = [threading.Thread(target=calls, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out.put((seed, counts))
    ledger.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis", required=True)
    parser.add_argument("--capacity", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    pool = f"example-{time.time_ns()}"
    watcher = ck.calls.RedisLedger(args.redis, args.capacity, pool=pool)
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    processes = [
        context.Process(target=worker, args=(args.redis, pool, args.capacity, args.seconds, seed, out))
        for seed in range(4)
    ]
    for process in processes:
        process.start()
    highest = 0
    while any(process.is_alive() for process in processes):
        highest = max(highest, watcher.stats()["active"])
        time.sleep(0.01)
    for seed, counts in sorted(out.get() for _ in processes):
        print(f"process {seed}: {counts['admitted']:,} calls admitted, {counts['timeouts']} timed out")
    stats = watcher.stats()
    print(
        f"pool {pool!r}: capacity {stats['capacity']:,} tokens; highest active seen {highest:,}; "
        f"the pool's own peak {stats['peak']:,}; active now {stats['active']}"
    )
    watcher.close()


if __name__ == "__main__":
    main()
