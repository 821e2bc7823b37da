"""Stand-ins shared by the exchange and handshake tests: an in-memory store like JAX's and
torch's (write-once keys, blocking reads), and processes run as threads."""

import threading


class FakeStore:
    """Write-once key-value store with blocking reads, like JAX's and torch's stores."""

    def __init__(self):
        self.data, self.cond, self.keys_written, self.barriers = {}, threading.Condition(), [], {}

    def channel(self, timeout_s):
        return _Chan(self, timeout_s)


class _Chan:
    def __init__(self, store, timeout_s):
        self.store, self.timeout_s = store, timeout_s

    def publish(self, key, value):
        with self.store.cond:
            assert key not in self.store.data, f"key {key} written twice"
            self.store.data[key] = value
            self.store.keys_written.append(key)
            self.store.cond.notify_all()

    def fetch(self, key, who):
        with self.store.cond:
            if not self.store.cond.wait_for(lambda: key in self.store.data, self.timeout_s):
                raise TimeoutError(f"{who} did not publish within {self.timeout_s} s")
            return self.store.data[key]

    def barrier(self, key, processes):
        with self.store.cond:
            arrived = self.store.barriers.setdefault(key, set())
            arrived.add(threading.current_thread().name)
            self.store.cond.notify_all()
            if not self.store.cond.wait_for(lambda: len(arrived) == len(processes), self.timeout_s):
                raise TimeoutError(f"barrier {key}: {len(arrived)}/{len(processes)} arrived")


def run_in_threads(fn, processes, join_s):
    """``fn(p)`` in one thread per process ``p`` (named ``p<p>``), each joined for ``join_s``:
    ({p: what fn returned}, {p: what it raised})."""
    out, errors = {}, {}

    def run(p):
        try:
            out[p] = fn(p)
        except Exception as e:  # noqa: BLE001 - recorded for the assertions
            errors[p] = e

    threads = [threading.Thread(target=run, args=(p,), name=f"p{p}") for p in processes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
    return out, errors
