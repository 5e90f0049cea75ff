"""Sequence packing: micro-batch counts, balanced partitioning, pack/unpack, context-parallel slicing.

Pure torch/numpy: no process groups. See docs/packing.md.
"""

from rlbench.packing.balance import (
    check_budget,
    first_fit_count,
    karmarkar_karp,
    num_micro_batches,
    partition,
    split_by_dp,
    step_micro_batch_counts,
)
from rlbench.packing.cp import CPLayout, cp_gather, cp_layout, cp_local_response, cp_slice, pad_for_cp
from rlbench.packing.pack import (
    Pack,
    as_samples,
    bucket_length,
    make_step_packs,
    pack_samples,
    repad,
    response_values,
    round_up,
    truncate_sample,
    unpack_response,
    unpack_tokens,
)
from rlbench.packing.report import PackingReport

__all__ = [
    "CPLayout",
    "Pack",
    "PackingReport",
    "as_samples",
    "bucket_length",
    "check_budget",
    "cp_gather",
    "cp_layout",
    "cp_local_response",
    "cp_slice",
    "first_fit_count",
    "karmarkar_karp",
    "make_step_packs",
    "num_micro_batches",
    "pack_samples",
    "pad_for_cp",
    "partition",
    "repad",
    "response_values",
    "round_up",
    "split_by_dp",
    "step_micro_batch_counts",
    "truncate_sample",
    "unpack_response",
    "unpack_tokens",
]
