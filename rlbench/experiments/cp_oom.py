"""CP out-of-memory experiment: the longest response one training step fits, per (cp, activation checkpointing).

    rlbench experiment cp-oom --preset qwen3-4b-shape --cp 1 2 4 --ac on off --out runs/cp_oom
    python -m rlbench.experiments.cp_oom --device cpu --preset tiny --start-len 256 --max-len 1024   # smoke

A trial trains one micro-batch holding one sequence (a short prompt and a response of L tokens) once, through
`FSDPBackend` on one process (forward, backward, AdamW step: the memory of a one-GPU FSDP run, i.e. fp32 params,
grads and Adam states, bf16 compute on CUDA, fp32 on CPU), with the backend's own model build and activation
checkpointing. It records works / OOM (`torch.OutOfMemoryError` is caught, memory freed, the sweep goes on), peak
memory (`torch.cuda.max_memory_allocated`) and tokens/s per GPU. Per (cp, AC) cell the lengths double from
`start_len`; once two trials have trained, the linear fit of peak memory against L predicts the limit and the
next probe goes there (peak memory is linear in L: flex attention keeps no `[T, T]` buffer); then the limit is
bracketed to `resolution` tokens, guessing and bisecting in turn. `time_budget_s` bounds the sweep (each cell
gets an even share of what is left; a trial the step-time fit says would overrun is not started) and `max_len`
the lengths.

Under `torchrun --nproc_per_node N` every cell is real: N processes (GPUs), FSDP sharded over all of them,
cpK = dp N/K x cp K through the backend's own CP path, every DP rank training its own sequence of the probed
length. The ranks agree on each trial (it works only if it works on every rank; the peak and the step time are
the largest rank's) and on the clock, so they probe the same lengths in the same order. Their work is symmetric
(equal tokens per rank), so they run out of memory at the same step; the process group's timeout
(`DIST_TIMEOUT_MIN`) ends a sweep where one rank alone did and its peer waits in a collective.

    torchrun --nproc_per_node 2 -m rlbench.experiments.cp_oom --preset qwen3-4b-shape --cp 1 2 --ac on

On one process, cp = 1 is the real run and cp > 1 is an EMULATION of one CP rank (`rlbench.distributed.cp_attention.EmulatedCP`):
the rank's zig-zag slice of the sequence runs through the CP attention path with the all-gather replaced by
local copies standing in for the peers' K/V, so the rank's activations, gathered K/V and logits have their real
sizes. Unlike a real CP rank it (a) holds the whole one-GPU FSDP state (a real rank shards it over dp x cp and
holds 1/cp of it: the emulated lengths are lower bounds), (b) spends no time and no memory on communication,
(c) attends over copies, not the pack's K/V (same kernel work: the block mask is the real one).

On CPU there is no allocator peak to read: the peak columns stay empty and nothing runs out of memory below
`max_len` unless a test plants a limit (`run_cp_oom(planted_oom=...)`); CPU runs check the machinery only.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlbench.algorithms.logprobs import token_logprobs
from rlbench.backends.fsdp.actor import FSDPBackend, kept_logits
from rlbench.configs.backend import FSDPOptions, OptimConfig, TrainConfig
from rlbench.distributed.cp_attention import CP_ATTN_NAME, CPContext, EmulatedCP, cp_attention_info
from rlbench.distributed.mesh import init_distributed
from rlbench.experiments.cp_oom_report import markdown, write_results
from rlbench.experiments.cp_oom_search import Cell, Trial, fit_limit, search_longest
from rlbench.packing.cp import cp_layout, cp_local_response, cp_slice, pad_for_cp
from rlbench.packing.pack import pack_samples
from rlbench.types import Sample

GIB = 2**30
BLOCK = 128  # flex block size: every rank's token count is padded to a multiple of it
LEAK_SLACK = 256 * 2**20  # bytes still allocated after an OOM's cleanup above which the backend is rebuilt
WARMUP_LENGTHS = (512, 1024)  # CUDA: untimed trials first, so flex's static and dynamic compiles are not timed
DIST_TIMEOUT_MIN = 3  # torchrun: a collective that waits this long (a peer died or ran out of memory alone) fails

PlantedOOM = Callable[[int, bool, int], bool]  # (cp, ac, response length) -> True: raise an OOM in that trial


@dataclass
class CPOOMConfig:
    """One sweep: a model shape, the (cp, AC) cells and the length search's bounds."""

    preset: str = "qwen3-4b-shape"
    """model preset (`rlbench.models.presets`), random init"""
    cps: tuple[int, ...] = (1, 2, 4)
    """context-parallel sizes; on one process cp > 1 is the one-rank emulation, under torchrun each divides the
    world (dp = world / cp)"""
    acs: tuple[bool, ...] = (True, False)
    """activation checkpointing settings, one table each"""
    device: str = "cuda"
    """"cuda" (bf16 compute, real OOMs) or "cpu" (fp32, machinery only)"""
    attn: str | None = None
    """attention of the cp = 1 run; None: "flex_attention" on CUDA, "sdpa" on CPU (cp > 1 runs rlbench_cp)"""
    prompt_len: int = 64
    """prompt tokens before the response"""
    start_len: int = 4096
    """first response length tried; lengths double from here"""
    max_len: int = 262144
    """longest response length tried"""
    resolution: int = 2048
    """the limit is bracketed to this many tokens; every probed length is a multiple of it"""
    time_budget_s: float = 1800.0
    """seconds for the whole sweep"""
    memory_gib: float | None = None
    """CUDA: cap the allocator at this many GiB (`set_per_process_memory_fraction`), e.g. 80 for an H100"""
    repeats: int = 1
    """training steps per trial; the last one is timed"""
    emulated_rank: int = 0
    """the CP rank cp > 1 emulates (zig-zag gives every rank the same token count and work)"""
    kv_head_chunk: int | None = None
    """CP attention: KV heads gathered at a time (None: all)"""
    cp_recompute: bool = False
    """CP attention: recompute each head chunk in backward instead of keeping the gathered K/V"""
    seed: int = 0
    """model init and token seed"""
    out: str = "runs/cp_oom"
    """directory of cp_oom_trials.csv, cp_oom_cells.csv and cp_oom.md"""

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device={self.device!r}; use 'cuda' or 'cpu'")
        if not self.cps or any(cp < 1 for cp in self.cps):
            raise ValueError(f"cps={self.cps}: give one or more context-parallel sizes >= 1")
        if not self.acs:
            raise ValueError("acs is empty: give activation checkpointing on, off or both")
        if self.resolution < 1 or self.start_len < self.resolution or self.max_len < self.start_len:
            raise ValueError(f"need 1 <= resolution={self.resolution} <= start_len={self.start_len} "
                             f"<= max_len={self.max_len}")
        if self.start_len % self.resolution or self.max_len % self.resolution:
            raise ValueError(f"start_len={self.start_len} and max_len={self.max_len} must be multiples of "
                             f"resolution={self.resolution}")
        if self.prompt_len < 1 or self.repeats < 1 or self.time_budget_s <= 0:
            raise ValueError(f"need prompt_len={self.prompt_len} >= 1, repeats={self.repeats} >= 1, "
                             f"time_budget_s={self.time_budget_s} > 0")
        if self.memory_gib is not None and (self.device != "cuda" or self.memory_gib <= 0):
            raise ValueError(f"memory_gib={self.memory_gib} caps the CUDA allocator; use it with device='cuda', > 0")
        if any(not 0 <= self.emulated_rank < cp for cp in self.cps):
            raise ValueError(f"emulated_rank={self.emulated_rank} must be < every cp in {self.cps}")

    @property
    def attn_implementation(self) -> str:
        return self.attn or ("flex_attention" if self.device == "cuda" else "sdpa")


