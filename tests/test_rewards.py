"""rlbench.rewards: registry, custom import path, batch API, errors with context, tricky inputs."""

from __future__ import annotations

import sys
import threading
import types

import pytest

from rlbench.rewards import (
    REWARDS,
    RewardError,
    countdown_reward,
    exact_reward,
    get_reward_fn,
    math_reward,
    score_batch,
)
from rlbench.types import Sample


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("\\boxed{1/2}", "0.5", 1.0),  # fraction vs decimal
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),  # decimal vs LaTeX fraction
        ("\\boxed{\\frac{1}{2}}", "1/2", 1.0),
        ("\\boxed{0.5}", "\\boxed{1/2}", 1.0),  # boxed label
        ("\\boxed{132}", "132", 1.0),
        ("\\boxed{-25}", "-25", 1.0),
        ("\\boxed{25}", "-25", 0.0),
        ("x \\boxed{4} y \\boxed{5}", "5", 1.0),  # the last box is the answer
        ("\\boxed{5}<|im_end|>", "5", 1.0),
        ("The answer is 7", "7", 1.0),  # no box: math_verify's final answer
        ("\\boxed{3*5+7}", "22", 1.0),  # an expression equal to the label
        ("\\boxed{12", "12", 0.0),  # unclosed box
        ("\\boxed{}", "5", 0.0),  # empty box
        ("garbage ## }{", "5", 0.0),
        ("", "5", 0.0),  # empty response
    ],
)
def test_math_reward_tricky_inputs(response, label, expected):
    assert math_reward(response, label) == expected


def test_math_integer_fast_path_agrees_with_math_verify():
    from math_verify import parse, verify

    for response, label in [("\\boxed{7}", "7"), ("\\boxed{-7}", "7"), ("\\boxed{007}", "7"), ("\\boxed{70}", "7")]:
        assert math_reward(response, label) == float(verify(parse(f"${label}$"), parse(response)))


def test_math_reward_off_main_thread():
    # math_verify's SIGALRM timeout cannot be installed off the main thread; the reward must still work.
    out = []
    t = threading.Thread(target=lambda: out.append(math_reward("\\boxed{1/2}", "0.5")))
    t.start()
    t.join()
    assert out == [1.0]


def test_exact_and_countdown_rewards():
    assert exact_reward("\\boxed{abc}", "abc") == 1.0 and exact_reward(" abc ", "abc") == 1.0
    assert exact_reward("\\boxed{0.5}", "1/2") == 0.0  # exact means string equality
    assert exact_reward("\\boxed{3}", "\\boxed{3}") == 1.0
    label = {"target": 10, "numbers": [2, 5, 3]}
    assert countdown_reward("\\boxed{2*5}", label) == 1.0 and countdown_reward("\\boxed{2*5*1}", label) == 0.0


def test_registry_and_custom_import_path():
    assert set(REWARDS) >= {"math", "exact", "countdown"}
    assert get_reward_fn("math") is math_reward
    module = types.ModuleType("_rlbench_test_rm")
    module.length_reward = lambda response, label: float(len(response))
    sys.modules["_rlbench_test_rm"] = module
    try:
        assert score_batch(["abc", ""], [None, None], rm_type="_rlbench_test_rm:length_reward") == [3.0, 0.0]
        with pytest.raises(ValueError, match="has no callable 'missing'"):
            get_reward_fn("_rlbench_test_rm:missing")
    finally:
        del sys.modules["_rlbench_test_rm"]
    with pytest.raises(ValueError, match="unknown reward 'f1'.*'countdown'.*module.path:function"):
        get_reward_fn("f1")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'.*PYTHONPATH") as info:
        get_reward_fn("no_such_module_xyz:fn")
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_score_batch_on_texts_and_samples():
    assert score_batch(["\\boxed{2}", "\\boxed{3}", "x"], ["2", "2", "2"], rm_type="math") == [1.0, 0.0, 0.0]
    samples = [
        Sample(tokens=[1, 2], response_length=1, response="\\boxed{4}", label="4"),
        Sample(tokens=[1, 2], response_length=1, response="\\boxed{2*2}", label={"target": 4, "numbers": [2, 2]},
               metadata={"rm_type": "countdown"}),  # per-sample rm_type wins, as in slime
        Sample(tokens=[1, 2], response_length=1, response="\\boxed{0.5}", label="1/2"),
    ]
    assert score_batch(samples, rm_type="math") == [1.0, 1.0, 1.0]
    assert score_batch(samples[:1], labels=["5"], rm_type="math") == [0.0]  # labels override Sample.label
    assert score_batch(samples, rm_type=lambda response, label: 0.25) == [0.25, 1.0, 0.25]


def test_score_batch_argument_errors():
    with pytest.raises(ValueError, match="got 2 responses but 1 labels"):
        score_batch(["a", "b"], ["1"])
    with pytest.raises(ValueError, match="without labels"):
        score_batch(["a"])


def test_raising_reward_is_reraised_with_the_sample():
    def flaky(response, label):
        if response == "boom":
            raise KeyError("bad key")
        return 1.0

    with pytest.raises(RewardError) as info:
        score_batch(["ok", "boom"], ["L0", "L1"], rm_type=flaky)
    msg = str(info.value)
    assert "sample 1" in msg and "response='boom'" in msg and "label='L1'" in msg and "KeyError" in msg
    assert isinstance(info.value.__cause__, KeyError)


def test_integer_answers_take_the_fast_path_without_math_verify(monkeypatch):
    import math_verify

    calls = []
    real_parse = math_verify.parse
    monkeypatch.setattr(math_verify, "parse", lambda *a, **k: calls.append(a) or real_parse(*a, **k))
    scores = score_batch([f"\\boxed{{{i}}}" for i in range(64)], [str(i % 32) for i in range(64)], rm_type="math")
    assert scores == [1.0] * 32 + [0.0] * 32 and calls == []  # integers never reach sympy
    assert score_batch(["\\boxed{1/2}"], ["0.5"], rm_type="math") == [1.0] and len(calls) == 2  # gold + answer


def test_math_reward_without_math_verify_names_the_install(monkeypatch):
    """A machine without math-verify (an optional install there) gets the pip line, not a bare ModuleNotFoundError;
    the integer fast path still needs nothing."""
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import now raises ImportError
    assert math_reward("so \\boxed{12}", "12") == 1.0
    with pytest.raises(ImportError, match=r"pip install 'math-verify>=0.7'.*rm_type='exact'"):
        math_reward("x = 1/2", "\\frac{1}{2}")
