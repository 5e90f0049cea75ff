"""An exception inside backward (a Ctrl-C from a hook, a CUDA OOM) in the megatron-core backend: nothing of the
failed pass survives into the next `train()` (it zeroes the grad buffers first and megatron's DDP keeps no
per-pass phase state), so the next step equals an uninterrupted one bit for bit."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from dist_utils import megatron_world  # noqa: E402
from test_megatron_backend import base_cfg, make_data, opt_state, pg_loss, weights  # noqa: E402


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), torch.OutOfMemoryError("CUDA out of memory")],
                         ids=["ctrl-c", "cuda-oom"])
def test_exception_inside_backward_then_train_is_the_uninterrupted_step(exc, one_thread):
    from rlbench.backends.megatron import MegatronBackend, MegatronConfig

    packs, inputs = make_data()
    with megatron_world():
        faulted, clean = (MegatronBackend(base_cfg(), MegatronConfig(), temperature=0.7) for _ in range(2))
        faulted.init()
        start = weights(faulted)
        calls = [0]

        def hook(module, grad_input, grad_output):
            calls[0] += 1
            if calls[0] == 2:  # the second micro-batch's backward, after the first one's gradients accumulated
                raise exc

        remove = faulted.model.module.decoder.layers[0].register_full_backward_hook(hook).remove
        try:
            with pytest.raises(type(exc)):
                faulted.train(packs, inputs, pg_loss)
        finally:
            remove()
        assert faulted.step == 0 and all(torch.equal(start[k], v) for k, v in weights(faulted).items())
        got = faulted.train(packs, inputs, pg_loss)
        clean.init()
        want = clean.train(packs, inputs, pg_loss)
        after, reference = weights(faulted), weights(clean)
        assert all(not torch.equal(start[k], after[k]) for k in start)  # the step moved every weight
        assert all(torch.equal(after[k], reference[k]) for k in reference)
        assert all(torch.equal(x, y) for x, y in zip(opt_state(faulted), opt_state(clean)))
        assert got["train/loss"] == want["train/loss"] and got["train/grad_norm"] == want["train/grad_norm"]
