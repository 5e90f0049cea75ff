"""Host side of the batch-1 decode megakernel: every decoder layer of one token by kernels that stream the weights.

Why: at batch 1 the 0.6B shape reads 30 MB of weights per layer, 7 us at HBM speed, but the compiled step spends
~9 kernels per layer at >= 2 us of launch and ramp each. Here a layer is five stages (`triton_stages.py`), each
cut into tasks of about equal bytes, one per SM for the GEMVs, and each program issues its next weights (or K/V)
BEFORE it waits for the previous stage. How the stages wait for each other is `DecodeMegakernel.stage_sync`:
  "pdl"      a kernel per stage with programmatic dependent launch (sm_90+, the default there): a stage's
             programs start, and issue their weight loads, as soon as an SM frees; the wait returns soon after
             the previous stage's last program ends. The attention partials are merged by a sixth, small kernel
             (one 1-warp program per q head). 168 launches per step, captured in the step's CUDA graph.
  "barrier"  one persistent kernel over all layers, grid barriers between stages; every program must be
             resident at once (the GPU to itself). The default where PDL is missing.
  "launch"   a kernel per stage in plain stream order (what the interpreter runs for the per-stage kernels).
"pdl" and "launch" run the same kernels and give the same bits; "barrier" merges the attention partials with
a ticket in its attention stage (another summation order).

With a per-stage sync the GEMV stages whose tile fits shared memory run as Gluon kernels (`gluon_gemv.py`,
`gluon_gemv`): their tile lands in shared memory, not registers, so that the next stage's programs share the SM
and stream their tiles a stage ahead; with them, the attention stage runs in Gluon too (`gluon_attend.py`:
per-warp online softmax on the tensor cores, no CTA barrier per block). The settings the product never changes
are constants in `layout.py`, read at each call. On the CPU it runs under Triton's interpreter with one program
(tests); `rlbench.engine.megakernel.build` decides where it runs.
"""

from __future__ import annotations

import math
import os
import warnings

import torch

from rlbench.configs.engine import STAGE_SYNC
from rlbench.engine.megakernel import layout


