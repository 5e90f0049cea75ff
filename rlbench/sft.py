"""SFT warm start: teach a preset model a synthetic task's answer format so that GRPO has signal.

    metrics = run_sft(SFTConfig(preset="small", task="arithmetic", task_kwargs={"level": 2}, out="runs/sft-small"))
    python -m rlbench.sft --preset small --task arithmetic --out runs/sft-small

Trains on the task's reference solutions (`metadata["solution"]` + `<|im_end|>`) behind the chat
template, with the loss on response tokens only, AdamW and right-padded batches. Every `eval_every`
steps it measures pass@1 on eval prompts (drawn with another seed; with `disjoint_eval` never trained
on) by sampling at temperature 1 (the RL setting) and greedily, and stops once sampled pass@1 >= `target_pass_at_1`,
so the saved policy is good enough to get rewards but far from solved. The output is a standard HF
directory (model + tokenizer) for `rlbench.models.load_model` / `load_tokenizer`.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field

import torch

from rlbench.data.preferences import with_long_forms
from rlbench.data.tasks import make_task
from rlbench.data.tokenizer import build_tokenizer
from rlbench.models import build_model, save_pretrained
from rlbench.progress import Progress
from rlbench.rewards import score_batch


@dataclass
class SFTConfig:
    """One SFT warm-start run."""

    preset: str = "small"
    """Model preset from `rlbench.models.PRESETS` (random init)."""
    task: str = "arithmetic"
    """Synthetic task: "arithmetic" or "countdown"."""
    task_kwargs: dict = field(default_factory=lambda: {"level": 2})
    """Task generator options (arithmetic: `level=` or `digits=`/`operators=`; countdown: CountdownConfig fields)."""
    out: str | None = None
    """Directory for the HF model + tokenizer + sft_metrics.json; None saves nothing."""
    num_train: int = 20000
    """Training problems drawn (held-out prompts are removed from them)."""
    num_eval: int = 64
    """Eval prompts for pass@1 (one sample each at temperature 1, plus greedy), drawn with another seed."""
    disjoint_eval: bool = False
    """Remove the eval prompts from the training rows (needs a task with many distinct problems, level >= 3)."""
    batch_size: int = 64
    """Sequences per optimizer step."""
    lr: float = 1e-3
    """Peak AdamW learning rate (linear warm-up, then cosine to 10% at max_steps)."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    warmup_steps: int = 20
    """Linear warm-up steps."""
    max_steps: int = 400
    """Upper bound on optimizer steps (also the cosine horizon)."""
    eval_every: int = 25
    """Evaluate pass@1 every this many steps (and at the end)."""
    target_pass_at_1: float | None = 0.3
    """Stop as soon as sampled pass@1 reaches this; None trains for max_steps."""
    max_new_tokens: int = 24
    """Generation budget per eval response."""
    long_form_share: float = 0.0
    """Share of the training solutions written in a long form (a filler phrase before or after the box,
    `rlbench.data.preferences.with_long_forms`): a verbose warm start whose form RL with a reward model can fix."""
    seed: int = 0
    """Seed for data, init, batch order and eval sampling."""
    num_threads: int | None = None
    """torch.set_num_threads for the run; None leaves the default."""
    device: str = "cpu"
    """Where to train ("cpu", "cuda", "cuda:1"); on CUDA the forward runs under bf16 autocast (fp32 weights)."""
    tokenizer_vocab: bool = True
    """True sizes the embedding to the tokenizer (128 ids); False keeps the preset's vocabulary, so a model shape
    such as qwen3-0.6b-shape keeps its real 152k-row lm-head cost (the ids above 127 are never used)."""

    def __post_init__(self) -> None:
        if self.task not in ("arithmetic", "countdown"):
            raise ValueError(f"task={self.task!r} must be 'arithmetic' or 'countdown'")
        for name in ("num_train", "num_eval", "batch_size", "max_steps", "eval_every", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.target_pass_at_1 is not None and not 0 < self.target_pass_at_1 <= 1:
            raise ValueError(f"target_pass_at_1={self.target_pass_at_1} must be in (0, 1] or None")
        if not 0 <= self.long_form_share <= 1:
            raise ValueError(f"long_form_share={self.long_form_share} must be in [0, 1]")
        if self.long_form_share and self.task != "arithmetic":
            raise ValueError(f"long_form_share={self.long_form_share} is for task='arithmetic' (its boxed integer "
                             f"answers), not {self.task!r}; leave it at 0")
        if torch.device(self.device).type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} but CUDA is not available; use device='cpu'")


