"""Every registry the configs choose from by name is tied to the name tuple the configs validate with: the configs
import no implementation (tests/test_imports.py), so the names are kept twice, and this test is what keeps the two
copies equal. A name added to one side only fails here, not at run time."""

from __future__ import annotations

import pytest

from rlbench.configs import backend, cluster, data, engine, loss, multiturn, rollout


def _tied():
    from rlbench import orchestration, rewards
    from rlbench.algorithms import advantages, aggregation, kl, kl_control, policy_loss
    from rlbench.data import tasks
    from rlbench.distributed import cp_kernels
    from rlbench.engine import attention, quantize
    from rlbench.rollout.multiturn import tools

    return {
        "advantage estimators": (loss.ADVANTAGE_ESTIMATORS, advantages.ADVANTAGE_FNS),
        "policy losses": (loss.POLICY_LOSSES, policy_loss.POLICY_LOSS_FNS),
        "KL estimators": (loss.KL_TYPES, kl.KL_ESTIMATORS),
        "KL controllers": (loss.KL_CTL_TYPES, kl_control.KL_CONTROLLERS),
        "loss aggregations": (loss.AGGREGATIONS, aggregation.AGGREGATION_FNS),
        "rewards": (rollout.REWARD_NAMES, rewards.BUILTIN_REWARDS),
        "decode attentions": (engine.DECODE_ATTENTION,
                              (*attention.DECODE_ATTENTION_FNS, *attention.TRITON_DECODE_ATTENTION)),
        "engine weight formats": (engine.WEIGHT_FORMATS, quantize.FORMATS),
        "CP attention kernels": (backend.CP_ATTENTIONS, cp_kernels.CP_KERNELS),
        "cluster backends": (cluster.BACKENDS, orchestration.TRAINERS),
        "synthetic tasks": (data.TASK_NAMES, tasks.TASKS),
        "tools": (multiturn.BUILTIN_TOOLS, tools.TOOLS),
    }


@pytest.mark.parametrize("name", sorted(_tied()))
def test_config_names_equal_the_registry(name):
    names, registry = _tied()[name]
    assert sorted(names) == sorted(registry), f"{name}: the config's names and the registry differ"


def test_a_missing_name_is_caught():
    names, registry = _tied()["policy losses"]
    assert sorted(names[:-1]) != sorted(registry)
