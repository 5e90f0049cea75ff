"""The run configuration, on the ground floor: one small dataclass per section, composed by `RunConfig`
(run.py, with the rules that span sections). No module here imports torch or any implementation: a config can
be built and validated without loading CUDA code (tests/test_imports.py checks it).

    run.py         RunConfig and the cross-section rules      backend.py   TrainConfig (shared by both backends),
    data.py        DataConfig, TaskConfig                                   FSDP-only options, OptimConfig
    rollout.py     RolloutConfig, EvalConfig, reward names     megatron.py  MegatronConfig
    multiturn.py   MultiTurnConfig (tools, turns, budgets)
    batch.py       BatchConfig                                 engine.py    TorchEngineConfig, MegakernelConfig
    loss.py        LossConfig, MISConfig                       sglang.py    SGLangEngineConfig
    weights.py     WeightSyncConfig                            cluster.py   ClusterConfig, the Ray layout rules
    checkpoint.py  CheckpointConfig                            metrics.py   LoggingConfig
    critic.py      CriticConfig (the PPO critic, TrainConfig.critic)
"""

from rlbench.configs.backend import FSDPOptions, OptimConfig, TrainConfig
from rlbench.configs.batch import BatchConfig
from rlbench.configs.checkpoint import CheckpointConfig
from rlbench.configs.cluster import ClusterConfig
from rlbench.configs.critic import CriticConfig
from rlbench.configs.data import DataConfig, TaskConfig
from rlbench.configs.engine import MegakernelConfig, TorchEngineConfig
from rlbench.configs.loss import LossConfig, MISConfig
from rlbench.configs.megatron import MegatronConfig
from rlbench.configs.metrics import LoggingConfig
from rlbench.configs.multiturn import MultiTurnConfig
from rlbench.configs.rollout import EvalConfig, RolloutConfig
from rlbench.configs.run import RunConfig
from rlbench.configs.sglang import SGLangEngineConfig
from rlbench.configs.weights import WeightSyncConfig

__all__ = [
    "BatchConfig", "CheckpointConfig", "ClusterConfig", "CriticConfig", "DataConfig", "EvalConfig", "FSDPOptions",
    "LoggingConfig", "LossConfig", "MISConfig", "MegakernelConfig", "MegatronConfig", "MultiTurnConfig", "OptimConfig",
    "RolloutConfig", "RunConfig", "SGLangEngineConfig", "TaskConfig", "TorchEngineConfig", "TrainConfig",
    "WeightSyncConfig",
]
