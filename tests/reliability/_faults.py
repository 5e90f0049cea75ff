"""Shared helpers of the fault-injection tests: a tiny CPU run whose weights move, and exact state snapshots."""

from __future__ import annotations

import contextlib
import dataclasses as dc
import errno
import io
import json
import os
import resource
import signal
import threading
import time
from unittest import mock

import torch

from rlbench import presets


def text_reward(response: str, label) -> float:
    """A reward that depends on the text (the tiny random model never solves the task): the weights move."""
    return (sum(map(ord, response)) % 7) / 7.0


def tiny_config(workdir: str, *, save_dir: str | None = None, save_interval: int | None = None, ref: bool = False,
                eval_interval: int | None = None, critic: bool = False):
    """The `tiny` preset, float32 on CPU: 2 prompts x 4 samples, 2 optimizer steps per rollout, 2+ micro-batches
    each (a small token budget), weights synced in several buckets."""
    cfg = presets.cpu_test(model="tiny", workdir=workdir, level=1, n_eval=8)
    os.makedirs(workdir, exist_ok=True)
    data = os.path.join(workdir, "prompts.jsonl")  # no task: its rows would name their own reward ("math")
    with open(data, "w") as f:
        f.writelines(json.dumps({"prompt": f"{i}+{i % 3}=?", "label": str(i + i % 3)}) + "\n" for i in range(12))
    # with a critic the reference is read (KL-in-reward) and must stay the starting model: checkpoints do not hold
    # the reference, so a resume after an update_ref would compare against another one
    backend = dc.replace(cfg.backend, ref_model="tiny" if ref else None,
                         ref_update_interval=1 if ref and not critic else None)
    return cfg.replace(
        task=None,
        data=dc.replace(cfg.data, path=data),
        rollout=dc.replace(cfg.rollout, rollout_batch_size=2, n_samples_per_prompt=4, max_response_len=6,
                           rm_type="reliability._faults:text_reward"),
        batch=dc.replace(cfg.batch, global_batch_size=4, max_tokens_per_gpu=48, num_rollout=100),
        backend=backend,
        weights=dc.replace(cfg.weights, bucket_bytes=64 << 10),
        eval=dc.replace(cfg.eval, interval=eval_interval, data_path=data, max_prompts=2, n_samples_per_prompt=2,
                        pass_k=(1, 2)),
        checkpoint=dc.replace(cfg.checkpoint, save_dir=save_dir, save_interval=save_interval),
        # PPO with a critic (the critic trains first, then the actor; KL-in-reward when there is a reference)
        loss=dc.replace(cfg.loss, advantage_estimator="gae", normalize_advantages=True, lambd=0.95,
                        **(dict(kl_coef=0.05, kl_ctl_type="adaptive", kl_target=1e-3, kl_horizon=100.0) if ref
                           else {})) if critic else cfg.loss,
    )


def comparable(history: list[dict]) -> list[dict]:
    """Metrics without timings (everything else must match bit for bit)."""
    return [{k: v for k, v in h.items() if not k.startswith(("perf/", "memory/"))} for h in history]


def state(trainer) -> dict:
    """Everything that must match bitwise: parameters, AdamW state, scheduler, engine weights, loop counters."""
    b = trainer.backend
    params = {n: p.full_tensor().clone() if hasattr(p, "full_tensor") else p.detach().clone()
              for n, p in b.model.named_parameters()}
    opt = [v.full_tensor().clone() if hasattr(v, "full_tensor") else (v.clone() if torch.is_tensor(v) else v)
           for s in b.optimizer.state.values() for _, v in sorted(s.items())]
    engine = {n: t.detach().clone() for n, t in trainer.engine.model.named_parameters()}
    sched = b.scheduler.state_dict()
    critic = getattr(b, "critic", None)
    if critic is not None:  # PPO: the critic's weights, AdamW state and schedule too
        params |= {f"critic.{n}": p.full_tensor().clone() for n, p in critic.model.named_parameters()}
        opt += [v.full_tensor().clone() if hasattr(v, "full_tensor") else (v.clone() if torch.is_tensor(v) else v)
                for s in critic.optimizer.state.values() for _, v in sorted(s.items())]
        sched = {"actor": sched, "critic": critic.scheduler.state_dict(), "critic_step": critic.step}
    if getattr(trainer, "kl_ctl", None) is not None:  # KL-in-reward's β, the loop's state
        sched = {"sched": sched, "kl_ctl": trainer.kl_ctl.state_dict()}
    return {"params": params, "opt": opt, "sched": sched, "engine": engine,
            "counters": (trainer.rollout_id, trainer.policy_version, trainer.version, trainer.engine.weight_version,
                         b.step),
            "data": trainer.dataset.state_dict(), "rollouts": trainer.rollouts.state_dict(),
            "history": comparable(trainer.history), "evals": comparable(trainer.eval_history)}


