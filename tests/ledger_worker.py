"""A process admitting calls against a shared Redis ledger, for tests/test_redis_ledger.py.

    python tests/ledger_worker.py URL POOL CAPACITY SECONDS THREADS SEED     # admit and release for SECONDS
    python tests/ledger_worker.py URL POOL CAPACITY hold TOKENS LEASE         # hold TOKENS until killed

Prints one JSON line at the end (admitted, timeouts, errors), or "held" once the tokens are held.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time

from contextkeeper.ledger import AdmissionTimeout
from contextkeeper.redis_ledger import RedisLedger


def churn(ledger: RedisLedger, seconds: float, threads: int, seed: int) -> dict[str, int]:
    counts = {"admitted": 0, "timeouts": 0, "errors": 0}
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def run(index: int) -> None:
        rng = random.Random(seed * 100 + index)
        while time.monotonic() < end:
            try:
                with ledger.admit(rng.randint(50, 400), timeout=5):
                    time.sleep(rng.uniform(0.001, 0.02))
                key = "admitted"
            except AdmissionTimeout:
                key = "timeouts"
            except Exception:  # every other failure is a test failure
                key = "errors"
            with lock:
                counts[key] += 1

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return counts


def main() -> None:
    url, pool, capacity = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if sys.argv[4] == "hold":
        ledger = RedisLedger(url, capacity, pool=pool, lease=float(sys.argv[6]))
        ledger.acquire(int(sys.argv[5]))
        print("held", flush=True)
        time.sleep(600)  # until killed
        return
    ledger = RedisLedger(url, capacity, pool=pool, lease=5.0)
    print(json.dumps(churn(ledger, float(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))), flush=True)
    ledger.close()


if __name__ == "__main__":
    main()
