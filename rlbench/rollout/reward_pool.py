"""Rewards scored in worker processes while the engine is still generating.

Every sample of a GRPO step goes through a Python reward (`rlbench.rewards`; math_verify costs milliseconds per
call). Scored inline after generation, that is time the GPU idles through, and it grows with the batch.
`RewardPool` keeps worker processes that score each sample as soon as the engine reports it finished
(`generate(..., on_finish=)`), so the rollout waits only for the samples still being scored when generation ends,
and those are spread over the workers.

The workers are fresh interpreters (`python -m rlbench.rollout.reward_pool`), not forks: the trainer holds CUDA,
threads and tens of GiB, and a fork or a multiprocessing spawn would re-run an unguarded user script. Processes,
not threads: a Python reward in a thread holds the GIL that the decode loop needs between graph launches.
A reward must therefore be importable by name in a worker: the built-in names and "module:function" specs are
(`poolable`); anything else (a reward registered at run time, `__main__:fn`) is scored inline by the caller.

Wire format, both directions: 8-byte little-endian length, then a pickle. Jobs `(job_id, records, timeout)` on the
worker's stdin, records `(response, label, rm_type, prompt, index)`; replies `(job_id, ok, rewards | message)` on a
dedicated pipe (the worker's stdout stays the user's: a reward that prints cannot corrupt the replies).
"""

from __future__ import annotations

import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
from concurrent.futures import Future

from rlbench.configs.rollout import REWARD_NAMES
from rlbench.rewards import RewardError

Record = tuple  # (response, label, rm_type, prompt, index)

_HEADER = struct.Struct("<Q")


def poolable(rm_type) -> bool:
    """Whether a worker process can resolve `rm_type` by itself: a built-in reward name or an importable
    "module:function" (not `__main__`, which is another module in the worker)."""
    if not isinstance(rm_type, str):
        return False
    if rm_type in REWARD_NAMES:
        return True
    module, sep, attr = rm_type.partition(":")
    return bool(sep and module and attr and module != "__main__")