def assert_same(a: dict, b: dict) -> None:
    assert a["counters"] == b["counters"]
    assert a["data"] == b["data"] and a["rollouts"] == b["rollouts"] and a["sched"] == b["sched"]
    assert a["history"] == b["history"] and a["evals"] == b["evals"]  # exact floats
    for key in ("params", "engine"):
        assert a[key].keys() == b[key].keys()
        bad = [n for n in a[key] if not torch.equal(a[key][n], b[key][n])]
        assert not bad, f"{key} differ: {bad[:5]}"
    assert len(a["opt"]) == len(b["opt"])
    assert all(torch.equal(x, y) if torch.is_tensor(x) else x == y for x, y in zip(a["opt"], b["opt"]))


class FullDisk:
    """Wraps an open binary file as a disk that fills up: the next write stores only half of its bytes (a short
    write, as write(2) does at the last free block), every write after it raises ENOSPC; `free()` makes space."""

    def __init__(self, f) -> None:
        self.f, self.full, self.room = f, True, True

    def write(self, data) -> int:
        if self.full and not self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        if self.full:
            self.room = False
            return self.f.write(bytes(data)[: max(1, len(data) // 2)])
        return self.f.write(data)

    def free(self) -> None:
        self.full = False

    def __getattr__(self, name):
        return getattr(self.f, name)


@contextlib.contextmanager
def write_faults(root: str, fail_at: int | None = None):
    """Files opened for writing under `root` through `open` / `io.open` (what torch.save through a file object,
    DCP and the checkpoint code use) count their write calls; the `fail_at`-th one overall raises ENOSPC, as
    write(2) does on a full disk (None: only count). Yields `{"writes": n, "files": paths opened for writing}`."""
    real_open, root = io.open, os.path.abspath(root) + os.sep
    seen = {"writes": 0, "files": set()}

    class Faulty:
        def __init__(self, f) -> None:
            self.f = f

        def write(self, data):
            seen["writes"] += 1
            if seen["writes"] == fail_at:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.f.close()

        def __getattr__(self, name):
            return getattr(self.f, name)

    def faulty_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        path = os.path.abspath(os.fspath(file)) if isinstance(file, (str, os.PathLike)) else ""
        if path.startswith(root) and any(c in mode for c in "wax+"):
            seen["files"].add(path)
            return Faulty(f)
        return f

    with mock.patch("builtins.open", faulty_open), mock.patch("io.open", faulty_open):
        yield seen


@contextlib.contextmanager
def durability_log():
    """Records, in order, `("fsync", path)` (the fd's path at the call) and `("rename", src, dst)` (os.replace and
    os.rename, which pathlib uses) made inside the block: what a power cut could lose is what no fsync covered."""
    events: list[tuple] = []
    real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def renamer(real):
        def rename(src, dst, *args, **kwargs):
            out = real(src, dst, *args, **kwargs)
            events.append(("rename", os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))))
            return out
        return rename

    with mock.patch("os.fsync", fsync), mock.patch("os.replace", renamer(real_replace)), \
            mock.patch("os.rename", renamer(real_rename)):
        yield events


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """A real write failure from the kernel: RLIMIT_FSIZE makes every write(2) past `nbytes` of a file fail (EFBIG;
    SIGXFSZ ignored), in C++ writers as in Python ones, as a full disk makes them fail with ENOSPC."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def hang_if_flagged(response: str, label) -> float:
    """`text_reward`, except that while the file `$RLBENCH_TEST_HANG` exists a call hangs (10 minutes), after
    creating `$RLBENCH_TEST_HANG.started`; importable by name in reward worker processes."""
    flag = os.environ["RLBENCH_TEST_HANG"]
    if os.path.exists(flag):
        open(flag + ".started", "w").close()
        time.sleep(600)
    return text_reward(response, label)


@contextlib.contextmanager
def sigint_when(ready, timeout: float = 60.0):
    """Send SIGINT to the main thread (a real Ctrl-C) once `ready()` is true, from a helper thread; Python's own
    handler is installed for the block (a background CI shell may start the process with SIGINT ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    main, stop = threading.main_thread().ident, threading.Event()

    def watch():
        deadline = time.monotonic() + timeout
        while not stop.is_set() and time.monotonic() < deadline:
            if ready():
                signal.pthread_kill(main, signal.SIGINT)
                return
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        signal.signal(signal.SIGINT, previous)
