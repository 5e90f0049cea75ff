"""Atomic checkpoints of an FSDP2 run: model, optimizer, LR scheduler, per-rank RNG and step counter.

Layout under `root/`:
    iter_0000007/            one finished checkpoint
        dcp/                 torch.distributed.checkpoint shards (format "sharded"), or
        full.pt              rank-0 full model + optimizer state dicts (format "full")
        trainer_state.pt     scheduler state, step, world size (rank 0)
        rng_rank{r}.pt       each rank's torch (+CUDA) RNG state
        <extra name>         the caller's extra files (`save(..., extra={"loop_state.pt": obj})`, rank 0)
        <part name>/         a second trained model's dcp/ or full.pt and trainer_state.pt (`parts`: the PPO
                             critic's `critic/`), committed with the rest
    latest_checkpointed_iteration.txt   the tracker: the ONLY source of "latest"

Atomicity: everything (extras included) is written to `iter_XXXXXXX.tmp/`; only after every rank finished
does rank 0 rename it to `iter_XXXXXXX/` and then atomically replace the tracker file. A crash at any earlier
point leaves the previous checkpoint and tracker untouched. Durability (a power cut, not only a killed process):
every file is fsynced by its writer, and before the rename rank 0 fsyncs every file and directory of the `.tmp`
tree; the root is fsynced after the rename (before the tracker names it) and after the tracker's replace, so the
tracker never names a checkpoint whose bytes or directory entries are still only in the page cache. Re-saving an existing step first moves the old
directory to `iter_XXXXXXX.old/` (the loader falls back to it until the new one is in place). A save starts
by removing every stale `iter_*.tmp/` (never committed: nothing is lost) and resolving `iter_*.old/`. A failed
write (disk full: ENOSPC) removes its `.tmp` dir and raises an OSError naming the path; the previous
checkpoint stays the loadable latest.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import warnings
from typing import Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from rlbench.backends.resume import (
    apply_optim_config,
    check_dcp_shapes,
    check_model_config,
    model_config_dict,
)
from rlbench.distributed.mesh import DistEnv, barrier
from rlbench.interrupts import defer_sigint

TRACKER = "latest_checkpointed_iteration.txt"
LOW_SPACE_BYTES = 1 << 20  # a torch write failure with less free space than this is reported as a full disk


class StatePart(Protocol):
    """A trained model checkpointed beside the main one, in `<checkpoint>/<name>/` (the PPO critic): its model,
    optimizer, LR scheduler, optimizer-step count (set by `load_checkpoint`) and the metadata saved with it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    step: int

    @property
    def checkpoint_meta(self) -> dict: ...


def iter_dir(root: str, step: int) -> str:
    return os.path.join(root, f"iter_{step:07d}")


