"""KeyboardInterrupt (a real SIGINT, as a notebook's "interrupt kernel" sends) at every sub-step boundary of
`Trainer.step()`, then `step()` again: parameters, AdamW state, engine weights, versions, data position and metrics
equal, bit for bit, those of a run that was never interrupted (docs/reliability.md states the semantics)."""

from __future__ import annotations

import signal

import pytest
import torch

import rlbench.backends.checkpoint as ckpt
from rlbench import Trainer

from ._faults import assert_same, state, tiny_config

STEPS = 2  # the interrupt hits the second step


def _sigint():
    signal.raise_signal(signal.SIGINT)  # Python's handler raises KeyboardInterrupt at the next safe point


def _once(obj, name, before=False, after=False, nth=1):
    """Wrap `obj.name` so that its `nth` call sends SIGINT (before or after doing its work); returns the counter."""
    original = getattr(obj, name)
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        hit = calls[0] == nth
        if hit and before:
            _sigint()
        out = original(*args, **kwargs)
        if hit and after:
            _sigint()
        return out

    setattr(obj, name, wrapped)
    return lambda: setattr(obj, name, original)


def _mid_bucket(trainer):
    """Sync: the engine copies the first bucket, then SIGINT (a mix of old and new weights in the engine)."""
    engine, original = trainer.engine, trainer.engine.update_weights
    calls = [0]

    def update_weights(buckets, version):
        calls[0] += 1
        if calls[0] != 1:
            return original(buckets, version)

        def first_then_interrupt():
            it = iter(buckets)
            yield next(it)
            _sigint()
            yield from it

        return original(first_then_interrupt(), version)

    engine.update_weights = update_weights
    return lambda: setattr(engine, "update_weights", original)


# point -> how to inject it; the loss is called once per micro-batch (4 per optimizer step, 2 optimizer steps)
POINTS = {
    "rollout (prompts taken)": lambda t: _once(t.dataset, "next_batch", after=True),
    "score": lambda t: _once(t, "score", after=True),
    "pack": lambda t: _once(t, "pack", after=True),
    "compute_log_probs": lambda t: _once(t.backend, "compute_log_prob", after=True),
    "advantages": lambda t: _once(t, "compute_advantages", after=True),
    "train, 1st optimizer step, 2nd micro-batch": lambda t: _once(t.rank_step, "loss", after=True, nth=2),
    "train, inside the 1st optimizer update": lambda t: _once(t.backend.optimizer, "step", after=True),
    "train, between optimizer steps": lambda t: _once(t.backend, "train", after=True),
    "train, 2nd optimizer step, last micro-batch": lambda t: _once(t.rank_step, "loss", after=True, nth=8),
    "update_ref": lambda t: _once(t.backend, "update_ref", after=True),
    "eval (after the sync)": lambda t: _once(t.rollouts, "evaluate", after=True),
    "sync_weights, mid-bucket": _mid_bucket,
    "save (before commit)": lambda t: _once(ckpt, "_commit", before=True),
}