# ---------------------------------------------------------------- one (cp, AC) cell on this process
def make_pack(cfg: CPOOMConfig, cp: int, response_len: int, vocab: int):
    """One sequence (prompt + response) laid out for `cp` ranks, each rank's share a multiple of BLOCK tokens."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + response_len)
    tokens = torch.randint(0, vocab, (cfg.prompt_len + response_len,), generator=g).tolist()
    pack = pack_samples([Sample(tokens=tokens, response_length=response_len)])
    return pad_for_cp(pack, cp, pad_multiple=BLOCK * cp)


def token_mean_loss(logp: torch.Tensor, entropy, inputs: dict) -> tuple[torch.Tensor, dict]:
    """`-sum(w * logp)` with `w = 1 / R` (one sequence: the token mean)."""
    return -(inputs["w"] * logp).sum(), {}


def emulated_forward_pack(backend: FSDPBackend, group: EmulatedCP, kv_head_chunk: int | None, recompute: bool):
    """A `forward_pack` for `backend` that runs rank `group.rank`'s part of a CP forward in this process.

    Like the backend's CP forward (the rank's zig-zag slice through rlbench_cp attention, its own response
    tokens scored), with the CP all-gather emulated (`EmulatedCP`) and the cross-rank sum of the `[R]` result
    left out: the peers' entries stay zero.
    """
    def forward_pack(model, pack, with_entropy: bool):
        dev, rank = backend.env.device, group.rank
        layout = cp_layout(pack, group.size)
        info = cp_attention_info(layout, rank, dev)
        tokens = cp_slice(pack.tokens, layout, rank).to(dev)  # [T/cp]
        positions = cp_slice(pack.position_ids, layout, rank).to(dev)  # [T/cp]
        ctx = CPContext(info, group, kv_head_chunk=kv_head_chunk, recompute=recompute)
        local_pos, resp_ids = cp_local_response(pack, layout, rank)  # [R_r]
        logits = kept_logits(model, local_pos.to(dev), input_ids=tokens[None], position_ids=positions[None], rl_cp=ctx)
        targets = pack.tokens[layout.indices[rank][local_pos] + 1].to(dev)  # [R_r]
        logp, ent = token_logprobs(logits, targets, backend.temperature,
                                   chunk_size=backend.cfg.logprob_chunk_size, with_entropy=with_entropy)
        R, resp_ids = int(pack.response_index.numel()), resp_ids.to(dev)

        def full(x):  # [R_r] -> [R]
            return x.new_zeros(R).index_copy(0, resp_ids, x)

        return full(logp), (full(ent) if ent is not None else None)

    return forward_pack


class CellRunner:
    """A backend built for one (cp, AC) cell; `probe(L)` trains one step at response length L."""

    def __init__(self, cfg: CPOOMConfig, cp: int, ac: bool, planted_oom: PlantedOOM | None = None, world: int = 1):
        self.cfg, self.cp, self.ac, self.planted_oom, self.world = cfg, cp, ac, planted_oom, world
        self.cuda = cfg.device == "cuda"
        self.backend = self._build()
        self.state_bytes = self._agree([torch.cuda.memory_allocated()], dist.ReduceOp.MAX)[0] if self.cuda else None

    def _build(self) -> FSDPBackend:
        cfg = self.cfg
        fsdp = TrainConfig(model=cfg.preset, device=cfg.device, param_dtype="bf16" if self.cuda else "fp32", seed=cfg.seed, cp_size=self.cp if self.world > 1 else 1, optim=OptimConfig(lr=1e-6), fsdp=FSDPOptions(attn_implementation=cfg.attn_implementation, gradient_checkpointing=self.ac, compile=False))  # compiled layers would recompile per length
        backend = FSDPBackend(fsdp, loss_fn=token_mean_loss)
        backend.init()
        if self.cp > 1 and self.world == 1:  # importing cp_attention (above) registered the rlbench_cp attention
            backend.model.config._attn_implementation = CP_ATTN_NAME
            group = EmulatedCP(self.cp, cfg.emulated_rank)
            backend.forward_pack = emulated_forward_pack(backend, group, cfg.kv_head_chunk, cfg.cp_recompute)
        return backend

    def probe(self, response_len: int) -> Trial:
        pack = make_pack(self.cfg, self.cp, response_len, self.backend.hf_config.vocab_size)
        R, dp = int(pack.response_index.numel()), max(1, self.world // self.cp)
        inputs = {"w": torch.full((R,), 1.0 / (R * dp))}  # the token mean over the dp ranks' sequences
        planted = self.planted_oom is not None and self.planted_oom(self.cp, self.ac, response_len)

        def loss_fn(logp, entropy, inp):
            if planted:  # after the forward, so the recovery from a half-done step is exercised
                raise torch.OutOfMemoryError(f"planted OOM at cp={self.cp}, ac={self.ac}, L={response_len}")
            return token_mean_loss(logp, entropy, inp)

        self._sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        metrics, step_s = None, None
        try:
            for _ in range(self.cfg.repeats):
                t0 = time.perf_counter()
                metrics = self.backend.train([pack], [inputs], loss_fn=loss_fn)
                self._sync()
                step_s = time.perf_counter() - t0
        except torch.OutOfMemoryError:
            metrics = None
        peak = torch.cuda.max_memory_allocated() / GIB if self.cuda else -1.0
        # every rank's verdict: works only where it worked on all; the largest rank's peak and step time
        failed, peak, step = self._agree([float(metrics is None), peak, step_s or 0.0], dist.ReduceOp.MAX)
        works = not failed
        if not works:
            self._recover()
        return Trial(self.cp, self.ac, response_len, pack.num_tokens, pack.num_tokens // self.cp, works,
                     peak if peak >= 0 else None, step if works else None,
                     metrics["train/loss"] if works else None, metrics["train/grad_norm"] if works else None,
                     world=self.world)

    def _agree(self, values: list[float], op) -> list[float]:
        """`values` reduced with `op` over the run's ranks (as they are on one process)."""
        return values if self.world == 1 else _across_ranks(values, self.backend.env.device, op)

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _recover(self) -> None:
        """Free what an OOM left (the half-done step's tensors, FSDP's gathered params); rebuild if that fails."""
        from torch.distributed.fsdp import FSDPModule

        for module in self.backend.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        self.backend.model.zero_grad(set_to_none=True)
        gc.collect()
        if not self.cuda:
            return
        torch.cuda.empty_cache()
        leaked = self._agree([float(torch.cuda.memory_allocated() > self.state_bytes + LEAK_SLACK)], dist.ReduceOp.MAX)
        if leaked[0]:  # on every rank together: the build's collectives need all of them
            self.close()
            self.backend = self._build()

    def close(self) -> None:
        self.backend = None
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