def latest_step(root: str) -> int | None:
    """The step named by the tracker file, or None when there is no finished checkpoint."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"checkpoint tracker {path!r} holds {text[:40]!r}, not a step number") from None


def committed_dir(root: str, step: int) -> str | None:
    """The directory of finished checkpoint `step`: `iter_N/`, or `iter_N.old/` while a re-save of the same step
    is being committed; None when there is neither."""
    for path in (iter_dir(root, step), iter_dir(root, step) + ".old"):
        if os.path.isdir(path):
            return path
    return None


def committed_steps(root: str) -> list[int]:
    """Steps of every finished checkpoint under `root` (ascending); `.tmp` dirs are not finished."""
    steps = set()
    for name in os.listdir(root) if os.path.isdir(root) else []:
        base = name.removesuffix(".old")
        if base.startswith("iter_") and base[5:].isdigit() and os.path.isdir(os.path.join(root, name)):
            steps.add(int(base[5:]))
    return sorted(steps)


def committed_file(root: str, step: int, name: str) -> str | None:
    """The path of file `name` inside finished checkpoint `step` (an `extra` of `save_checkpoint`); None when the
    checkpoint has no such file. Raises ValueError when there is no finished checkpoint `step`."""
    where = committed_dir(root, step)
    if where is None:
        raise ValueError(f"{root!r}: no finished checkpoint of step {step} (no iter_{step:07d}/ directory)")
    path = os.path.join(where, name)
    return path if os.path.isfile(path) else None


class CommittedCheckpoints:
    """The TrainBackend's read-only view of its checkpoint directory (`cfg.checkpoint_dir`, the layout above),
    shared by every backend that writes it: what the Trainer finds checkpoints with."""

    def checkpoint_root(self) -> str:
        """`cfg.checkpoint_dir`; a ValueError naming the field when it is not set."""
        if not self.cfg.checkpoint_dir:
            raise ValueError(f"{type(self.cfg).__name__}.checkpoint_dir is not set; set it to save or load checkpoints")
        return self.cfg.checkpoint_dir

    def latest_step(self) -> int | None:
        """The step of the latest finished checkpoint (the tracker's), None when there is none."""
        return latest_step(self.checkpoint_root())

    def committed_steps(self) -> list[int]:
        """Steps of every finished checkpoint, ascending."""
        return committed_steps(self.checkpoint_root())

    def committed_file(self, step: int, name: str) -> str | None:
        """The path of the file `save(extra={name: ...})` committed with checkpoint `step`, None when it has none."""
        return committed_file(self.checkpoint_root(), step, name)


def clean_stale(root: str) -> list[str]:
    """Remove every `iter_*.tmp/` (a save that never committed) and resolve `iter_*.old/` (kept only while it
    is the sole copy of its step: then renamed back). Returns the removed paths; nothing committed is lost."""
    removed = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        path = os.path.join(root, name)
        if not (name.startswith("iter_") and os.path.isdir(path)):
            continue
        if name.endswith(".tmp"):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        elif name.endswith(".old"):
            final = path.removesuffix(".old")
            if os.path.isdir(final):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
            else:
                os.replace(path, final)
    if removed:
        warnings.warn(f"removed {len(removed)} uncommitted checkpoint dir(s) {removed[:3]} (never committed: "
                      "nothing lost)", stacklevel=3)
    return removed


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save_synced(obj, path: str) -> None:
    """`torch.save(obj)` into `path` through an open file, flushed and fsynced before it returns.

    Through a Python file object a failed write (a full disk: ENOSPC) reaches Python as the OSError it is; a path
    given to torch.save goes through torch's C++ writer, which reports it only as `RuntimeError: [enforce fail at
    inline_container.cc]`. Raises OSError naming `path` (its errno and strerror, "No space left on device")."""
    with _as_os_error(path), open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def _as_os_error(path: str):
    """A write that failed inside the block raised as its OSError, naming `path` when the error names no file.

    torch's zip writer turns a failed `file.write` into `RuntimeError: [enforce fail at inline_container.cc]` with
    the OSError only as its context; a RuntimeError of that writer without one is diagnosed from the free space."""
    try:
        yield
    except (OSError, RuntimeError) as exc:
        cause = _os_error(exc)
        if cause is not None:
            raise OSError(cause.errno, cause.strerror or str(cause), cause.filename or path) from exc
        if "inline_container" not in str(exc):
            raise
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
        code = errno.ENOSPC if free < LOW_SPACE_BYTES else errno.EIO
        raise OSError(code, f"{os.strerror(code)} ({free} bytes free; torch: {exc})", path) from exc


class _DCPWriter(dcp.FileSystemWriter):
    """DCP's file writer (same files and defaults) whose failed writes raise their OSError: DCP gathers a rank's
    failure by pickling it, which would drop the OSError behind torch's zip-writer RuntimeError."""

    def write_data(self, plan, planner):
        with _as_os_error(os.fspath(self.path)):
            return super().write_data(plan, planner)

    def finish(self, metadata, results) -> None:
        with _as_os_error(os.fspath(self.path)):
            super().finish(metadata, results)


def fsync_path(path: str) -> None:
    """fsync one file or directory (a directory's fsync makes its entries durable: created, renamed files)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, path) from exc
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """fsync every file and directory under `root`, each directory after its entries."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fsync_path(os.path.join(dirpath, name))
        fsync_path(dirpath)


def _write_state(path: str, fmt: str, model: nn.Module, optimizer, env: DistEnv) -> None:
    if fmt == "sharded":
        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optim": osd}, storage_writer=_DCPWriter(os.path.join(path, "dcp")))
        return
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, optimizer, options=options)
    if env.is_main:
        save_synced({"model": msd, "optim": osd}, os.path.join(path, "full.pt"))