@pytest.fixture(scope="module", autouse=True)
def sigint_raises():
    """Python's own SIGINT handler, as in a notebook kernel: a process started in the background by a
    non-interactive shell (a CI runner, `make test &`) inherits SIGINT ignored, and the signal would do nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


# The reference run (module fixture) and every test's steps must run at one thread count: "the same step" is
# compared bit for bit, and another thread count sums in another order.
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    torch.set_num_threads(1)  # as the tests (one_thread): the fixture is built before their function fixtures
    work = tmp_path_factory.mktemp("interrupts")
    trainer = Trainer(tiny_config(str(work), save_dir=str(work / "ckpt"), save_interval=1, ref=True,
                                  eval_interval=STEPS))
    start = str(work / "start")
    trainer.save(start)  # every case starts from here
    trainer.load(start)
    for _ in range(STEPS):
        trainer.step()
    reference = state(trainer)
    assert reference["counters"][1] == 2 * STEPS  # one policy version per optimizer step
    assert all(h["train/grad_norm"] > 0 for h in trainer.history)  # the weights really move
    assert "eval/pass@1" in trainer.history[-1] and len(trainer.eval_history) == 2  # before training, after step 2
    return trainer, start, reference


@pytest.mark.parametrize("point", list(POINTS))
def test_interrupt_then_step_again_is_the_uninterrupted_step(run, point):
    trainer, start, reference = run
    trainer.load(start)
    trainer.step()
    before = state(trainer)
    undo = POINTS[point](trainer)
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer.step()
    finally:
        undo()
    # consistent at the interrupt: versions count applied optimizer steps, the engine's only after a full sync
    rid, policy, version, engine_version, backend_step = state(trainer)["counters"]
    assert policy == backend_step and engine_version == version
    if trainer._inflight is None:  # rolled back: as if the step had never started
        assert_same(state(trainer), before)
    else:  # weights changed: the next step() finishes this one
        assert policy > before["counters"][1]
    assert len(trainer.history) == rid  # history and rollout_id agree
    trainer.step()  # "Step again"
    assert_same(state(trainer), reference)
    assert trainer._inflight is None and not trainer._engine_stale
    assert trainer.load(trainer.cfg.checkpoint.save_dir) == STEPS  # the step's checkpoint was written
    assert_same(state(trainer), reference)


def test_notebook_interrupt_kernel_then_step_button(run):
    """The notebook flow: `controller.step()` in a cell, "interrupt kernel" mid-train, run the cell again. (The
    Step *button* runs in a worker thread, which SIGINT never reaches: its Stop button ends a run between steps.)"""
    from rlbench.viz.controller import StepController

    trainer, start, reference = run
    trainer.load(start)
    controller = StepController(trainer)
    controller.step()
    undo = POINTS["train, between optimizer steps"](trainer)
    try:
        with pytest.raises(KeyboardInterrupt):
            controller.step()
    finally:
        undo()
    assert controller.steps_done == 1
    controller.step()
    assert controller.steps_done == STEPS
    assert_same(state(trainer), reference)


def _raise_in_backward(trainer, exc, nth):
    """The `nth` backward through the first decoder layer raises `exc` (after the head's and the later layers'
    backward ran: FSDP2 is mid-backward, some gradients reduce-scattered, others not)."""
    calls = [0]

    def hook(module, grad_input, grad_output):
        calls[0] += 1
        if calls[0] == nth:
            raise exc

    return trainer.backend.model.model.layers[0].register_full_backward_hook(hook).remove


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), torch.OutOfMemoryError("CUDA out of memory. Tried to allocate "
                                                                             "2.00 GiB")], ids=["ctrl-c", "cuda-oom"])
@pytest.mark.parametrize("nth", [2, 5], ids=["1st optimizer step", "2nd optimizer step"])
def test_exception_inside_backward_then_step_again_is_the_uninterrupted_step(run, exc, nth):
    """An exception raised inside backward leaves FSDP2 mid-backward; the backend resets it, so every parameter is
    the optimizer's again and the next step() trains bit for bit like the uninterrupted run (rolled back in the
    1st optimizer step, finished by the next step() in the 2nd)."""
    trainer, start, reference = run
    trainer.load(start)
    trainer.step()
    before = state(trainer)
    undo = _raise_in_backward(trainer, exc, nth)
    try:
        with pytest.raises(type(exc)):
            trainer.step()
    finally:
        undo()
    model, optimizer = trainer.backend.model, trainer.backend.optimizer
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert [n for n, p in model.named_parameters() if id(p) not in held] == []  # the optimizer's parameters
    assert (trainer._inflight is None) == (nth == 2)
    trainer.step()
    after = state(trainer)
    assert all(not torch.equal(before["params"][n], after["params"][n]) for n in before["params"])  # weights moved
    assert_same(after, reference)


# PPO with a critic: the critic's update runs first (2 optimizer steps of 2+ micro-batches), then the actor's
CRITIC_POINTS = {
    "values": lambda t: _once(t.backend, "compute_values", after=True),
    "critic, 1st optimizer step, 2nd micro-batch": lambda t: _once(t.rank_step.critic, "loss", after=True, nth=2),
    "critic, between optimizer steps": lambda t: _once(t.backend, "train_critic", after=True),
    "between the critic and the actor": lambda t: _once(t.backend, "train_critic", after=True, nth=2),
    "actor, 1st optimizer step, 2nd micro-batch": lambda t: _once(t.rank_step, "loss", after=True, nth=2),
    "save (before commit)": lambda t: _once(ckpt, "_commit", before=True),
}


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory):
    torch.set_num_threads(1)
    work = tmp_path_factory.mktemp("interrupts_ppo")
    trainer = Trainer(tiny_config(str(work), save_dir=str(work / "ckpt"), save_interval=1, ref=True, critic=True))
    start = str(work / "start")
    trainer.save(start)
    trainer.load(start)
    for _ in range(STEPS):
        trainer.step()
    reference = state(trainer)
    assert trainer.backend.critic.step == 2 * STEPS and reference["counters"][1] == 2 * STEPS
    assert all(h["critic/grad_norm"] > 0 and h["train/grad_norm"] > 0 for h in trainer.history)
    betas = [h["rollout/kl_coef"] for h in trainer.history]  # the adaptive controller moved β between steps
    assert betas[0] == 0.05 and betas[1] != betas[0] and trainer.kl_ctl.value != betas[1]
    return trainer, start, reference


@pytest.mark.parametrize("point", list(CRITIC_POINTS))
def test_ppo_interrupt_then_step_again_is_the_uninterrupted_step(ppo_run, point):
    """The same guarantee with a critic: a critic update that finished counts as a change (the next step()
    finishes the step), one that did not is rolled back with the rest."""
    trainer, start, reference = ppo_run
    trainer.load(start)
    trainer.step()
    before = state(trainer)
    undo = CRITIC_POINTS[point](trainer)
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer.step()
    finally:
        undo()
    if trainer._inflight is None:
        assert_same(state(trainer), before)
    else:
        assert trainer.backend.critic.step > before["sched"]["sched"]["critic_step"]
    trainer.step()
    assert_same(state(trainer), reference)
    assert trainer.load(trainer.cfg.checkpoint.save_dir) == STEPS  # the critic is inside the step's checkpoint
    assert_same(state(trainer), reference)


def test_ppo_resume_is_bit_exact(ppo_run):
    """save after step 1, step 2; load, step 2 again: both models, both optimizers, the loop: equal bits."""
    trainer, start, reference = ppo_run
    trainer.load(start)
    trainer.step()
    mid = state(trainer)
    trainer.step()
    assert_same(state(trainer), reference)
    trainer.load(trainer.cfg.checkpoint.save_dir, rollout_id=1)
    assert_same(state(trainer), mid)
    trainer.step()
    assert_same(state(trainer), reference)
