"""A trained reward model scoring (prompt, response) text pairs in packed batches (`--reward-model DIR`).

    rm = RewardModel("runs/rm", device="cuda")      # the directory `rlbench rm` wrote
    scores = rm.score(prompts, responses)           # one float per pair; prompts as the policy saw them
    rm.version                                      # the directory's stamp (`version.json`)

Scoring re-encodes the text with the reward model's own tokenizer (`rlbench.reward_model.data.encode_pair`, the
encoding it was trained on), so the RM need not share the policy's vocabulary. The prompt is the rendered text the
policy saw (`Sample.prompt`: chat template applied when the run's data applies it, as `rlbench rm` does by default).

Memory turns: on a CPU the model simply stays there. On a GPU its weights live in pinned host memory and are
copied onto the device only for the duration of a `score` call, which the rollout manager makes after the engine
has generated the round, before the trainer takes the device back (while the trainer state is parked, when the
run offloads). So the RM adds its weights plus one packed micro-batch of activations to the rollout phase's peak and
nothing to the training phase's; the copy is one host-to-device transfer of the weights per rollout round
(~0.1 s for a 0.6B model in bf16; a value model has no LM head).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

import torch

from rlbench.models import load_tokenizer
from rlbench.models.build import restore_buffers
from rlbench.models.value_head import load_value_model, read_stamp, weights_version
from rlbench.reward_model.data import encode_pair
from rlbench.reward_model.scoring import pack_units, sequence_scores

SCORE_TOKENS = 8192
"""Token budget of one packed scoring micro-batch (raised to the longest sequence when one is longer)."""


class RewardModel:
    """A frozen reward model (`rlbench.models.value_head` layout) that scores text pairs.

    Args:
        path: a value-model directory with tokenizer files (`rlbench rm`'s output, or a critic's export).
        device: where it scores ("cpu", "cuda", "cuda:N"); on CUDA the weights are copied in per call.
        dtype: parameter dtype; None: bf16 on CUDA, fp32 on CPU.

    Raises:
        ValueError: not a directory, no trained head, no tokenizer files.
    """

    def __init__(self, path: str | os.PathLike, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None) -> None:
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise ValueError(f"reward model {path!r}: no such directory (from {os.getcwd()}); give the directory "
                             "`rlbench rm --out DIR` wrote")
        if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
            raise ValueError(f"reward model {path!r} has no tokenizer files; it scores text, so save its tokenizer "
                             "beside it (rlbench rm does)")
        self.path = path
        self.device = torch.device(device)
        dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.model = load_value_model(path, dtype=dtype, require_head=True).eval().requires_grad_(False)
        self.tokenizer = load_tokenizer(path)
        self.version: str = read_stamp(path).get("version") or weights_version(path)
        """The stamp's version (16 hex digits of the weights' SHA-256)."""
        self._host: dict[str, torch.Tensor] = {}
        if self.device.type == "cuda":
            # buffers (rotary inv_freq) stay on the device, they are small; the parameters wait on the host
            restore_buffers(self.model, dict(self.model.named_buffers()), self.device)
            self._host = {n: p.data.to("cpu").pin_memory() for n, p in self._used_params()}
            for name, p in self._used_params():
                p.data = self._host[name]

    @property
    def version_id(self) -> int:
        """The version's first 8 hex digits as an integer (a number that fits a float metric exactly)."""
        return int(self.version[:8], 16)

    def _used_params(self):
        """(name, parameter) of every weight (the forward reads them all: the decoder and the head)."""
        yield from self.model.named_parameters()

    @contextlib.contextmanager
    def _on_device(self):
        """The weights on `device` inside (a no-op on the CPU); back to their host copies after, even on error."""
        if not self._host:
            yield
            return
        try:
            for name, p in self._used_params():
                p.data = self._host[name].to(self.device, non_blocking=True)
            yield
        finally:
            for name, p in self._used_params():
                p.data = self._host[name]

    @torch.no_grad()
    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        """One score per (prompt, response), in order.

        Args:
            prompts: the prompt texts as the policy saw them (rendered).
            responses: the response texts (decoded without special tokens).
        Returns:
            float scores (the head at each sequence's final eos).
        """
        if len(prompts) != len(responses):
            raise ValueError(f"got {len(prompts)} prompts and {len(responses)} responses; pass one prompt per response")
        if not prompts:
            return []
        seqs = [encode_pair(self.tokenizer, p, r) for p, r in zip(prompts, responses)]
        budget = max(SCORE_TOKENS, max(len(s) for s in seqs))
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        out = [0.0] * len(seqs)
        with self._on_device():
            for pack in pack_units(seqs, max_tokens=budget, pad_token_id=pad):
                for i, v in zip(pack.sample_ids, sequence_scores(self.model, pack, self.device).tolist()):
                    out[i] = v
        return out

    def score_samples(self, samples: Sequence) -> list[float]:
        """Scores of `Sample`s (their `.prompt` and `.response`)."""
        return self.score([s.prompt for s in samples], [s.response for s in samples])