# ---------------------------------------------------------------- the sweep
def run_cp_oom(cfg: CPOOMConfig, planted_oom: PlantedOOM | None = None) -> list[Cell]:
    """Search every (AC, cp) cell in order, write the CSVs and the markdown under `cfg.out`, return the cells."""
    if cfg.device == "cuda":
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)  # never eager flex
    created = not dist.is_initialized()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    clock, main_rank = time.monotonic, True
    if world > 1:  # torchrun: real ranks, one process group for every cell's backend
        if any(world % cp for cp in cfg.cps):
            raise ValueError(f"cps={cfg.cps}: under torchrun every cp must divide the world size {world}")
        env = init_distributed(cfg.device, timeout_minutes=DIST_TIMEOUT_MIN)
        clock, main_rank = functools.partial(_rank0_clock, env.device), env.rank == 0
    capacity = _capacity_gib(cfg)
    if world > 1 and capacity is not None:  # the search's memory fit: the same capacity on every rank
        capacity = _across_ranks([capacity], env.device, dist.ReduceOp.MIN)[0]
    cells: list[Cell] = []
    end = clock() + cfg.time_budget_s
    todo = [(cp, ac) for ac in cfg.acs for cp in cfg.cps]
    try:
        for i, (cp, ac) in enumerate(todo):
            t0 = clock()
            if t0 >= end:  # budget spent: the cell stays unsearched (not even built)
                cells.append(Cell(cp, ac, 0, None, False, None, None, 0.0, world=world))
                continue
            runner = CellRunner(cfg, cp, ac, planted_oom, world)
            if cfg.device == "cuda":
                for n in WARMUP_LENGTHS:
                    runner.probe(n)
            now = clock()
            deadline = now + max(0.0, end - now) / (len(todo) - i)  # an even share of what is left, build excluded

            def probe(n: int, runner=runner) -> Trial:
                trial = runner.probe(n)
                if main_rank:
                    print(_trial_line(trial), flush=True)
                return trial

            lo, hi, complete, trials = search_longest(
                probe, start=cfg.start_len, max_len=cfg.max_len, resolution=cfg.resolution, capacity_gib=capacity,
                deadline=deadline, clock=clock)
            state = runner.state_bytes / GIB if runner.state_bytes is not None else None
            runner.close()
            cells.append(Cell(cp, ac, lo, hi, complete, fit_limit(trials, capacity, cfg.resolution), state,
                              clock() - t0, trials, world=world))
            if main_rank:
                write_results(cfg, cells, capacity)  # after every cell: a killed sweep keeps what it found
    finally:
        if cfg.memory_gib is not None:
            torch.cuda.set_per_process_memory_fraction(1.0)
        if created and dist.is_initialized():
            dist.destroy_process_group()
    if main_rank:
        print(markdown(cfg, cells, capacity), flush=True)
    return cells