def split_rows(cfg: SFTConfig) -> tuple[list[dict], list[dict]]:
    """(train rows, eval rows): independent draws; with `disjoint_eval` no eval prompt is trained on."""
    kwargs = dict(cfg.task_kwargs)
    train_rows = make_task(cfg.task, cfg.num_train, seed=cfg.seed, **kwargs)
    if cfg.long_form_share:
        train_rows = with_long_forms(train_rows, cfg.long_form_share, seed=cfg.seed)
    eval_rows = make_task(cfg.task, cfg.num_eval, seed=cfg.seed + 1_000_003, **kwargs)
    if cfg.disjoint_eval:
        held_out = {r["prompt"] for r in eval_rows}
        train_rows = [r for r in train_rows if r["prompt"] not in held_out]
        if len(train_rows) < cfg.num_train // 2:
            raise ValueError(
                f"task {cfg.task} {cfg.task_kwargs} has too few distinct problems for a disjoint eval split "
                f"({len(train_rows)} of {cfg.num_train} training rows left); pass disjoint_eval=False"
            )
    return train_rows, eval_rows


def encode_sft(rows: list[dict], tokenizer) -> list[tuple[list[int], int]]:
    """(token ids of chat-templated prompt + solution + <|im_end|>, prompt length) per row."""
    out = []
    for row in rows:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], tokenize=False, add_generation_prompt=True
        )
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        r_ids = tokenizer(row["metadata"]["solution"], add_special_tokens=False)["input_ids"]
        out.append((p_ids + r_ids + [tokenizer.eos_token_id], len(p_ids)))
    return out


