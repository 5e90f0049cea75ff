"""Flat, namespaced metric dicts and the sinks that record them.

Every metric is one `str -> float` entry whose key names its namespace, as in slime:
`rollout/raw_reward`, `train/pg_loss`, `perf/step_time`, `eval/pass@1`. A step's metrics are one flat
dict; sinks (console, jsonl, tensorboard, wandb) receive that dict and a step number. The optional
sinks import their packages only when built, with a clear error when the package is missing.

    logger = MetricsLogger(build_sinks(LoggingConfig(jsonl_path="runs/x/metrics.jsonl")))
    logger.log({"rollout/raw_reward": 0.4, "perf/step_time": 1.2}, step=3)
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Iterable, Sequence
from typing import Protocol

from rlbench.configs import LoggingConfig
from rlbench.progress import echo

# Keys the console sink prints (when present), in this order, with short labels.
CONSOLE_KEYS: tuple[tuple[str, str], ...] = (
    ("rollout/raw_reward", "reward"),
    ("eval/reward", "eval"),
    ("eval/pass@1", "pass@1"),
    ("rollout/response_len/mean", "len"),
    ("rollout/truncated_ratio", "trunc"),
    ("train/loss", "loss"),
    ("train/ppo_kl", "ppo_kl"),
    ("train/kl_loss", "kl"),
    ("train/entropy", "ent"),
    ("train/grad_norm", "gnorm"),
    ("train/skipped", "skipped"),  # printed only when non-zero (a step whose loss or grad norm was not finite)
    ("perf/rollout_time", "t_roll"),
    ("perf/log_probs_time", "t_logp"),
    ("perf/train_time", "t_train"),
    ("perf/update_weights_time", "t_sync"),
    ("perf/offload_time", "t_offload"),
    ("perf/step_time", "t_step"),
)


class Sink(Protocol):
    """Receives one flat metric dict per step."""

    def write(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class ConsoleSink:
    """One short line per step: `step 3 | reward 0.41 | eval 0.52 | loss -0.003 | t_step 4.1s`."""

    def __init__(self, extra_keys: Sequence[str] = (), printer=echo) -> None:
        self.keys = list(CONSOLE_KEYS) + [(k, k) for k in extra_keys]
        self.printer = printer  # default: above an open progress bar (`rlbench.progress.echo`), flushed

    def write(self, metrics: dict[str, float], step: int) -> None:
        self.printer(format_line(metrics, step, self.keys))

    def close(self) -> None:
        pass


def format_line(metrics: dict[str, float], step: int, keys: Sequence[tuple[str, str]] = CONSOLE_KEYS) -> str:
    """The console line for one step (only keys present in `metrics`)."""
    parts = [f"step {step}"]
    for key, label in keys:
        if key in metrics:
            value = metrics[key]
            if key == "train/skipped" and not value:
                continue
            unit = "s" if key.endswith("_time") else ""
            parts.append(f"{label} {value:.4g}{unit}")
    return " | ".join(parts)


class JsonlSink:
    """Appends `{"step": s, **metrics}` as one line per step, written straight to the file (unbuffered).

    A write that fails (a full disk: a short write, then ENOSPC) is cut back to the file's previous end, so the
    file never holds a partial line and writing the same line again later (`MetricsLogger`) adds it once."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.file = open(path, "ab", buffering=0)  # noqa: SIM115 -- closed by close()
        except OSError as exc:
            raise OSError(exc.errno, f"cannot open the metrics file {self.path!r}: {exc.strerror}; "
                          "choose another logging.jsonl_path or free the disk") from exc

    def write(self, metrics: dict[str, float], step: int) -> None:
        line = memoryview((json.dumps({"step": step, **metrics}) + "\n").encode())
        end = os.fstat(self.file.fileno()).st_size
        try:
            while line:
                line = line[self.file.write(line):]
        except OSError as exc:
            os.ftruncate(self.file.fileno(), end)  # no partial line (shrinking a file needs no space)
            raise OSError(exc.errno, f"cannot append step {step} to the metrics file {self.path!r}: {exc.strerror}; "
                          "free disk space or choose another logging.jsonl_path") from exc

    def close(self) -> None:
        self.file.close()