def _across_ranks(values: list[float], device: torch.device, op=None) -> list[float]:
    """`values` reduced with `op` over the ranks, or rank 0's (op None): numbers every rank decides by."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if op is None:
        dist.broadcast(t, src=0)
    else:
        dist.all_reduce(t, op=op)
    return t.tolist()


def _rank0_clock(device: torch.device) -> float:
    """Rank 0's `time.monotonic()` on every rank: the ranks' time-budget decisions (which length next, whether
    one more trial fits) are then the same, and so are their collectives."""
    return _across_ranks([time.monotonic()], device)[0]


def _capacity_gib(cfg: CPOOMConfig) -> float | None:
    """What the allocator may hold: the cap, or the device's free memory plus what torch already holds."""
    if cfg.device != "cuda":
        return None
    torch.cuda.empty_cache()  # what earlier work in this process cached would count against a cap
    free, total = torch.cuda.mem_get_info()
    if cfg.memory_gib is not None:
        torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.memory_gib * GIB / total))
        return cfg.memory_gib
    return (free + torch.cuda.memory_reserved()) / GIB


def _trial_line(t: Trial) -> str:
    peak = f" peak {t.peak_gib:.2f} GiB" if t.peak_gib is not None else ""
    speed = f" {t.step_s:.2f} s {t.tokens_per_s_per_gpu:.0f} tok/s/GPU" if t.works else ""
    return f"[cp-oom] cp{t.cp}{' emulated' if t.emulated else ''} ac={'on' if t.ac else 'off'} " \
           f"L={t.response_len}: {'works' if t.works else 'OOM'}{peak}{speed}"