def default_workers(device: str) -> int:
    """Worker processes for `RolloutConfig.reward_workers=None`: half the cores, at most 8, on a GPU run (the CPU
    is otherwise idle during generation); none on a CPU run (the engine and trainer use the cores)."""
    if device != "cuda":
        return 0
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def _write(fd: int, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            return None  # the other side closed
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read(fd: int):
    head = _read_exact(fd, _HEADER.size)
    if head is None:
        raise EOFError
    body = _read_exact(fd, _HEADER.unpack(head)[0])
    if body is None:
        raise EOFError
    return pickle.loads(body)


class _Worker:
    """One worker process, the jobs it has in flight, and the thread that reads its replies."""

    def __init__(self, rank: int, on_dead) -> None:
        reply_r, reply_w = os.pipe()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen([sys.executable, "-m", "rlbench.rollout.reward_pool", str(reply_w)],
                                     stdin=subprocess.PIPE, pass_fds=(reply_w,), env=env)
        os.close(reply_w)
        self.rank, self.reply_fd, self.on_dead = rank, reply_r, on_dead
        self.inflight: dict[int, Future] = {}
        self.lock = threading.Lock()
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()  # written by a thread: a full pipe never blocks the caller
        for target, name in ((self._write_jobs, "writer"), (self._read_replies, "reader")):
            threading.Thread(target=target, name=f"reward-worker-{rank}-{name}", daemon=True).start()

    def send(self, job_id: int, records: list[Record], timeout: float | None, future: Future) -> None:
        with self.lock:
            self.inflight[job_id] = future
        self.jobs.put((job_id, records, timeout))

    def _write_jobs(self) -> None:
        while (job := self.jobs.get()) is not None:
            try:
                _write(self.proc.stdin.fileno(), job)
            except (OSError, ValueError):  # the worker is gone (or closed): its reader fails the futures
                return
        try:
            self.proc.stdin.close()  # EOF: the worker exits
        except OSError:
            pass

    def _read_replies(self) -> None:
        try:
            while True:
                job_id, ok, value = _read(self.reply_fd)
                with self.lock:
                    future = self.inflight.pop(job_id)
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(RewardError(value))
        except (EOFError, OSError):
            pass
        os.close(self.reply_fd)
        code = self.proc.wait()
        with self.lock:
            lost, self.inflight = list(self.inflight.values()), {}
        for future in lost:
            future.set_exception(RuntimeError(
                f"reward worker {self.rank} (pid {self.proc.pid}) exited with code {code} while scoring; its output "
                "above says why. Set rollout.reward_workers=0 (--reward-workers 0) to score in this process"))
        self.on_dead(self)

    def kill(self) -> None:
        """Stop the worker now; its reader thread fails the jobs in flight, naming it."""
        self.proc.kill()
        self.jobs.put(None)  # ends the writer thread

    def close(self, timeout: float = 10.0) -> None:
        """Let the worker finish its queued jobs and exit; kill it if it is still busy after `timeout` seconds
        (a reward without a time limit can hang)."""
        self.jobs.put(None)  # after the queued jobs: the writer closes stdin, the worker exits
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class RewardPool:
    """`workers` reward processes, started here (they import in the background while the model loads).
    Thread-safe; `close()` (or the end of this process, which closes their input) stops them."""

    def __init__(self, workers: int, timeout: float | None = None) -> None:
        if workers < 1:
            raise ValueError(f"RewardPool needs at least 1 worker, got {workers}")
        self.num_workers, self.timeout = workers, timeout
        self._lock = threading.Lock()
        self._next_job = 0
        self._dead: list[str] = []
        self._workers = [_Worker(rank, self._worker_died) for rank in range(workers)]

    def submit(self, records: list[Record]) -> Future:
        """Score `records` in one worker (the one with the fewest jobs in flight); the future's result is one
        reward per record, or `RewardError` naming the sample, as `score_batch` raises it."""
        future: Future = Future()
        with self._lock:
            if self._dead:
                raise RuntimeError(self._dead[0])
            if not self._workers:
                raise RuntimeError("the reward pool is closed")
            worker = min(self._workers, key=lambda w: len(w.inflight))
            job_id, self._next_job = self._next_job, self._next_job + 1
        worker.send(job_id, records, self.timeout, future)
        return future

    def map(self, records: list[Record]) -> list[float]:
        """Score `records` spread over every worker and wait: one reward per record, in order."""
        if not records:
            return []
        k = min(self.num_workers, len(records))
        chunks = [records[i::k] for i in range(k)]
        futures = [self.submit(chunk) for chunk in chunks]
        out: list[float] = [0.0] * len(records)
        for i, future in enumerate(futures):
            out[i::k] = future.result()
        return out

    def restart_busy(self) -> int:
        """Replace every worker with jobs in flight by a fresh process; those jobs' futures fail naming the worker.

        For a caller that stopped waiting (a rollout interrupted by Ctrl-C): a worker stuck in a hung reward
        would otherwise hold every later job until its `timeout` (forever without one). Returns how many."""
        with self._lock:
            busy = [w for w in self._workers if w.inflight]
            for w in busy:
                self._workers[self._workers.index(w)] = _Worker(w.rank, self._worker_died)
        for w in busy:
            w.kill()  # no longer in `_workers`: its exit is not a dead-pool error
        return len(busy)

    def _worker_died(self, worker: _Worker) -> None:
        with self._lock:
            if worker in self._workers:
                self._workers.remove(worker)
                self._dead.append(f"reward worker {worker.rank} exited with code {worker.proc.returncode}; "
                                  "set rollout.reward_workers=0 (--reward-workers 0) to score in this process")

    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers once their queued jobs are scored; one still busy after `timeout` seconds is killed
        (its jobs fail with an error naming it)."""
        with self._lock:
            workers, self._workers = self._workers, []
        for worker in workers:
            worker.close(timeout)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _serve(reply_fd: int) -> None:
    """The worker loop: score jobs from stdin until EOF."""
    from rlbench.rewards import score_batch
    from rlbench.types import Sample

    stdin = sys.stdin.buffer.fileno()
    while True:
        try:
            job_id, records, timeout = _read(stdin)
        except EOFError:
            return
        samples = [Sample(tokens=[], response_length=0, response=response, label=label, prompt=prompt,
                          metadata={"rm_type": rm_type}) for response, label, rm_type, prompt, _ in records]
        try:
            rewards = score_batch(samples, rm_type=records[0][2] if records else "math", timeout=timeout,
                                  indices=[r[4] for r in records])
            reply = (job_id, True, rewards)
        except RewardError as err:
            reply = (job_id, False, str(err))
        except Exception as err:  # anything else in the scoring machinery: reported, not swallowed
            reply = (job_id, False, f"{type(err).__name__}: {err}")
        _write(reply_fd, reply)


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
