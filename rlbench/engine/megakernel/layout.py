"""Constants of the megakernel: the pointer table, the attention split, the GEMV tiling and pipeline, the barrier
timeout, the Gluon tile geometry, and the launch settings the product never changes. The bottom of the package:
it imports nothing. `DecodeMegakernel` reads them at each call, so a test can force a path by patching one.
"""

TABLE = ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "post_norm", "gate_up", "down", "k", "v")
"""Columns of the per-layer pointer table: the `FusedLayer` field of that name, then the layer's K and V cache."""
SPLIT = 64
"""Cached positions per attention block (a task is a KV head and a split of consecutive blocks)."""
MERGE_CHUNK = 32
"""Splits merged per load when the partial softmaxes are combined (one load for up to 32 splits, ~4,000 positions
on 132 SMs)."""
TILE_ELEMS = 16384
"""Weight elements a GEMV tile loads per K step when the tile is double buffered; a tile of up to twice that
is loaded as one chunk (all in flight before the barrier, one round trip after it)."""
PIPELINE_STAGES = 3
PIPELINE_MIN_CHUNKS = 8
"""A GEMV tile of at least PIPELINE_MIN_CHUNKS K chunks loads the chunks after its first through Triton's software
pipeline (`cp.async` into shared memory, PIPELINE_STAGES - 1 chunks in flight without holding registers) instead
of register double buffering (faster for the 4B shape's 8-40 chunk tiles, slower for 4 chunks)."""
MAX_SPINS = 1 << 22
"""Polls of the barrier counter before a program gives up on a barrier (~1.5 s at ~0.35 us per L2 round
trip; estimated, not measured): a non-resident program then costs a stall and an error, not a hang."""
STAGE_ORDER = (0, 1, 5, 2, 3, 4)
"""The per-stage kernels of a layer in launch order: QKV, attention, merge, o_proj, gate/up, down."""
NUM_WARPS = 8
"""Warps of a Triton stage program (and of the grid-barrier kernel's)."""
MERGE_WARPS = 1
"""Warps of a per-stage attention-merge program (one q head per program)."""
CARVEOUT = 0
"""Preferred shared-memory carveout (percent) of the Triton stage kernels when no Gluon stage runs: the least shared
memory the kernel needs, the most L1 (the driver's own choice was slower)."""

GLUON_TILE_BYTES = 120 * 1024
"""Largest shared memory (weight tile + input) of a Gluon GEMV stage program: two neighbouring stages' programs
must fit one SM's 227 KB (the 0.6B shape: QKV 68 KB, o_proj 40, gate/up 100, down 64)."""
GLUON_CARVEOUT = 100
"""Carveout (percent) of every kernel of a step that runs Gluon stages: their tiles need shared memory, and an SM
only hosts programs of different kernels side by side under one shared-memory split."""
GLUON_WARPS = 4
"""Warps of a Gluon GEMV stage program (few registers, so that the next stage's program shares the SM)."""
GLUON_LATE_LAUNCH = (0, 3)
"""Gluon stages that let the next kernel launch only after their wait (it then arrives one stage ahead); the others
let it launch at once. QKV and gate/up launch late, so that the next stage's stream stays out of the latency-bound
attention and o_proj; o_proj launches gate/up early and down launches QKV early, so their tiles land in time."""
GLUON_PACING = {0: (2, 2), 2: (2, 2), 3: (2, 2), 4: (4, 2)}
"""Per Gluon stage: (TMA boxes of 4 KB per mbarrier, such groups in flight per program). A burst of a whole stage's
tiles queues the latency-bound accesses of the stages on the critical path behind it; a few groups pace it."""
BOX_ROWS = 8
"""Weight rows of a Gluon tile's row group, multiplied together on the tensor cores (`gluon_gemv._mma_rows`); a
program's rows are a multiple of it."""
BOX_K = 256
"""The unit of a Gluon stage's KCP (`DecodeMegakernel.gluon_plan`: K // BOX_K rounded up to a power of two; its
input buffer holds KCP // 4 loads of [MMA_IN, MMA_CHUNK])."""
MMA_CHUNK = 64
"""K elements of one 128-byte swizzled row of a tensor-core tile."""
MMA_SLICES = 8
"""K chunks of a weight row multiplied side by side by one m16n8k16 mma (its 8 B columns): a 512-wide K block."""
MMA_BOX_ROWS = 4
"""Weight rows of one 512-wide K block per TMA box of a tensor-core tile (4 KB)."""
MMA_IN = 16
"""64-wide chunks of the input per load: [16, 64] (1,024 elements)."""

GLUON_ATTENTION = True
"""Run the attention stage in Gluon wherever Gluon GEMV stages run and the shapes allow it
(`DecodeMegakernel.gluon_attention_active`); False: the Triton attention stage."""
ATTENTION_WARPS = 4
"""Warps of a Gluon attention program; each takes SPLIT // ATTENTION_WARPS positions of every block."""
ATTENTION_ROWS = 16
"""A KV group's q heads, padded to mma's M (the Gluon attention holds groups of up to 8)."""
ATTENTION_AHEAD = 2
"""Cached K/V blocks the Gluon attention copies before its PDL wait (1 or 2)."""
ATTENTION_PAIR = True
"""The Gluon attention runs a task of exactly two blocks as one step: both blocks' scores, one softmax update,
two independent mma chains instead of a serial second block."""
ATTENTION_MIN_BLOCKS = 2
"""Blocks per task of the Gluon attention at least (the merge kernel's task grid follows it): half as many tasks."""
