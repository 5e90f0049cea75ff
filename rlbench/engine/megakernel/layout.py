"""Constants shared by the megakernel's host code and its kernels: the pointer table, the attention split, the
GEMV tiling and pipeline, the barrier timeout. The bottom of the package: it imports nothing.
"""

TABLE = ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "post_norm", "gate_up", "down", "k", "v")
"""Columns of the per-layer pointer table: the `FusedLayer` field of that name, then the layer's K and V cache."""
SPLIT = 64
"""Cached positions per attention task (KV head x split is the attention stage's task grid)."""
MERGE_CHUNK = 32
"""Splits merged per load when the partial softmaxes are combined (one load for up to 32 splits, ~4,000 positions
on 132 SMs). H200, session 13, same run, Gluon stages and attention: 32 gave 424.4 / 468.4 / 483.7 us per 0.6B call
at pos 256 / 1024 / 1500 against 423.9 / 480.3 / 502.7 with 16, although both merge 5 / 9 / 12 splits in one load:
the merge's last program ended 1.74 vs 2.06 us after the attention at pos 1024 (docs/LOG.md). Session 7, with the
Triton stages of then, 16 had been 1-3% faster."""
TILE_ELEMS = 16384
"""Weight elements a GEMV tile loads per K step when the tile is double buffered; a tile of up to twice that
is loaded as one chunk (all in flight before the barrier, one round trip after it)."""
PIPELINE_STAGES = 3
PIPELINE_MIN_CHUNKS = 8
"""A GEMV tile of at least PIPELINE_MIN_CHUNKS K chunks loads the chunks after its first through Triton's software
pipeline (`cp.async` into shared memory, PIPELINE_STAGES - 1 chunks in flight without holding registers) instead
of register double buffering. Measured on the H200 (docs/LOG.md, 2026-11-30): every 4B stage has 8-40 chunks,
3,516 -> 3,305 us per call with 3 stages (3,333 with 4); the 0.6B shape's only multi-chunk tile (gate/up, 4
chunks) was slower with it (4.59 -> 4.73 us per layer)."""
MAX_SPINS = 1 << 22
"""Polls of the barrier counter before a program gives up on a barrier (~1.5 s at ~0.35 us per L2 round
trip; estimated, not measured): a non-resident program then costs a stall and an error, not a hang."""


GLUON_TILE_BYTES = 120 * 1024
"""Largest shared memory (weight tile + fp32 input) of a Gluon GEMV stage program: two neighbouring stages'
programs must fit one SM's 227 KB (the 0.6B shape: QKV 68 KB, o_proj 40, gate/up 100, down 64)."""



STAGE_ORDER = (0, 1, 5, 2, 3, 4)
"""The per-stage kernels of a layer in launch order: QKV, attention, merge, o_proj, gate/up, down."""