def collate(examples: list[tuple[list[int], int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded `input_ids`/`attention_mask`/`labels` [B, L]; labels are -100 off the response."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)  # [B, L]
    labels = torch.full((len(examples), width), -100, dtype=torch.long)  # [B, L]
    mask = torch.zeros((len(examples), width), dtype=torch.long)  # [B, L]
    for b, (ids, n_prompt) in enumerate(examples):
        input_ids[b, : len(ids)] = torch.tensor(ids)
        labels[b, n_prompt : len(ids)] = torch.tensor(ids[n_prompt:])
        mask[b, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def sft_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy over the response tokens of the batch."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    targets = batch["labels"][:, 1:]  # [B, L-1]: token t+1 predicted at position t
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=-100
    )


@torch.no_grad()
def evaluate_pass_at_1(model, tokenizer, rows: list[dict], *, greedy: bool, max_new_tokens: int, seed: int) -> float:
    """Fraction of `rows` answered correctly with one response each (temperature-1 sample, or greedy)."""
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False, add_generation_prompt=True)
        for r in rows
    ]
    side, tokenizer.padding_side = tokenizer.padding_side, "left"  # generate continues from the right edge
    enc = tokenizer(prompts, add_special_tokens=False, padding=True, return_tensors="pt").to(model.device)
    tokenizer.padding_side = side
    torch.manual_seed(seed)
    was_training = model.training
    model.eval()
    # Pure temperature-1 sampling: top_k=0 / top_p=1 override transformers' default top_k=50.
    sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    out = model.generate(
        **enc, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **sampling,
    )
    model.train(was_training)
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    labels = [r["label"] for r in rows]
    rm_type = rows[0]["metadata"]["rm_type"]
    return sum(score_batch(texts, labels, rm_type=rm_type)) / len(rows)


def _lr_lambda(cfg: SFTConfig):
    def fn(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        frac = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    return fn


def _batches(examples: list[tuple[list[int], int]], batch_size: int, pad_id: int, seed: int):
    """Endless collated batches over seeded per-epoch permutations (a short tail is dropped)."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(examples), generator=gen).tolist()
        for i in range(0, len(order) - batch_size + 1, batch_size):
            yield collate([examples[j] for j in order[i : i + batch_size]], pad_id)


def train_step(model, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> float:
    """One AdamW step on the response-token loss (grad norm clipped at 1); returns the loss.

    The batch is moved to the model's device; on CUDA the forward runs under bf16 autocast.
    """
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in batch.items()}
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss = sft_loss(model, batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


def run_sft(cfg: SFTConfig) -> dict:
    """Train, evaluate, stop in the target band, save; returns flat metrics plus `history` (one dict per eval)."""
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    start, start_cpu = time.perf_counter(), time.process_time()
    tokenizer = build_tokenizer()
    vocab = {"vocab_size": len(tokenizer)} if cfg.tokenizer_vocab else {}
    model = build_model(cfg.preset, device=cfg.device, seed=cfg.seed, **vocab, **_special_ids(tokenizer))
    train_rows, eval_rows = split_rows(cfg)
    examples = encode_sft(train_rows, tokenizer)
    if len(examples) < cfg.batch_size:
        raise ValueError(f"batch_size={cfg.batch_size} exceeds the {len(examples)} training rows; raise num_train")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg))
    batches = _batches(examples, cfg.batch_size, tokenizer.pad_token_id, cfg.seed)
    history, step = [], 0
    model.train()
    with Progress(cfg.max_steps, "SFT", unit="step") as bar:  # stops early at the target: the bar ends short
        while step < cfg.max_steps:
            loss = train_step(model, opt, next(batches))
            sched.step()
            step += 1
            bar.update()
            if step % cfg.eval_every == 0 or step == cfg.max_steps:
                history.append(_eval_record(model, tokenizer, eval_rows, cfg, step, loss, start, start_cpu, bar.write))
                if cfg.target_pass_at_1 is not None and history[-1]["eval/pass@1"] >= cfg.target_pass_at_1:
                    break
    metrics = dict(history[-1]) | {"sft/stopped_early": step < cfg.max_steps, "history": history}
    if cfg.out:
        save_pretrained(model, tokenizer, cfg.out)
        with open(os.path.join(cfg.out, "sft_metrics.json"), "w") as f:
            json.dump(metrics | {"config": asdict(cfg)}, f, indent=1)
    if model.device.type == "cuda":  # hand the model's, Adam's and the logits' blocks back to the driver: a trainer
        del model, opt, sched  # started next in this process (`rlbench demo --device cuda`) plans from the free memory
        gc.collect()
        torch.cuda.empty_cache()
    return metrics


def _special_ids(tokenizer) -> dict:
    """Config fields that make `generate` on a loaded model stop at <|im_end|> and pad with <|endoftext|>."""
    return {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, "bos_token_id": None}


def _eval_record(model, tokenizer, rows, cfg: SFTConfig, step: int, loss: float, start: float, start_cpu: float,
                 printer=print) -> dict:
    """One flat eval record: sampled and greedy pass@1, loss, steps, wall and process CPU time (printed as one line
    by `printer`)."""
    kw = dict(max_new_tokens=cfg.max_new_tokens, seed=cfg.seed + step)
    sampled = evaluate_pass_at_1(model, tokenizer, rows, greedy=False, **kw)
    greedy = evaluate_pass_at_1(model, tokenizer, rows, greedy=True, **kw)
    rec = {"sft/step": step, "sft/loss": loss, "eval/pass@1": sampled, "eval/pass@1_greedy": greedy,
           "perf/wall_s": time.perf_counter() - start, "perf/cpu_s": time.process_time() - start_cpu}
    printer(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items()))
    return rec


def main(argv: list[str] | None = None) -> dict:
    """CLI: `python -m rlbench.sft --preset small --task arithmetic --out runs/sft-small`."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--task", default="arithmetic", choices=["arithmetic", "countdown"])
    p.add_argument("--level", type=int, default=2, help="arithmetic difficulty level (1..4)")
    p.add_argument("--disjoint-eval", action="store_true", help="never train on an eval prompt")
    p.add_argument("--out", default=None)
    p.add_argument("--max-steps", type=int, default=SFTConfig.max_steps)
    p.add_argument("--batch-size", type=int, default=SFTConfig.batch_size)
    p.add_argument("--lr", type=float, default=SFTConfig.lr)
    p.add_argument("--eval-every", type=int, default=SFTConfig.eval_every)
    p.add_argument("--num-eval", type=int, default=SFTConfig.num_eval)
    p.add_argument("--target-pass-at-1", type=float, default=SFTConfig.target_pass_at_1)
    p.add_argument("--long-form-share", type=float, default=0.0,
                   help="share of training solutions written long (a filler beside the box): a verbose warm start")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=None)
    a = p.parse_args(argv)
    cfg = SFTConfig(
        preset=a.preset, task=a.task, task_kwargs={"level": a.level} if a.task == "arithmetic" else {},
        out=a.out, max_steps=a.max_steps, batch_size=a.batch_size, lr=a.lr, eval_every=a.eval_every,
        num_eval=a.num_eval, disjoint_eval=a.disjoint_eval, target_pass_at_1=a.target_pass_at_1 if a.target_pass_at_1 > 0 else None,
        seed=a.seed, num_threads=a.num_threads, long_form_share=a.long_form_share,
    )
    metrics = run_sft(cfg)
    print(json.dumps({k: v for k, v in metrics.items() if k != "history"}))
    return metrics


if __name__ == "__main__":
    main()