def save_checkpoint(
    root: str, step: int, model: nn.Module, optimizer, scheduler, env: DistEnv, fmt: str = "sharded",
    extra_meta: dict | None = None, extra: dict | None = None, parts: dict[str, StatePart] | None = None,
) -> str:
    """Write checkpoint `step` atomically (collective: every rank calls it). Returns its directory.

    `trainer_state.pt` also holds the model's HF config (`model_config`) and `extra_meta` (the backend
    adds the model name/overrides and its `optim_config`), which `load_checkpoint` checks (`resume.py`).

    `extra` maps file names to objects that rank 0 `torch.save`s inside the checkpoint before it is committed
    (the Trainer's loop state): they are committed, or not, together with the model and optimizer. `parts`
    (directory name -> `StatePart`) go into sub-directories of the same checkpoint, in the same format."""
    final, tmp = iter_dir(root, step), iter_dir(root, step) + ".tmp"
    for name in [*(extra or {}), *(parts or {})]:
        if os.path.basename(name) != name or name in ("dcp", "full.pt", "trainer_state.pt") or name.startswith("rng_rank"):
            raise ValueError(f"extra checkpoint file {name!r} must be a plain file name the backend does not use")
    if set(extra or {}) & set(parts or {}):
        raise ValueError(f"checkpoint names {sorted(set(extra) & set(parts))} are both an extra file and a part")
    try:
        if env.is_main:
            os.makedirs(root, exist_ok=True)
            clean_stale(root)
            os.makedirs(tmp)
        barrier(env)
        _write_state(tmp, fmt, model, optimizer, env)
        save_synced(_rng_state(), os.path.join(tmp, f"rng_rank{env.rank}.pt"))
        if env.is_main:
            _write_meta(tmp, model, scheduler, step, env, fmt, extra_meta)
            for name, obj in (extra or {}).items():
                save_synced(obj, os.path.join(tmp, name))
        for name, part in (parts or {}).items():
            sub = os.path.join(tmp, name)
            if env.is_main:
                os.makedirs(sub)
            barrier(env)
            _write_state(sub, fmt, part.model, part.optimizer, env)
            if env.is_main:
                _write_meta(sub, part.model, part.scheduler, part.step, env, fmt, part.checkpoint_meta)
        barrier(env)
        if env.is_main:
            _commit(root, tmp, final, step)
    except NotDurableError:  # committed: nothing to remove, and the error says so
        raise
    except BaseException as exc:  # DCP's CheckpointException is a BaseException wrapping each rank's error
        os_error = _os_error(exc)
        if os_error is None:
            if env.is_main and not isinstance(exc, KeyboardInterrupt):  # (an interrupted .tmp: the next save's)
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        raise _save_error(os_error, root, tmp, final, env) from exc
    barrier(env)
    return final


def _write_meta(path: str, model, scheduler, step: int, env: DistEnv, fmt: str, extra_meta: dict | None) -> None:
    meta = {"scheduler": scheduler.state_dict(), "step": step, "world_size": env.world_size, "format": fmt}
    meta |= {"model_config": model_config_dict(model)} | (extra_meta or {})
    save_synced(meta, os.path.join(path, "trainer_state.pt"))


def _os_error(exc: BaseException | None, depth: int = 0) -> OSError | None:
    """The OSError behind `exc` (itself, its cause/context, or a DCP CheckpointException's per-rank failures)."""
    if exc is None or depth > 8:
        return None
    if isinstance(exc, OSError):
        return exc
    failures = getattr(exc, "failures", None)
    for inner in [f[0] if isinstance(f, tuple) else f for f in (failures.values() if isinstance(failures, dict) else [])]:
        if isinstance(inner, BaseException) and (found := _os_error(inner, depth + 1)) is not None:
            return found
    return _os_error(exc.__cause__ or exc.__context__, depth + 1)


def _save_error(exc: OSError, root: str, tmp: str, final: str, env: DistEnv) -> OSError:
    """Remove the unfinished `.tmp` dir (frees the space) and name the path in the error (disk full...)."""
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    where = exc.filename or tmp
    prev = latest_step(root) if os.path.isfile(os.path.join(root, TRACKER)) else None
    kept = f"step {prev} ({committed_dir(root, prev)})" if prev is not None else "none"
    fix = "; free space on that disk or save elsewhere (--save DIR)" if exc.errno == errno.ENOSPC else ""
    return OSError(exc.errno or errno.EIO, f"saving checkpoint {final!r} failed writing {where!r}: "
                   f"{exc.strerror or exc}; nothing was committed, the previous checkpoint ({kept}) stays the latest"
                   + fix, where)