# ---------------------------------------------------------------- CLI
def parse_args(argv: list[str] | None = None) -> CPOOMConfig:
    d = CPOOMConfig()
    p = argparse.ArgumentParser(prog="rlbench experiment cp-oom", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default=d.preset)
    p.add_argument("--cp", type=int, nargs="+", default=list(d.cps),
                   help="context-parallel sizes (one process: cp > 1 emulated; torchrun: real, dividing the world)")
    p.add_argument("--ac", choices=["on", "off"], nargs="+", default=["on", "off"], help="activation checkpointing")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--attn", default=None, help="cp=1 attention (default flex_attention on CUDA, sdpa on CPU)")
    p.add_argument("--prompt-len", type=int, default=d.prompt_len)
    p.add_argument("--start-len", type=int, default=d.start_len)
    p.add_argument("--max-len", type=int, default=d.max_len)
    p.add_argument("--resolution", type=int, default=d.resolution)
    p.add_argument("--time-budget", type=float, default=d.time_budget_s, help="seconds for the whole sweep")
    p.add_argument("--memory-gib", type=float, default=None, help="cap the CUDA allocator (e.g. 80 for an H100)")
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--rank", type=int, default=d.emulated_rank, help="the CP rank cp > 1 emulates")
    p.add_argument("--kv-head-chunk", type=int, default=None)
    p.add_argument("--cp-recompute", action="store_true")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default=d.out)
    a = p.parse_args(argv)
    return CPOOMConfig(
        preset=a.preset, cps=tuple(a.cp), acs=tuple(x == "on" for x in a.ac), device=a.device, attn=a.attn,
        prompt_len=a.prompt_len, start_len=a.start_len, max_len=a.max_len, resolution=a.resolution,
        time_budget_s=a.time_budget, memory_gib=a.memory_gib, repeats=a.repeats, emulated_rank=a.rank,
        kv_head_chunk=a.kv_head_chunk, cp_recompute=a.cp_recompute, seed=a.seed, out=a.out)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    if cfg.device == "cpu":
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    run_cp_oom(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
