"""Rewards for the reward-pool tests, importable by name ("reward_helpers:fn") in the worker processes."""

from __future__ import annotations

import os
import pathlib

from rlbench.rewards import math_reward


def marked(response: str, label) -> float:
    """`math_reward`, after touching `$RLBENCH_TEST_MARKS/<pid>-<n>`: the test sees when and where it ran."""
    marks = pathlib.Path(os.environ["RLBENCH_TEST_MARKS"])
    n = len(list(marks.iterdir()))
    (marks / f"{os.getpid()}-{n}").touch()
    return math_reward(response, label)


def boom(response: str, label) -> float:
    raise ZeroDivisionError("the reward's own bug")


def die(response: str, label) -> float:
    os._exit(3)


def hang(response: str, label) -> float:
    import time

    time.sleep(600)
    return 0.0


def logged(response: str, label) -> float:
    """`math_reward`, after appending `reward <response>` to the file `$RLBENCH_TEST_EVENTS` (one write, O_APPEND:
    lines from several processes interleave whole, in the order they were written)."""
    with open(os.environ["RLBENCH_TEST_EVENTS"], "a") as f:
        f.write(f"reward {response!r}\n")
    return math_reward(response, label)