def _commit(root: str, tmp: str, final: str, step: int) -> None:
    """Make tmp durable, rename tmp -> final, then point the tracker at it (each an atomic filesystem operation).

    An existing `final` (a re-save of the same step) is renamed to `final.old` first, never deleted before the
    new one is in place: at every instant the tracker's step has a finished directory (`committed_dir`). Each
    step is fsynced before the next one depends on it (module docstring: durability). A failure before the tracker
    names the new directory undoes the rename (the caller removes tmp): nothing is committed. A failure of the
    last fsync, once the tracker names it, raises `NotDurableError`: committed, durability unknown."""
    fsync_tree(tmp)  # every rank's files (one host) and every directory entry, before anything names them
    old = final + ".old"
    resave = os.path.isdir(final)
    with defer_sigint():  # published and named, or (undone) neither
        if resave:
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        try:
            fsync_path(root)  # the rename, before the tracker names it
            _write_tracker(root, step)
        except BaseException:
            os.replace(final, tmp)
            if resave:
                os.replace(old, final)
            raise
    shutil.rmtree(old, ignore_errors=True)
    try:
        fsync_path(root)  # the tracker's new entry
    except OSError as exc:
        raise NotDurableError(exc.errno, f"checkpoint {final!r} was committed (the tracker names step {step}), but "
                              f"fsync of {root!r} failed: {exc.strerror}; it may not survive a power cut, save "
                              "again once the disk is healthy", root) from exc


def _write_tracker(root: str, step: int) -> None:
    """Atomically replace the tracker file with `step` (written and fsynced under a temporary name first)."""
    tracker_tmp = os.path.join(root, TRACKER + ".tmp")
    try:
        with open(tracker_tmp, "w") as f:
            f.write(str(step))
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        os.remove(tracker_tmp)
        raise OSError(exc.errno, exc.strerror, tracker_tmp) from exc
    os.replace(tracker_tmp, os.path.join(root, TRACKER))


class NotDurableError(OSError):
    """A checkpoint was committed (the tracker names it), but fsyncing its root directory failed afterwards."""


def commit(root: str, tmp: str, final: str, step: int) -> None:
    """Publish a fully written `tmp` checkpoint as step `step` (`_commit`; other backends' saves use it)."""
    _commit(root, tmp, final, step)


def load_checkpoint(
    root: str, model: nn.Module, optimizer, scheduler, env: DistEnv, step: int | None = None, optim_cfg=None,
    parts: dict[str, tuple[StatePart, Any]] | None = None,
) -> int:
    """Restore model, optimizer, scheduler and RNG from `step` (default: the tracker). Returns the step.

    A model that differs from the checkpoint's raises `ResumeError` naming the fields before anything is
    read into the model; with `optim_cfg` the new optimizer hyper-parameters win (`resume.apply_optim_config`).
    `parts` (name -> (`StatePart`, its optim config or None)) are restored from their sub-directories, each
    part's `step` set to the saved one; a checkpoint without one of them raises ValueError before any read."""
    step = latest_step(root) if step is None else step
    path = committed_dir(root, step) if step is not None else None
    if path is None:
        raise ValueError(f"no finished checkpoint {step} under {root!r}; save one first or pass a valid step")
    for name in parts or {}:
        if not os.path.isdir(os.path.join(path, name)):
            raise ValueError(f"checkpoint {path!r} has no {name}/ (saved by a run without it); resume it with the "
                             f"run's own config, or start the {name} fresh in a new run (no --load)")
    main_step = _load_state(path, model, optimizer, scheduler, env, optim_cfg)
    for name, (part, part_optim) in (parts or {}).items():
        part.step = _load_state(os.path.join(path, name), part.model, part.optimizer, part.scheduler, env, part_optim)
    rng_file = os.path.join(path, f"rng_rank{env.rank}.pt")
    if os.path.isfile(rng_file):  # absent when resuming on a larger world
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return main_step


def _load_state(path: str, model: nn.Module, optimizer, scheduler, env: DistEnv, optim_cfg) -> int:
    """Model, optimizer and scheduler from one checkpoint directory (the main one or a part's); its step."""
    meta = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
    check_model_config(meta, model, path)
    if meta["format"] == "sharded":
        msd, osd = get_state_dict(model, optimizer)
        check_dcp_shapes(os.path.join(path, "dcp"), msd, path)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=os.path.join(path, "dcp"))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        _load_full(path, model, optimizer, env)
    scheduler.load_state_dict(meta["scheduler"])
    if optim_cfg is not None:
        apply_optim_config(optimizer, scheduler, meta.get("optim_config"), optim_cfg, path=path, announce=env.is_main)
    return meta["step"]


def _load_full(path: str, model: nn.Module, optimizer, env: DistEnv) -> None:
    # Every rank reads the full file (CPU memory) and keeps its shards; simple and collective-free.
    # (broadcast_from_rank0 for optimizer state issues rank-dependent collectives in some torch versions.)
    full = torch.load(os.path.join(path, "full.pt"), weights_only=False, map_location="cpu")
    options = StateDictOptions(full_state_dict=True)
    set_state_dict(model, optimizer, model_state_dict=full["model"], optim_state_dict=full["optim"], options=options)
    barrier(env)