def gluon_available(device: torch.device) -> bool:
    """Whether the Gluon GEMV stages can run here: a CUDA sm_90+ GPU (TMA) and a Triton with Gluon's Hopper API
    (never under Triton's interpreter, which does not run Gluon)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if torch.cuda.get_device_capability(device)[0] < 9:
        return False
    try:
        from triton.experimental.gluon.language.nvidia.hopper import tma  # noqa: F401
    except ImportError:
        return False
    return True


def default_stage_sync(device: torch.device) -> str:
    """"pdl" on a GPU with programmatic dependent launch (sm_90+), else "barrier" (also under the interpreter)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9:
        return "pdl"
    return "barrier"


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def _tiling(n_rows: int, k: int, programs: int, stacked: int = 1) -> tuple[int, int, int, int]:
    """(rows per task, row block, K block, pipeline stages) so that `n_rows` split over `programs` tasks of ~equal
    bytes; tiles of PIPELINE_MIN_CHUNKS or more K chunks go through the cp.async pipeline (PIPELINE_STAGES)."""
    rows = math.ceil(n_rows / programs)
    block = pow2(rows)
    if block * stacked * pow2(k) <= 2 * layout.TILE_ELEMS:  # one chunk in the registers of a double buffer
        return rows, block, pow2(k), 1
    bk = max(16, layout.TILE_ELEMS // (block * stacked))
    return rows, block, bk, layout.PIPELINE_STAGES if math.ceil(k / bk) >= layout.PIPELINE_MIN_CHUNKS else 1


def mma_tile_split(chunk_rows: int) -> int | None:
    """A tensor-core Gluon tile of `chunk_rows` rows of [8 chunks, 64] lives in two shared buffers of power-of-two
    sizes (Gluon's layouts need them): the first one's size, or None when the rest is not a power of two either."""
    lo = 1 << (chunk_rows.bit_length() - 1)
    rest = chunk_rows - lo
    return lo if rest == 0 or rest == pow2(rest) else None


def _mma_tile_rows(stacked: int, rows: int, k: int) -> int:
    """Rows of [8 chunks, 64] in a tensor-core Gluon tile of `stacked * rows` weight rows of K."""
    return stacked * rows * k // (layout.MMA_SLICES * layout.MMA_CHUNK)


def unsupported(model: torch.nn.Module, layers: list | None, device: torch.device) -> str | None:
    """Why the megakernel cannot run this model here (None when it can)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "not on CUDA (on the CPU only under Triton's interpreter, TRITON_INTERPRET=1)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if not layers:
        return "no fused layers (fused_weights=False or an architecture fused.py does not reproduce)"
    w = layers[0]
    if w.qkv.dtype != torch.bfloat16:
        return f"weights are {w.qkv.dtype}, the kernel reads bfloat16"
    if any(x is not None for x in (w.o_bias, w.gate_up_bias, w.down_bias)):
        return "o_proj/MLP biases are not implemented"
    hd = w.o.shape[1] // model.config.num_attention_heads
    if hd != pow2(hd):
        return f"head_dim={hd} is not a power of two"
    if model.config.num_attention_heads // model.config.num_key_value_heads > 16:
        return "more than 16 q heads per KV head (an attention task holds one group in 16 rows)"
    return None


class DecodeMegakernel:
    """Scratch buffers, tiling and the per-layer pointer table for one model and one KV cache; a call runs every
    decoder layer for one token."""

    def __init__(self, model: torch.nn.Module, layers: list, max_seq_len: int, device: torch.device,
                 programs: int | None = None, tile_programs: int | None = None):
        """`programs`: the grid (default: the SM count; 1 on the CPU). `tile_programs`: the grid the GEMV tiles
        are cut for (default `programs`; tests run a GPU's tiling with one interpreted program)."""
        c = model.config
        self.h, self.n_kv = c.num_attention_heads, c.num_key_value_heads
        self.d, self.i = c.hidden_size, c.intermediate_size
        self.hd = layers[0].o.shape[1] // self.h
        self.group = self.h // self.n_kv
        self.eps, self.scale = layers[0].eps, layers[0].scale
        self.has_bias, self.has_qk_norm = layers[0].qkv_bias is not None, layers[0].q_norm is not None
        if programs is None:
            programs = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        self.programs = programs
        tiles = tile_programs or programs
        qkv_rows = (self.h + 2 * self.n_kv) * self.hd
        self.t_qkv = _tiling(qkv_rows, self.d, tiles)
        self.t_o = _tiling(self.d, self.h * self.hd, tiles)
        self.t_gu = _tiling(self.i, self.d, tiles, stacked=2)
        self.t_dn = _tiling(self.d, self.i, tiles)
        self.max_splits = math.ceil(max_seq_len / layout.SPLIT)
        bg = pow2(self.group)
        f32, bf16 = dict(dtype=torch.float32, device=device), dict(dtype=torch.bfloat16, device=device)
        self.qkv = torch.empty(qkv_rows, **bf16)
        self.attn = torch.empty(self.h * self.hd, **bf16)
        self.act = torch.empty(self.i, **bf16)
        self.part_acc = torch.empty(self.n_kv * self.max_splits * bg * self.hd, **f32)
        self.part_m = torch.empty(self.n_kv * self.max_splits * bg, **f32)
        self.part_l = torch.empty(self.n_kv * self.max_splits * bg, **f32)
        self.sync = torch.zeros(1 + c.num_hidden_layers * self.n_kv, dtype=torch.int32, device=device)
        self.err = torch.zeros(1, dtype=torch.int32, device=device)
        self.table = torch.zeros(c.num_hidden_layers, len(layout.TABLE), dtype=torch.int64, device=device)
        self.head_stride = 0
        self._bound: tuple = ()
        self._layers: list = []
        self._caches: list = []
        self._descs: list = []
        self._carved: set = set()
        self.bf16_dot = device.type == "cuda"  # the interpreter multiplies bf16 dot operands as raw integers
        self.stage_sync = default_stage_sync(device)
        """How a stage waits for the previous one (STAGE_SYNC, `MegakernelConfig.sync`): "pdl", "barrier" or
        "launch" (see the module docstring). Default: "pdl" where the GPU has it, else "barrier"."""
        self.gluon_gemv = gluon_available(device)
        """Run the GEMV stages whose tile fits shared memory (`gluon_plan`) as `gluon_gemv.gemv_stage` kernels
        instead of the Triton stage kernels, with a per-stage sync ("pdl" / "launch") only (`MegakernelConfig.gluon`;
        default: where Gluon's Hopper TMA is available, sm_90+)."""

    def bind(self, layers: list, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor]) -> bool:
        """Point the table at these weights and caches (cheap when nothing moved; not inside a graph capture).
        Returns whether anything moved: CUDA graphs captured before hold the Gluon stages' TMA descriptors of the
        old addresses as kernel parameters (the Triton stages read the table, which is updated in place)."""
        rows = []
        for w, kc, vc in zip(layers, k_cache, v_cache):
            tensors = [getattr(w, c) for c in layout.TABLE[:-2]] + [kc, vc]  # absent (None) columns are never read
            rows.append([(w.qkv if t is None else t).data_ptr() for t in tensors])
        key = (tuple(map(tuple, rows)), k_cache[0].stride(1))  # every address: any tensor may have moved
        if key == self._bound:
            return False
        odd = [(i, layout.TABLE[j]) for i, row in enumerate(rows) for j, p in enumerate(row) if p % 16]
        if odd:  # the kernel declares every table address 16-byte aligned (vector loads)
            raise ValueError(f"megakernel: layer {odd[0][0]}'s {odd[0][1]} tensor is not 16-byte aligned (a view "
                             "at an odd offset?); use contiguous, separately allocated weights or megakernel=False")
        self.table.copy_(torch.tensor(rows, dtype=torch.int64))
        self.head_stride = k_cache[0].stride(1)
        self._bound = key
        self._layers, self._descs = list(layers), []
        self._caches = list(zip(k_cache, v_cache))
        return True

    def unbind(self) -> None:
        """Forget the bound weights (their tensors and TMA descriptors), so that their memory can be freed
        (`sleep(release_weights=True)`); the next `bind` binds afresh."""
        self._layers, self._descs, self._bound, self._caches = [], [], (), []

    def gluon_plan(self) -> dict[int, tuple[int, int, int, int]]:
        """The GEMV stages `gluon_gemv.gemv_stage` can run: stage -> (N, K, rows per program, KCP: K // BOX_K
        rounded up to a power of two). A stage needs K a multiple of 1,024 (an input load of [16, 64]), its tile
        (plus the input) within GLUON_TILE_BYTES and in two power-of-two buffers (`mma_tile_split`); the others
        keep the Triton stage kernel."""
        dims = {0: ((self.h + 2 * self.n_kv) * self.hd, self.d, 1), 2: (self.d, self.h * self.hd, 1),
                3: (self.i, self.d, 2), 4: (self.d, self.i, 1)}
        plan = {}
        for stage, (n, k, stacked) in dims.items():
            r = math.ceil(math.ceil(n / self.programs) / layout.BOX_ROWS) * layout.BOX_ROWS
            kcp = pow2(k // layout.BOX_K)
            if (k % (layout.MMA_IN * layout.MMA_CHUNK) == 0
                    and (stacked * r + 1) * k * 2 <= layout.GLUON_TILE_BYTES
                    and mma_tile_split(_mma_tile_rows(stacked, r, k)) is not None):
                plan[stage] = (n, k, r, kcp)
        return plan

    def gluon_lo(self, stage: int, plan: tuple | None = None) -> int:
        """`gluon_gemv.gemv_stage`'s LO for a planned stage (`plan`: its `gluon_plan` entry): rows of [8 chunks, 64]
        in the first tile buffer (`mma_tile_split`)."""
        n, k, r, _ = plan or self.gluon_plan()[stage]
        return mma_tile_split(_mma_tile_rows(2 if stage == 3 else 1, r, k))

    def gluon_active(self) -> dict[int, tuple[int, int, int, int]]:
        """The stages the next call runs in Gluon (`gluon_plan`; none unless `gluon_gemv` and a per-stage sync)."""
        if not self.gluon_gemv or self.stage_sync == "barrier":
            return {}
        return self.gluon_plan()

    def gluon_attention_active(self) -> bool:
        """Whether the next call runs the Gluon attention stage: GLUON_ATTENTION, Gluon GEMV stages active (their
        kernels' shared-memory carveout is the one the attention program needs, 69 KB), and shapes it handles: a
        KV group of at most 8 q heads, a power-of-two head size (multiple of 8) and 16-byte aligned cache rows."""
        return (layout.GLUON_ATTENTION and bool(self.gluon_active()) and self.group <= layout.ATTENTION_ROWS // 2
                and self.hd == pow2(self.hd) and self.hd % 8 == 0 and self.head_stride % 8 == 0)

    def _gluon_descs(self) -> list[dict]:
        """Per layer, the TMA descriptors of the planned stages' weights (built once per bind)."""
        if not self._descs:
            from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

            from rlbench.engine.megakernel.gluon_gemv import mma_box_layout

            names = {0: "qkv", 2: "o", 3: "gate_up", 4: "down"}

            def desc(weight: torch.Tensor):
                rows, k = weight.shape  # viewed as [K / 512 blocks, rows, 8 chunks, 64]
                c, s = layout.MMA_CHUNK, layout.MMA_SLICES
                return TensorDescriptor(weight, [k // (s * c), rows, s, c], [s * c, weight.stride(0), c, 1],
                                        [1, layout.MMA_BOX_ROWS, s, c], mma_box_layout())

            self._descs = [{s: desc(getattr(w, names[s])) for s in self.gluon_plan()} for w in self._layers]
        return self._descs

    def check(self) -> None:
        """Raise if a launch since the last check timed out at a grid barrier (its results are wrong)."""
        if int(self.err.item()):
            self.err.zero_()
            raise RuntimeError(
                f"the decode megakernel timed out at a grid barrier: not all {self.programs} programs were resident "
                "at once (another kernel holding SMs, or MPS/partitioning limiting them); the tokens of this "
                "generate are invalid. Run with TorchEngineConfig(megakernel=False).")

    def launch_args(self, hidden, cos, sin, positions) -> tuple[tuple, dict]:
        """`decode_layers`' runtime arguments and constexprs (also used to compile it offline in tests)."""
        (r_qkv, br_qkv, bk_qkv, st_qkv), (r_o, br_o, bk_o, st_o) = self.t_qkv, self.t_o
        (r_gu, br_gu, bk_gu, st_gu), (r_dn, br_dn, bk_dn, st_dn) = self.t_gu, self.t_dn
        args = (self.table, hidden, cos, sin, positions, self.qkv, self.attn, self.act, self.part_acc, self.part_m,
                self.part_l, self.sync, self.err, self.table.shape[0], self.eps, self.scale, self.head_stride,
                self.max_splits, r_qkv, r_o, r_gu, r_dn)
        consts = dict(D=self.d, H=self.h, NKV=self.n_kv, HD=self.hd, FFN=self.i, G=self.group,
                      BG=pow2(self.group), BD=pow2(self.d), SPLIT=layout.SPLIT, CS=layout.MERGE_CHUNK,
                      HAS_QKV_BIAS=self.has_bias, HAS_QK_NORM=self.has_qk_norm, BR_QKV=br_qkv, BK_QKV=bk_qkv,
                      BR_O=br_o, BK_O=bk_o, BR_GU=br_gu, BK_GU=bk_gu, BR_DN=br_dn, BK_DN=bk_dn,
                      ST_QKV=st_qkv, ST_O=st_o, ST_GU=st_gu, ST_DN=st_dn,
                      MAX_SPINS=layout.MAX_SPINS, BF16_DOT=self.bf16_dot)
        return args, consts

    def stage_args(self, hidden, cos, sin, positions, layer: int, attend: bool | None = None) -> tuple[tuple, dict]:
        """`decode_stage`'s runtime arguments for one layer, and its constexprs but STAGE and PDL. `attend`: whether
        the Gluon attention stage runs (None: `gluon_attention_active()`, ~40 us of host work; a call passes the
        value it computed once)."""
        args, consts = self.launch_args(hidden, cos, sin, positions)
        args = args[:12] + (layer,) + args[14:]  # no err / num_layers
        consts = {k: v for k, v in consts.items() if k != "MAX_SPINS"}
        attend = self.gluon_attention_active() if attend is None else attend
        consts["MIN_PER"] = layout.ATTENTION_MIN_BLOCKS if attend else 1  # the merge's grid is the attention's
        return args, consts

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
        """hidden `[1, 1, D]` (updated in place and returned), cos/sin `[1, 1, hd]`, positions `[1]` long."""
        from rlbench.engine.megakernel.triton_stages import decode_layers, decode_stage

        if self.stage_sync not in STAGE_SYNC:
            raise ValueError(f"stage_sync={self.stage_sync!r}: use one of {STAGE_SYNC}")
        if self.stage_sync == "pdl" and hidden.is_cuda and torch.cuda.get_device_capability(hidden.device)[0] < 9:
            raise ValueError("stage_sync='pdl' needs programmatic dependent launch (sm_90+); use 'barrier'")
        cos, sin = cos.contiguous(), sin.contiguous()
        if self.stage_sync == "barrier":
            self.sync.zero_()  # the grid barrier's counter and the attention merge's tickets
            args, consts = self.launch_args(hidden, cos, sin, positions)
            self._carve(decode_layers[(self.programs,)](*args, **consts, num_warps=layout.NUM_WARPS), layout.CARVEOUT)
            return hidden
        pdl = self.stage_sync == "pdl"
        plan = self.gluon_active()
        attend = self.gluon_attention_active()
        carveout = layout.GLUON_CARVEOUT if plan else layout.CARVEOUT
        for layer in range(self.table.shape[0]):
            args, consts = self.stage_args(hidden, cos, sin, positions, layer, attend)
            for stage in layout.STAGE_ORDER:
                first = layer == 0 and stage == 0  # follows the embedding: a plain launch (its wait is a no-op)
                if stage in plan:
                    self._gluon_stage(stage, layer, plan[stage], hidden, pdl and not first)
                    continue
                if stage == 1 and attend:
                    self._gluon_attend(layer, cos, sin, positions, pdl)
                    continue
                warps = layout.MERGE_WARPS if stage == 5 else layout.NUM_WARPS
                self._carve(decode_stage[(self.programs,)](*args, **consts, STAGE=stage, PDL=pdl, num_warps=warps,
                                                           launch_pdl=pdl and not first), carveout)
        return hidden

    def gluon_stage_consts(self, stage: int, plan: tuple | None = None) -> dict:
        """`gluon_gemv.gemv_stage`'s constexprs for a planned stage (`plan`: its `gluon_plan` entry; also used to
        compile it offline in tests)."""
        plan = plan or self.gluon_plan()[stage]
        n, k, r, kcp = plan
        group, in_flight = layout.GLUON_PACING[stage]
        return dict(N=n, K=k, R=r, KCP=kcp, STAGE=stage, HAS_BIAS=stage == 0 and self.has_bias,
                    LATE_LAUNCH=stage in layout.GLUON_LATE_LAUNCH, GROUP=group, IN_FLIGHT=in_flight,
                    WARPS=layout.GLUON_WARPS, LO=self.gluon_lo(stage, plan))

    def gluon_attend_consts(self) -> dict:
        """`gluon_attend.attend_stage`'s constexprs (also used to compile it offline in tests)."""
        return dict(H=self.h, NKV=self.n_kv, HD=self.hd, G=self.group, BG=pow2(self.group),
                    HAS_NORM=self.has_qk_norm, AHEAD=layout.ATTENTION_AHEAD, PAIR=layout.ATTENTION_PAIR,
                    MIN_PER=layout.ATTENTION_MIN_BLOCKS)

    def _gluon_stage(self, stage: int, layer: int, plan: tuple, hidden: torch.Tensor, pdl: bool) -> None:
        from rlbench.engine.megakernel.gluon_gemv import gemv_stage

        w = self._layers[layer]
        inp = {0: hidden, 2: self.attn, 3: hidden, 4: self.act}[stage]
        norm = {0: w.input_norm, 3: w.post_norm}.get(stage, inp)
        out = {0: self.qkv, 3: self.act}.get(stage, hidden)
        bias = w.qkv_bias if stage == 0 and w.qkv_bias is not None else inp
        kernel = gemv_stage[(self.programs,)](self._gluon_descs()[layer][stage], inp, norm, bias, out, self.eps,
                                              **self.gluon_stage_consts(stage, plan), num_warps=layout.GLUON_WARPS,
                                              launch_pdl=pdl)
        self._carve(kernel, layout.GLUON_CARVEOUT)

    def _gluon_attend(self, layer: int, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                      pdl: bool) -> None:
        from rlbench.engine.megakernel.gluon_attend import attend_stage

        w, (kc, vc) = self._layers[layer], self._caches[layer]
        kernel = attend_stage[(self.programs,)](
            self.qkv, kc, vc, self.qkv if w.q_norm is None else w.q_norm, self.qkv if w.k_norm is None else w.k_norm,
            cos, sin, positions, self.part_acc, self.part_m, self.part_l, self.eps, self.scale, self.head_stride,
            self.max_splits, **self.gluon_attend_consts(), num_warps=layout.ATTENTION_WARPS, launch_pdl=pdl)
        self._carve(kernel, layout.GLUON_CARVEOUT)

    def _carve(self, kernel, percent: int | None) -> None:
        """Set the carveout hint `percent` (None: the driver's choice) once per compiled kernel."""
        if kernel is None or percent is None or not hasattr(kernel, "function"):
            return  # Triton's interpreter returns no compiled kernel
        if (kernel.function, percent) not in self._carved:
            set_carveout(kernel.function, percent)
            self._carved.add((kernel.function, percent))


def set_carveout(function: int, percent: int) -> None:
    """cuFuncSetAttribute(PREFERRED_SHARED_MEMORY_CARVEOUT): the share of the SM's unified L1/shared memory the
    driver should give shared memory (0: as little as the kernel needs, leaving the most L1). A hint: if the
    driver refuses it, the kernel still runs (slower), with a warning."""
    import ctypes

    try:
        err = ctypes.CDLL("libcuda.so.1").cuFuncSetAttribute(ctypes.c_void_p(function), ctypes.c_int(9),
                                                             ctypes.c_int(percent))
    except OSError as e:  # no libcuda.so.1 under that name
        err = str(e)
    if err:
        warnings.warn(f"megakernel: could not set the shared-memory carveout to {percent}% ({err}); the kernel "
                      "runs with the driver's choice (up to 4% slower on the H200)", stacklevel=3)
