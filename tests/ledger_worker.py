"""A process admitting calls against a shared Redis ledger, for tests/calls/test_redis_ledger.py.

    python tests/ledger_worker.py churn URL POOL CAPACITY --seconds S --threads N --seed K [--lease L]
                                  [--hold MIN,MAX] [--odd]     # admit and release for S seconds
    python tests/ledger_worker.py hold URL POOL CAPACITY --tokens T --lease L      # hold T tokens until killed

``churn`` prints one JSON line at the end: the calls admitted, timed out (AdmissionTimeout), refused because Redis
was unreachable (LedgerUnavailable), failed otherwise (errors, with the first few), threads that did not finish
(hung), and wall-clock times: the first and last LedgerUnavailable, and each thread's first admission after one
(``recoveries``). Its calls ask for even token counts; with ``--odd`` for odd ones, so a test can tell this
process's tickets apart in Redis. ``hold`` prints "held" once the tokens are held.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from typing import Any

from contextkeeper.calls.ledger import AdmissionTimeout
from contextkeeper.calls.redis_ledger import LedgerUnavailable, RedisLedger


def churn(ledger: RedisLedger, seconds: float, threads: int, seed: int, hold: tuple[float, float], odd: bool) -> Any:
    counts: dict[str, Any] = {"admitted": 0, "timeouts": 0, "unavailable": 0, "errors": 0}
    failures: list[str] = []
    unavailable: list[float] = []
    recoveries: list[float] = []
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def run(index: int) -> None:
        rng = random.Random(seed * 100 + index)
        cut_off = False  # this thread saw Redis unreachable and has not been admitted since
        while time.monotonic() < end:
            try:
                with ledger.admit(rng.randint(25, 200) * 2 + odd, timeout=5):
                    time.sleep(rng.uniform(*hold))
                key = "admitted"
            except AdmissionTimeout:
                key = "timeouts"
            except LedgerUnavailable:
                key = "unavailable"
            except Exception as error:  # every other failure is a test failure
                key = "errors"
                with lock:
                    failures.append(repr(error)[:300])
            now = time.time()
            with lock:
                counts[key] += 1
                if key == "unavailable":
                    unavailable.append(now)
                elif key == "admitted" and cut_off:
                    recoveries.append(now)
            if key == "unavailable":
                cut_off = True
                time.sleep(0.05)  # as an app would: do not spin on a server that is down
            elif key == "admitted":
                cut_off = False

    workers = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=max(0.0, end - time.monotonic()) + 30)
    counts["hung"] = sum(worker.is_alive() for worker in workers)
    counts["failures"] = failures[:5]
    counts["unavailable_first"] = min(unavailable, default=None)
    counts["unavailable_last"] = max(unavailable, default=None)
    counts["recoveries"] = sorted(recoveries)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("churn", "hold"))
    parser.add_argument("url")
    parser.add_argument("pool")
    parser.add_argument("capacity", type=int)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lease", type=float, default=5.0)
    parser.add_argument("--hold", default="0.001,0.02", help="MIN,MAX seconds each admitted call holds its tokens")
    parser.add_argument("--odd", action="store_true")
    parser.add_argument("--tokens", type=int, default=0)
    options = parser.parse_args()
    ledger = RedisLedger(options.url, options.capacity, pool=options.pool, lease=options.lease)
    if options.mode == "hold":
        ledger.acquire(options.tokens)
        print("held", flush=True)
        time.sleep(600)  # until killed
        return
    low, high = (float(x) for x in options.hold.split(","))
    counts = churn(ledger, options.seconds, options.threads, options.seed, (low, high), options.odd)
    print(json.dumps(counts), flush=True)
    ledger.close()


if __name__ == "__main__":
    main()
