"""What runs inside the Ray actors: a trainer rank (`TrainWorker`) and a rollout engine (`EngineWorker`).

Plain classes (Ray wraps them with `ray.remote` in `ray_cluster`), so each method is an ordinary call.
A TrainWorker owns one FSDP rank (torch.distributed is set up from the rank/world/master the driver hands
it) and its part of every RL step (`rlbench.rank_step.RankStep`, all-reducing over the DP group, with the
packs and log-probs of the current batch kept here between the driver's calls); an EngineWorker owns one rollout
engine (`local.build_engine`: a `TorchEngine`, or the SGLang adapter, whose `sglang.Engine` starts its tp_size
scheduler processes on the GPUs this actor reserved). Weights go from
trainer ranks to engines directly (CUDA IPC or a broadcast group), never through the driver.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time

import torch

from rlbench.compile_cache import use_compile_cache
from rlbench.configs.cluster import ClusterConfig
from rlbench.orchestration.ray_placement import gather, local_gpu_index
from rlbench.orchestration.ray_weights import (
    BroadcastGroup,
    GroupReceiver,
    load_ipc_payload,
    push_broadcast,
    push_ipc,
    use_shared_memory_files,
)
from rlbench.rank_step import DPAllReduce, RankStep
from rlbench.weights import checksum, engine_named_weights


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _setup_process(cfg, cwd: str, env_vars: dict) -> torch.device:
    """Same working directory as the driver (relative paths), extra env vars, and this actor's device."""
    os.chdir(cwd)
    os.environ.update({k: str(v) for k, v in env_vars.items()})
    use_compile_cache()
    if cfg.backend.device != "cuda":
        torch.set_num_threads(1)  # CPU "GPUs" share the host's cores
        use_shared_memory_files()
        return torch.device("cpu")
    index = local_gpu_index()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _peak_memory_gb(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


class TrainWorker:
    """Trainer rank `rank` of `world_size`: an FSDP2 backend plus its share of each RL step."""

    def __init__(self, cfg, rank: int, world_size: int, cluster: ClusterConfig, cwd: str) -> None:
        self.cfg, self.rank, self.world_size, self.cluster = cfg, rank, world_size, cluster
        self.device = _setup_process(cfg, cwd, cluster.env_vars)
        self.backend = self.step = None
        self.packs: list[list] = []  # [step][micro-batch] -> Pack of the batch being trained
        self.old = self.ref = self.adv = None  # its old / ref log-probs and advantages, [step][micro-batch] -> [R]
        self.values = self.returns = None  # PPO with a critic: its values V_old and returns, same layout
        self.engines: list = []
        self.group: BroadcastGroup | None = None
        self.layouts: list | None = None  # disaggregated rank 0: each engine's weight_layout(), read at the first sync

    def master_address(self) -> tuple[str, int]:
        """(IP, free port) of this rank's node: rank 0's is the rendezvous of the trainer group."""
        return _node_ip(), _free_port()

    def init(self, master_addr: str, master_port: int, pad_token_id: int) -> dict:
        """Join the trainer process group and build the training backend (`cfg.train_backend`: FSDP2 or
        megatron-core); returns `num_params` and this rank's DP rank (which shard of each batch it trains)."""
        from rlbench.distributed.mesh import init_distributed

        local_rank = self.device.index if self.device.type == "cuda" else 0
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(local_rank),
                          MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        from rlbench.orchestration.local import build_backend

        b = self.cfg.backend
        env = init_distributed(b.device, cp_size=b.cp_size, cpu_offload=bool(b.fsdp.cpu_offload),
                               timeout_minutes=self.cluster.collective_timeout_s / 60)
        self.backend = build_backend(self.cfg, env)
        if self.cfg.train_backend == "megatron":  # TP / PP peers hold the same samples: megatron's DP group
            from megatron.core import parallel_state as ps

            dp_group, dp_rank = ps.get_data_parallel_group(), ps.get_data_parallel_rank()
        else:  # CP peers hold the same samples: the mesh's DP dimension
            dp_group, dp_rank = env.mesh["dp"].get_group(), env.mesh["dp"].get_local_rank()
        reduce = DPAllReduce(dp_group, env.device if env.device.type == "cuda" else None)  # gloo reduces CPU tensors
        self.step = RankStep(self.cfg.batch, self.cfg.loss, self.backend, cp_size=b.cp_size, pad_token_id=pad_token_id,
                             reduce=reduce)
        return {"num_params": self._num_params(), "dp_rank": int(dp_rank)}

    def _num_params(self) -> int:
        """The model's parameter count (tied weights once): FSDP's DTensors report global sizes; megatron's
        TP shards do not, so its count comes from the HF config on the meta device."""
        if self.cfg.train_backend != "megatron":
            return sum(p.numel() for p in self.backend.model.parameters())
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return sum(p.numel() for p in AutoModelForCausalLM.from_config(self.backend.hf_config).parameters())

    # ---------------------------------------------------------------- the RL step (collective)
    def pack(self, steps: list) -> dict:
        """Pack this rank's samples (`[step] -> list[Sample]`, fetched from the object store by Ray)."""
        self.packs, self.old, self.ref, self.adv = self.step.pack(steps), None, None, None
        self.values = self.returns = None
        self.sample_index = [[s.index for s in step] for step in steps]  # [step][sample id] -> Sample.index
        return {"micro_batches": [len(p) for p in self.packs], "tokens": sum(p.num_tokens for s in self.packs for p in s)}

    def compute_log_probs(self, first_from_forward: bool = False) -> dict:
        """Old (and ref) log-probs of the packs (kept here); returns the global `rollout/*` means and `perf/*`."""
        self.old, self.ref, metrics = self.step.compute_log_probs(self.packs, first_from_forward=first_from_forward)
        self.adv = None  # advantages may read the passes (KL-in-reward): computed after them
        return metrics

    def compute_values(self) -> dict:
        """The critic's values of the packs (kept here); returns `perf/values_*`."""
        self.values, metrics = self.step.compute_values(self.packs)
        self.adv = self.returns = None  # the advantages read the values (GAE): computed after them
        return metrics

    def compute_advantages(self, kl_coef: float | None = None) -> tuple[dict, dict]:
        """Token-level advantages of the packs (kept here, with a critic's returns); returns the global
        `rollout/advantages` (and `critic/*_mean`) and each sample's advantages by `Sample.index` (the driver
        reports their one-process mean). `kl_coef`: β of KL-in-reward (the driver's KL controller)."""
        if self.step.needs_log_probs(self.old, self.ref):
            self.compute_log_probs()
        if self.step.critic is not None and self.values is None:
            self.compute_values()
        self.adv, self.returns, metrics = self.step.advantages_and_returns(self.packs, self.old, self.ref, self.values,
                                                                           kl_coef=kl_coef)
        per_sample = {}
        for index, step_packs, step_adv in zip(self.sample_index, self.packs, self.adv):
            for p, a in zip(step_packs, step_adv):
                per_sample |= {index[i]: x for i, x in zip(p.sample_ids, torch.split(a, p.response_lengths))}
        return metrics, per_sample

    def train_critic(self) -> dict:
        """One critic optimizer step per global batch on the kept returns; `critic/*` (global)."""
        if self.adv is None:
            self.compute_advantages()
        metrics = self.step.train_critic(self.packs, self.values, self.returns)
        metrics["perf/peak_memory_gb"] = _peak_memory_gb(self.device)
        return metrics

    def train(self) -> dict:
        if self.step.needs_log_probs(self.old, self.ref):
            self.compute_log_probs()
        if self.adv is None:
            self.compute_advantages()
        metrics = self.step.train(self.packs, self.old, self.ref, self.adv)
        metrics["perf/peak_memory_gb"] = _peak_memory_gb(self.device)
        return metrics

    # ---------------------------------------------------------------- weights
    def connect_engines(self, engines: list) -> None:
        """Colocated: `engines` = [the engine on this rank's bundle]; disaggregated rank 0: all engines."""
        self.engines = list(engines)

    def init_weight_group(self, host: str, port: int, world_size: int) -> None:
        """Disaggregated, rank 0: join the broadcast group as its rank 0 (engines join concurrently)."""
        self.group = BroadcastGroup(host, port, 0, world_size, self.device, self.cluster.collective_timeout_s)

    def sync_weights(self, version: int, verify: bool | None = None) -> dict:
        """Push this rank's part of the weights (a collective over trainer ranks); returns `weights/*`.

        `verify` (default `cfg.weights.verify`): compare bit checksums of what was sent with the engines' weights.
        """
        w = self.cfg.weights
        verify = w.verify if verify is None else verify
        sums: dict | None = {} if verify and self.engines else None

        def wait(refs):
            refs = refs if isinstance(refs, list) else [refs]
            return gather(refs, self.cluster.timeout_s, f"weight sync v{version}", [f"engine {i}" for i in range(len(refs))])

        if self.group is not None and self.layouts is None:
            self.layouts = wait([e.weight_layout.remote() for e in self.engines])
        buckets = self.backend.named_weights_for_sync(w.bucket_bytes, w.torch_dtype)  # one dtype on every rank

        start = time.perf_counter()
        if self.cluster.colocate:
            tally = push_ipc(buckets, self.engines[0], version, wait, sums)
            if self.device.type == "cuda":
                torch.cuda.ipc_collect()  # free the flat buffers the engine has released
        else:
            tally = push_broadcast(buckets, self.engines, self.group, version, wait, sums, self.layouts or ())
        metrics = tally.metrics() | {"perf/update_weights_rank_time": time.perf_counter() - start}
        if sums:
            self._verify(sums, wait)
            metrics["weights/verified"] = 1.0
        return metrics

    def _verify(self, sent: dict, wait) -> None:
        names = sorted(sent)
        for i, got in enumerate(wait([e.checksums.remote(names) for e in self.engines])):
            bad = [n for n in names if got.get(n) != sent[n]]
            if bad:
                raise RuntimeError(
                    f"weight sync verify: engine {i} differs from trainer rank {self.rank} in {len(bad)} tensors, "
                    f"e.g. {bad[:3]} (missing from the engine, or a wrong dtype/name mapping)"
                )

    # ---------------------------------------------------------------- memory and state
    def sleep(self) -> dict:
        return self.backend.sleep()

    def wake_up(self) -> dict:
        return self.backend.wake_up()

    def update_ref(self) -> dict:
        return self.backend.update_ref()

    def export_hf(self, path: str, dtype: str | None = None) -> None:
        """A plain HF directory of the trainer's weights (collective; rank 0 writes), cast to `dtype` (a
        `torch` dtype name such as "bfloat16"; None keeps the parameters' own)."""
        self.backend.export_hf(path, None if dtype is None else getattr(torch, dtype))

    def save(self, checkpoint_dir: str, step: int | None = None, extra: dict | None = None) -> str:
        self.backend.cfg = dataclasses.replace(self.backend.cfg, checkpoint_dir=checkpoint_dir)
        return self.backend.save(step, extra=extra if self.rank == 0 else None)  # rank 0 writes the extras

    def load(self, checkpoint_dir: str, step: int | None) -> int:
        self.backend.cfg = dataclasses.replace(self.backend.cfg, checkpoint_dir=checkpoint_dir)
        return self.backend.load(step)

    def pid(self) -> int:
        return os.getpid()


class EngineWorker:
    """Rollout engine `index`: a TorchEngine (or an SGLang engine) on this actor's device, fed weights by the trainer
    ranks."""

    def __init__(self, cfg, index: int, cluster: ClusterConfig, cwd: str, tokenizer) -> None:
        from rlbench.orchestration.local import build_engine

        self.index, self.cluster = index, cluster
        self.device = _setup_process(cfg, cwd, cluster.env_vars)
        self.engine = build_engine(cfg, self.device, tokenizer)
        # the broadcast's engine side: SGLang's adapter has it (SGLang receives), rlbench's engines get one
        self.receiver = (self.engine if hasattr(self.engine, "update_weights_from_distributed")
                         else GroupReceiver(self.engine, self.device, cluster.collective_timeout_s))
        self.joined = False

    def generate(self, prompts, sampling, seeds=None):
        return self.engine.generate(prompts, sampling, seeds=seeds)

    def load_ipc(self, payload: list, version: int) -> int:
        """Colocated: load one bucket from IPC handles (one call per bucket)."""
        return load_ipc_payload(self.engine, payload, version)

    def weight_layout(self) -> tuple[dict | None, str | None]:
        """(name -> shape, dtype) the trainer checks an announcement against before broadcasting (None: any)."""
        return self.receiver.weight_layout()

    def group_ranks(self) -> int:
        """Ranks this engine takes in the weight-broadcast group (its TP size)."""
        return self.receiver.group_ranks

    def init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int) -> None:
        """Join the trainer's broadcast group as ranks rank_offset.. (returns once every rank has joined)."""
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.receiver.init_weights_update_group(host, port, rank_offset, world_size, backend=backend).result(
            timeout=self.cluster.collective_timeout_s)
        self.joined = True

    def receive_weights(self, meta: dict, version: int) -> None:
        """Disaggregated: receive one announced bucket (`ray_weights.announce`) from the broadcast group."""
        if not self.joined:
            raise RuntimeError(f"engine {self.index} has no weight-broadcast group; call init_weight_group first")
        self.receiver.update_weights_from_distributed(version=version, **meta).result(
            timeout=self.cluster.collective_timeout_s)

    def checksums(self, names: list[str]) -> dict:
        weights = dict(engine_named_weights(self.engine))
        return {n: checksum(weights[n]) for n in names if n in weights}

    def weight_version(self) -> int:
        return self.engine.weight_version

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    def flush_cache(self) -> None:
        self.engine.flush_cache()

    def num_params(self) -> int:
        return sum(p.numel() for p in self.engine.model.parameters())

    def pid(self) -> int:
        return os.getpid()
