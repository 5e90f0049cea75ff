"""TrainConfig.cp_attention="ring_flash_llama3": rlbench's glue around ring-flash-attn's llama3 varlen kernel, on CPU.

flash-attn has no CPU build, so the kernel module is a stand-in (tests/ring_flash_stub/ring_flash_attn: the
prepare function's algorithm rewritten from the real source, the varlen function as SDPA over K/V all-gathered
on gloo; its docstring says what it does and does not cover). rlbench loads it as it loads the real package
(file on the path, package __init__ skipped), so these tests check:

- the context built from a contiguous layout: cu_seqlens_q/k, max_seqlen_q/k and local_k_slice for known slots
  (one sequence straddling the chunk border, one border on a slot boundary), consistent with rlbench's layout;
- the clear ImportError naming the pip packages (no package; package without flash_attn), raised by
  `FSDPBackend.init()`, and the config's validation;
- FSDPBackend at cp=2 (2 gloo processes; all KV heads per gather, and heads_k_stride=1) against the one-process
  cp=1 run on the same packs: log-probs, loss/metrics, parameters after a step, CP peers identical.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import free_port, spawn
from test_cp_train import _per_sample, _snapshot, full_response_loss, loss_inputs, make_samples, rel

from rlbench.packing import cp_layout, pack_samples, pad_for_cp
from rlbench.types import Sample

STUB = str(Path(__file__).parent / "ring_flash_stub")
LR, EPS = 0.1, 1.0
RUNS = {1: ["cp1"], 2: ["ring", "ring_stride1"]}


@pytest.fixture
def fresh_loader(monkeypatch):
    """`load_ring_flash_attn` with an empty cache; undoes the private package it imports."""
    from rlbench.distributed import ring_flash

    monkeypatch.setattr(ring_flash, "_loaded", [])
    yield ring_flash
    for name in [n for n in sys.modules if n.startswith(ring_flash._PRIVATE_PACKAGE)]:
        del sys.modules[name]


def known_pack():
    """Slots [0, 7, 20, 25, 32] (no pad): at cp=2 the border 16 falls inside the 13-token sequence."""
    samples = [Sample(tokens=list(range(1, n + 1)), response_length=n - 2) for n in (7, 13, 5, 7)]
    return pack_samples(samples)


def test_context_from_a_contiguous_layout(fresh_loader, monkeypatch):
    monkeypatch.syspath_prepend(STUB)
    layout = cp_layout(known_pack(), 2, zigzag=False)
    assert layout.cu_seqlens.tolist() == [0, 7, 20, 25, 32]
    ctx0 = fresh_loader.ring_flash_context(layout, 0, None)
    ctx1 = fresh_loader.ring_flash_context(layout, 1, None, heads_k_stride=1)
    assert (ctx0.cu_seqlens_q.tolist(), ctx0.cu_seqlens_k.tolist()) == ([0, 7, 16], [0, 7, 16])
    assert (ctx0.max_seqlen_q, ctx0.max_seqlen_k, ctx0.local_k_slice) == (9, 9, slice(0, 16))
    # rank 1 starts inside the 13-token sequence: its keys start at that sequence's start (global 7)
    assert (ctx1.cu_seqlens_q.tolist(), ctx1.cu_seqlens_k.tolist()) == ([0, 4, 9, 16], [0, 13, 18, 25])
    assert (ctx1.max_seqlen_q, ctx1.max_seqlen_k, ctx1.local_k_slice) == (7, 13, slice(7, 32))
    assert (ctx0.heads_k_stride, ctx1.heads_k_stride) == (None, 1)
    assert ctx1.cu_seqlens_q.dtype == torch.int32
    for r, ctx in enumerate((ctx0, ctx1)):  # the kernel's query slots are rlbench's local slot boundaries
        assert ctx.cu_seqlens_q.tolist() == torch.unique(layout.local_cu_seqlens[r]).tolist()
        assert layout.indices[r].tolist() == list(range(16 * r, 16 * r + 16))


def test_context_refuses_a_zigzag_layout(fresh_loader, monkeypatch):
    monkeypatch.syspath_prepend(STUB)
    zigzag = cp_layout(pad_for_cp(known_pack(), 2), 2)
    with pytest.raises(ValueError, match="contiguous CP chunks"):
        fresh_loader.ring_flash_context(zigzag, 0, None)


def test_missing_packages_name_the_pip_packages(fresh_loader, monkeypatch, tmp_path):
    with pytest.raises(ImportError, match="pip install flash-attn ring-flash-attn"):
        fresh_loader.load_ring_flash_attn()
    package = tmp_path / "ring_flash_attn"  # ring-flash-attn installed, flash-attn not
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "llama3_flash_attn_varlen.py").write_text("import flash_attn.flash_attn_interface\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match=r"pip install flash-attn ring-flash-attn.*No module named 'flash_attn'"):
        fresh_loader.load_ring_flash_attn()
    assert fresh_loader._PRIVATE_PACKAGE not in sys.modules  # a failed load leaves nothing half-imported


def test_config_validates_the_cp_attention():
    from rlbench.configs.backend import FSDPOptions, TrainConfig

    cfg = TrainConfig(device="cuda", cp_size=2, fsdp=FSDPOptions(cp_attention="ring_flash_llama3"))
    assert (cfg.fsdp.cp_attention, cfg.attention, cfg.compiled) == ("ring_flash_llama3", "flex_attention", False)
    assert TrainConfig(device="cpu", cp_size=2).fsdp.cp_attention == "allgather"
    with pytest.raises(ValueError, match="cp_attention='ring'; use one of"):
        TrainConfig(device="cuda", cp_size=2, fsdp=FSDPOptions(cp_attention="ring"))
    with pytest.raises(ValueError, match="needs device='cuda'"):
        TrainConfig(device="cpu", cp_size=2, fsdp=FSDPOptions(cp_attention="ring_flash_llama3"))
    with pytest.raises(ValueError, match="bf16/fp16 only"):
        TrainConfig(device="cuda", cp_size=2, param_dtype="fp32", fsdp=FSDPOptions(cp_attention="ring_flash_llama3"))
    with pytest.warns(UserWarning, match="no effect with cp_size=1"):
        TrainConfig(device="cuda", fsdp=FSDPOptions(cp_attention="ring_flash_llama3"))
    with pytest.warns(UserWarning, match="cp_recompute has no effect"):
        TrainConfig(device="cuda", cp_size=2, fsdp=FSDPOptions(cp_recompute=True, cp_attention="ring_flash_llama3"))


def test_the_allgather_kernel_slices_zigzag():  # the registry equals the config's names: tests/test_registries.py
    from rlbench.distributed import cp_kernels

    assert cp_kernels.cp_kernel("allgather").zigzag is True


def make_packs(samples, cp: int) -> list:
    """Pack 0: 31 tokens, contiguous-padded to 48 (a trailing pad slot; the border 24 cuts a sequence);
    pack 1: 47 tokens, plain (the backend pads it to 48; the border 24 is a slot boundary)."""
    first = pack_samples(samples, [0, 2, 4, 6], pad_token_id=3)
    first = pad_for_cp(first, cp, zigzag=False, pad_multiple=24) if cp > 1 else first
    return [first, pack_samples(samples, [1, 3, 5, 7], pad_token_id=3)]


def ring_config(cp: int, **kw):
    """An fp32 CPU config with the ring kernel: set after validation, which (rightly) asks for CUDA and bf16."""
    from rlbench.configs.backend import FSDPOptions, OptimConfig, TrainConfig

    cfg = TrainConfig(model="tiny", device="cpu", param_dtype="fp32", cp_size=cp, with_entropy=True,
                      optim=OptimConfig(lr=LR, eps=EPS, clip_grad=100.0), fsdp=FSDPOptions(**kw))
    if cp > 1:
        cfg.fsdp.cp_attention = "ring_flash_llama3"
    return cfg


def _worker(rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK="0")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from rlbench.backends.fsdp.actor import FSDPBackend
    from rlbench.distributed import init_distributed

    res: dict = {}
    if world == 2:  # no package on the path yet: init fails before any process group or model is built
        try:
            FSDPBackend(ring_config(2)).init()
            res["init_error"] = "no error"
        except ImportError as exc:
            res["init_error"] = str(exc)
        sys.path.insert(0, STUB)
    samples = make_samples()
    for run in RUNS[world]:
        env = init_distributed("cpu", cp_size=world)
        b = FSDPBackend(ring_config(world, **({"cp_kv_head_chunk": 1} if run == "ring_stride1" else {})), env=env,
                        loss_fn=full_response_loss)
        b.init()
        packs = make_packs(samples, world)
        inputs = [loss_inputs(samples, p) for p in packs]
        out = {"attn": b.model.config._attn_implementation, "logp0": _per_sample(packs, b.compute_log_prob(packs))}
        out["step1"] = b.train(packs, inputs)
        out["params1"] = _snapshot(b)
        out["logp1"] = _per_sample(packs, b.compute_log_prob(packs))
        res[run] = out
    torch.save(res, os.path.join(root, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out: dict = {}
    for world in RUNS:
        root = str(tmp_path_factory.mktemp(f"ring{world}"))
        spawn(_worker, args=(world, free_port(), root), nprocs=world)
        ranks = [torch.load(os.path.join(root, f"rank{r}.pt")) for r in range(world)]
        out.update({k: [r[k] for r in ranks] for k in ranks[0]})
    return out


def test_backend_init_raises_the_clear_import_error(results):
    for error in results["init_error"]:
        assert "needs the packages flash-attn and ring-flash-attn" in error
        assert "pip install flash-attn ring-flash-attn" in error


@pytest.mark.parametrize("run", ["ring", "ring_stride1"])
def test_ring_cp2_matches_cp1(results, run):
    ref = results["cp1"][0]
    ranks = results[run]
    for r in ranks:
        assert r["attn"] == "rlbench_ring_flash_llama3"
        for key in ("logp0", "logp1"):
            assert set(r[key]) == set(range(8))
            for sid, v in r[key].items():
                assert v.shape == ref[key][sid].shape
                assert rel(v, ref[key][sid]) <= 1e-6, (key, sid)
        for k in ("train/loss", "train/pg_loss", "train/seq_term", "train/entropy", "train/grad_norm"):
            assert abs(r["step1"][k] - ref["step1"][k]) <= 1e-6 * abs(ref["step1"][k]), (k, r["step1"][k])
        worst = max(rel(r["params1"][n], ref["params1"][n]) for n in ref["params1"])
        assert worst <= 1e-5, worst
    assert all(torch.equal(ranks[1]["params1"][n], ranks[0]["params1"][n]) for n in ref["params1"])


def test_cli_flag_sets_the_cp_attention():
    from rlbench.cli import build_parser, preset_config

    argv = ["train", "--backend", "ray", "--actor-num-gpus-per-node", "2", "--context-parallel-size", "2",
            "--cp-attention", "ring_flash_llama3", "--device", "cuda", "--param-dtype", "bf16"]
    cfg = preset_config(build_parser().parse_args(argv))
    assert (cfg.backend.cp_size, cfg.backend.fsdp.cp_attention, cfg.backend.device) == (2, "ring_flash_llama3", "cuda")