class TensorboardSink:
    """TensorBoard scalars, one per key (import of `torch.utils.tensorboard` happens here, lazily)."""

    def __init__(self, log_dir: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(
                "tensorboard_dir is set but the `tensorboard` package is missing; "
                "`pip install tensorboard` or set tensorboard_dir=None"
            ) from exc
        self.writer = SummaryWriter(log_dir)

    def write(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Weights & Biases logging (`wandb` imported lazily; `train/step` is the step key, as in slime)."""

    def __init__(self, project: str, run_name: str | None = None, config: dict | None = None) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ImportError(
                "wandb_project is set but the `wandb` package is missing; `pip install wandb` or unset it"
            ) from exc
        self.run = wandb.init(project=project, name=run_name, config=config)

    def write(self, metrics: dict[str, float], step: int) -> None:
        self.run.log({"train/step": step, **metrics}, step=step)

    def close(self) -> None:
        self.run.finish()


def build_sinks(cfg: LoggingConfig, run_config: dict | None = None) -> list[Sink]:
    """The sinks a `LoggingConfig` asks for (optional packages are imported only when asked for)."""
    sinks: list[Sink] = []
    if cfg.console:
        sinks.append(ConsoleSink(cfg.console_keys))
    if cfg.jsonl_path:
        sinks.append(JsonlSink(cfg.jsonl_path))
    if cfg.tensorboard_dir:
        sinks.append(TensorboardSink(cfg.tensorboard_dir))
    if cfg.wandb_project:
        sinks.append(WandbSink(cfg.wandb_project, cfg.wandb_run_name, run_config))
    return sinks


class MetricsLogger:
    """Fans one flat metric dict out to every sink; checks keys are namespaced.

    A sink whose write fails (a full disk) keeps that line and every later one pending: the next `log()` (or
    `close()`) writes them first, in order, so once the fault is gone each sink holds every step exactly once. The
    failure is raised after the other sinks got the line; the caller's own record is complete by then."""

    def __init__(self, sinks: Iterable[Sink] = ()) -> None:
        self.sinks = list(sinks)
        self._pending: dict[Sink, list[tuple[dict[str, float], int]]] = {}

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key in metrics:
            assert "/" in key, f"metric key {key!r} has no namespace (expected e.g. 'train/{key}')"
        self._deliver([(metrics, step)])

    def close(self) -> None:
        try:
            self._deliver([])  # what a failed write left pending
        finally:
            for sink in self.sinks:
                sink.close()

    def _deliver(self, lines: list[tuple[dict[str, float], int]]) -> None:
        error = None
        for sink in self.sinks:
            todo = self._pending.pop(sink, []) + lines
            for i, (metrics, step) in enumerate(todo):
                try:
                    sink.write(metrics, step)
                except BaseException as exc:  # kept for the next call, then re-raised below
                    self._pending[sink] = todo[i:]
                    error = error or exc
                    break
        if error is not None:
            raise error


def summarize(values: Sequence[float], prefix: str) -> dict[str, float]:
    """`{prefix/mean, prefix/median, prefix/max, prefix/min}` of a non-empty list (slime's response_len/*)."""
    if not values:
        return {}
    return {
        f"{prefix}/mean": float(statistics.fmean(values)),
        f"{prefix}/median": float(statistics.median(values)),
        f"{prefix}/max": float(max(values)),
        f"{prefix}/min": float(min(values)),
    }


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with `c` correct out of `n` samples: 1 - C(n-c, k) / C(n, k).

    (Chen et al., 2021.) Requires `k <= n`.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def to_floats(metrics: dict) -> dict[str, float]:
    """Plain Python floats for every value (tensors via `.item()`), so sinks and history hold no tensors."""
    return {k: float(v.item() if hasattr(v, "item") else v) for k, v in metrics.items()}
