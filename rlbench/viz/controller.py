"""StepController: buttons that drive a Trainer one named sub-step at a time, or N steps in the background.

Work runs in a worker thread so the notebook stays responsive; the Stop button sets a flag that is
checked between steps (a step in flight finishes). `on_step(fn)` callbacks receive each step's
metric dict, which is how a LiveDashboard or RolloutViewer follows the run. The same actions are
plain methods (`step()`, `run(n)`, `rollout()`, ...) for scripts and CI, where no one clicks.
"""

from __future__ import annotations

import html
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import ipywidgets as widgets

from rlbench.viz._display import WidgetMixin

StepCallback = Callable[[Mapping[str, Any]], None]


class StepController(WidgetMixin):
    """Rollout / Train / Sync / Step / Run N buttons with a progress bar, a status line and a Stop flag.

    Args:
        trainer: an object with `step() -> dict`, `rollout()`, `train_step(batch)`, `sync_weights()`
            and `last_rollout` (duck-typed: `rlbench.Trainer` or a test fake).
        on_step: optional callback(s) called with each step's metric dict, in the worker thread.
        n_steps: initial value of the Run N box.
    """

    def __init__(self, trainer: Any, *, on_step: StepCallback | list[StepCallback] | None = None,
                 n_steps: int = 5) -> None:
        self.trainer = trainer
        self.callbacks: list[StepCallback] = []
        for fn in on_step if isinstance(on_step, list) else [on_step] if on_step else []:
            self.on_step(fn)
        self.steps_done = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._build_widgets(n_steps)

    # ---- widgets -------------------------------------------------------------------------------
    def _build_widgets(self, n_steps: int) -> None:
        def button(label: str, tip: str, style: str = "") -> widgets.Button:
            return widgets.Button(description=label, tooltip=tip, button_style=style,
                                  layout=widgets.Layout(width="auto"))

        self.buttons = {
            "rollout": button("Rollout", "generate and score one rollout batch (trainer.rollout(), .score())"),
            "train": button("Train", "train on the last rollout (trainer.train_step(last_rollout))"),
            "sync": button("Sync", "push the trained weights to the rollout engine"),
            "step": button("Step", "one full RL step (trainer.step())", "primary"),
            "run": button("Run N", "run N steps in the background", "success"),
        }
        self.stop_button = button("Stop", "stop after the step in flight", "danger")
        self.n_box = widgets.BoundedIntText(value=n_steps, min=1, max=100_000, description="N",
                                            layout=widgets.Layout(width="140px"),
                                            style={"description_width": "20px"})
        self.progress = widgets.IntProgress(value=0, min=0, max=1, description="progress")
        self.status = widgets.HTML(self._status_html("idle"))
        self.buttons["rollout"].on_click(lambda _: self.start(self.rollout))
        self.buttons["train"].on_click(lambda _: self.start(self.train))
        self.buttons["sync"].on_click(lambda _: self.start(self.sync))
        self.buttons["step"].on_click(lambda _: self.start(self.run, 1))
        self.buttons["run"].on_click(lambda _: self.start(self.run, self.n_box.value))
        self.stop_button.on_click(lambda _: self.stop())
        row = widgets.HBox([*self.buttons.values(), self.n_box, self.stop_button])
        self.widget = widgets.VBox([row, widgets.HBox([self.progress, self.status])])

    def _status_html(self, text: str, color: str = "#333") -> str:
        return (f"<span class='rlbench-status' style='color:{color}'>{html.escape(text)}</span> "
                f"<span class='rlbench-steps-done'>steps done: {self.steps_done}</span>")

    def _set_status(self, text: str, color: str = "#333") -> None:
        self.status.value = self._status_html(text, color)

    def _set_busy(self, busy: bool) -> None:
        for b in self.buttons.values():
            b.disabled = busy

    # ---- callbacks -----------------------------------------------------------------------------
    def on_step(self, fn: StepCallback) -> StepCallback:
        """Registers `fn(metrics)` to run after every completed step; returns fn (usable as a decorator)."""
        if not callable(fn):
            raise TypeError(f"on_step needs a callable taking the metrics dict, got {fn!r}")
        self.callbacks.append(fn)
        return fn

    def _emit(self, metrics: Mapping[str, Any]) -> None:
        for fn in self.callbacks:
            fn(metrics)

    # ---- actions (synchronous; buttons run them through start()) --------------------------------
    def step(self) -> dict:
        """One full trainer step; updates progress/status and fires the on_step callbacks."""
        t0 = time.perf_counter()
        metrics = dict(self.trainer.step())
        self.steps_done += 1
        self._emit(metrics)
        self._set_status(f"step {self.steps_done} done in {time.perf_counter() - t0:.2f}s", "#2a7")
        return metrics

    def run(self, n: int) -> list[dict]:
        """Runs up to `n` steps, stopping early when `stop()` was called; returns their metric dicts."""
        if n < 1:
            raise ValueError(f"n={n} steps must be >= 1")
        self._stop.clear()
        self.progress.max, self.progress.value = n, 0
        out = []
        for i in range(n):
            if self._stop.is_set():
                self._set_status(f"stopped after {i}/{n} steps", "#c60")
                break
            self._set_status(f"running step {i + 1}/{n}")
            out.append(self.step())
            self.progress.value = i + 1
        return out

    def rollout(self) -> Any:
        """`trainer.rollout()`, then `trainer.score(batch)` when the trainer has it (rewards and the group
        advantages that Train needs); the batch lands in `trainer.last_rollout`."""
        self._set_status("rollout ...")
        batch = self.trainer.rollout()
        if hasattr(self.trainer, "score"):
            self.trainer.score(batch)
        n = len(getattr(batch, "samples", batch) or [])
        self._set_status(f"rollout done: {n} samples", "#2a7")
        return batch

    def train(self) -> dict:
        """`trainer.train_step(trainer.last_rollout)`; needs a rollout first."""
        batch = getattr(self.trainer, "last_rollout", None)
        if batch is None:
            raise RuntimeError("no rollout to train on: press Rollout (or call trainer.rollout()) first")
        self._set_status("train ...")
        metrics = dict(self.trainer.train_step(batch) or {})
        self._set_status(f"train done: {len(metrics)} metrics", "#2a7")
        return metrics

    def sync(self) -> dict:
        """`trainer.sync_weights()`."""
        self._set_status("sync ...")
        out = dict(self.trainer.sync_weights() or {})
        self._set_status("weights synced", "#2a7")
        return out

    # ---- background execution ------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, action: Callable[..., Any], *args: Any) -> threading.Thread | None:
        """Runs `action(*args)` in a worker thread unless one is running; errors land in `error` and the status."""
        if self.running:
            self._set_status("busy: wait for the running action or press Stop", "#c60")
            return None
        self.error = None
        self._set_busy(True)
        self._thread = threading.Thread(target=self._worker, args=(action, args), daemon=True,
                                        name="rlbench-step-controller")
        self._thread.start()
        return self._thread

    def _worker(self, action: Callable[..., Any], args: tuple) -> None:
        try:
            action(*args)
        except Exception as exc:  # noqa: BLE001 - a worker thread must report, not swallow: see wait()
            self.error = exc
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            self._set_status(f"error: {last}", "#c00")
        finally:
            self._set_busy(False)

    def stop(self) -> None:
        """Asks a running `run(n)` to stop before its next step."""
        self._stop.set()
        if self.running:
            self._set_status("stopping after the step in flight ...", "#c60")

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until the worker finishes; re-raises the error it hit, if any."""
        if self._thread is not None:
            self._thread.join(timeout)
        if self.error is not None:
            raise RuntimeError(f"StepController action failed: {self.error!r}") from self.error
