"""RolloutViewer: browse a rollout group by group, response tokens coloured by logprob or advantage.

Multi-turn samples show their turns: each run of loss-mask-0 tokens (a tool observation, not trained on) is a grey
block headed by the tool call it answers (`metadata["tool_calls"]`), between the model's turns.

Rendering is pure (`group_html`, `tokens_html` return HTML strings) so it is tested without a
browser; the widget only wires a group dropdown and a colour selector to an `ipywidgets.HTML`.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

import ipywidgets as widgets

from rlbench.viz._display import WidgetMixin

COLOR_MODES = ("logprob", "advantage", "none")


def samples_of(rollout: Any) -> list:
    """The Sample list of a RolloutBatch (`.samples`), of a trainer (`.last_rollout`) or a plain list."""
    if hasattr(rollout, "last_rollout"):
        rollout = rollout.last_rollout
    if rollout is None:
        return []
    return list(getattr(rollout, "samples", rollout))


def token_pieces(token_ids: Sequence[int], tokenizer: Any | None) -> list[str]:
    """One display string per token: the tokenizer's decoding of that single id, else `<id>`."""
    if tokenizer is None:
        return [f"<{t}>" for t in token_ids]
    return [tokenizer.decode([t]) for t in token_ids]


def logprob_color(logp: float) -> str:
    """Red (p≈0) → yellow → green (p≈1) on the token's probability exp(logp)."""
    p = min(max(math.exp(logp), 0.0), 1.0) if math.isfinite(logp) else 0.0
    hue = 120.0 * p  # 0 = red, 120 = green
    return f"hsl({hue:.0f}, 75%, 80%)"


def advantage_color(adv: float, scale: float) -> str:
    """Diverging: blue for positive, red for negative advantages, white at 0; |adv| >= scale saturates."""
    t = 0.0 if scale <= 0 else max(-1.0, min(1.0, adv / scale))
    hue = 210 if t >= 0 else 0
    return f"hsl({hue}, 80%, {100 - 35 * abs(t):.0f}%)"


def tokens_html(pieces: Sequence[str], colors: Sequence[str | None], titles: Sequence[str]) -> str:
    """Inline spans, one per token, with a background colour and a hover title."""
    spans = []
    for piece, color, title in zip(pieces, colors, titles):
        style = f"background:{color};" if color else ""
        text = html.escape(piece).replace("\n", "↵<br>")
        spans.append(f"<span class='rlbench-tok' style='{style}' title='{html.escape(title)}'>{text}</span>")
    return "<span style='font-family:monospace;white-space:pre-wrap'>" + "".join(spans) + "</span>"


def token_values(sample: Any, color_by: str) -> list[float | None]:
    """Per response token: its rollout logprob, or its advantage (token-level if present, else the scalar)."""
    n = sample.response_length
    if color_by == "logprob":
        return list(sample.rollout_log_probs) if sample.rollout_log_probs is not None else [None] * n
    if color_by == "advantage":
        if sample.token_advantages is not None:
            return list(sample.token_advantages)
        return [sample.advantage] * n
    return [None] * n


def mask_runs(loss_mask: Sequence[int]) -> list[tuple[int, int, int]]:
    """`(start, end, mask)` of each run of equal loss-mask values, in order (model turns: 1, observations: 0)."""
    runs: list[tuple[int, int, int]] = []
    for i, m in enumerate(loss_mask):
        if runs and runs[-1][2] == int(m):
            runs[-1] = (runs[-1][0], i + 1, int(m))
        else:
            runs.append((i, i + 1, int(m)))
    return runs


def call_label(call: dict | None) -> str:
    """One line for a tool call record (`metadata["tool_calls"]` entry): `name(args)`, and its error kind."""
    if not call:
        return "appended tokens"
    args = ", ".join(f"{k}={v!r}" for k, v in (call.get("arguments") or {}).items())
    text = f"turn {call.get('turn')}: {call.get('name') or '(malformed call)'}({args})"
    return text + (f" → {call['error']}" if call.get("error") else "")


def response_html(sample: Any, tokenizer: Any | None, color_by: str, adv_scale: float) -> str:
    """The response of one sample as coloured token spans; observations (loss mask 0 after model tokens) as grey
    blocks labelled with their tool call."""
    runs = mask_runs(sample.loss_mask)
    if len({m for _, _, m in runs}) < 2:  # one turn (or a mask zeroed whole, e.g. mask_truncated)
        return _tokens(sample, 0, sample.response_length, tokenizer, color_by, adv_scale)
    calls = iter(sample.metadata.get("tool_calls", []) if isinstance(sample.metadata, dict) else [])
    parts = []
    for start, end, m in runs:
        body = _tokens(sample, start, end, tokenizer, color_by if m else "none", adv_scale)
        if m:
            parts.append(body)
        else:
            label = html.escape(f"{call_label(next(calls, None))} · {end - start} tokens · loss mask 0")
            parts.append(f"<div class='rlbench-obs' style='margin:3px 0;padding:2px 4px;background:#eee;"
                         f"border-left:3px solid #999'><div style='font-size:85%;color:#555'>{label}</div>"
                         f"{body}</div>")
    return "".join(parts)


def _tokens(sample: Any, start: int, end: int, tokenizer: Any | None, color_by: str, adv_scale: float) -> str:
    """Response tokens `[start, end)` as coloured spans."""
    ids = sample.response_tokens[start:end]
    pieces = token_pieces(ids, tokenizer)
    values = token_values(sample, color_by)[start:end]
    colors: list[str | None] = []
    titles = []
    for tok, val in zip(ids, values):
        if val is None:
            colors.append(None)
            titles.append(f"id {tok}")
        elif color_by == "logprob":
            colors.append(logprob_color(val))
            titles.append(f"id {tok}  logp {val:.3f}  p {math.exp(val):.3f}")
        else:
            colors.append(advantage_color(val, adv_scale))
            titles.append(f"id {tok}  adv {val:+.3f}")
    return tokens_html(pieces, colors, titles)


def prompt_text(sample: Any, tokenizer: Any | None) -> str:
    """The prompt as text: `sample.prompt` when set, else the decoded prompt tokens."""
    if isinstance(sample.prompt, str):
        return sample.prompt
    if sample.prompt is not None:
        return repr(sample.prompt)
    if tokenizer is not None:
        return tokenizer.decode(sample.prompt_tokens)
    return " ".join(map(str, sample.prompt_tokens))


def _fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def group_html(samples: Sequence[Any], tokenizer: Any | None = None, color_by: str = "logprob") -> str:
    """HTML for one prompt group: the prompt once, then a row per response with its stats."""
    if color_by not in COLOR_MODES:
        raise ValueError(f"color_by={color_by!r} is not one of {COLOR_MODES}")
    if not samples:
        return "<i>no samples</i>"
    advs = [abs(v) for s in samples for v in token_values(s, "advantage") if v is not None]
    adv_scale = max(advs, default=1.0) or 1.0
    rows = []
    for s in samples:
        status = getattr(s.status, "value", s.status)
        finish = s.metadata.get("finish_reason", status) if isinstance(s.metadata, dict) else status
        turns = s.metadata.get("turns") if isinstance(s.metadata, dict) else None
        stats = (f"#{s.index} reward <b>{_fmt(s.reward)}</b> · adv {_fmt(s.advantage, '+.3f')} · "
                 f"{s.response_length} tok · {html.escape(str(finish))} · v{s.weight_version}"
                 + (f" · {turns} turns" if turns is not None else ""))
        rows.append(f"<div class='rlbench-sample' style='margin:6px 0;padding:4px;border-left:3px solid #ccc'>"
                    f"<div style='font-size:90%;color:#555'>{stats}</div>"
                    f"{response_html(s, tokenizer, color_by, adv_scale)}</div>")
    prompt = html.escape(prompt_text(samples[0], tokenizer))
    return (f"<div><div><b>prompt</b> (group {samples[0].group_index}):</div>"
            f"<pre style='white-space:pre-wrap;background:#f6f6f6;padding:4px'>{prompt}</pre>"
            + "".join(rows) + "</div>")


def group_samples(samples: Sequence[Any]) -> dict[int, list]:
    """Samples keyed by group_index, in order of first appearance."""
    groups: dict[int, list] = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s)
    return groups


class RolloutViewer(WidgetMixin):
    """Browse a rollout by prompt group.

    Args:
        rollout: a trainer (reads `.last_rollout` on every `refresh()`), a RolloutBatch or a Sample list.
        tokenizer: decodes token ids; defaults to `rollout.tokenizer` when a trainer is given.
        color_by: "logprob", "advantage" or "none".
    """

    def __init__(self, rollout: Any, tokenizer: Any | None = None, color_by: str = "logprob") -> None:
        if color_by not in COLOR_MODES:
            raise ValueError(f"color_by={color_by!r} is not one of {COLOR_MODES}")
        self.source = rollout
        self.tokenizer = tokenizer if tokenizer is not None else getattr(rollout, "tokenizer", None)
        self.groups: dict[int, list] = {}
        self.group = widgets.Dropdown(description="group", options=[])
        self.color = widgets.ToggleButtons(options=COLOR_MODES, value=color_by, description="colour")
        self.summary = widgets.HTML()
        self.body = widgets.HTML()
        self.group.observe(lambda _: self._render(), names="value")
        self.color.observe(lambda _: self._render(), names="value")
        self.widget = widgets.VBox([widgets.HBox([self.group, self.color]), self.summary, self.body])
        self.refresh()

    def refresh(self, rollout: Any | None = None, *_: Any) -> None:
        """Re-reads the rollout (or takes a new one); usable as a StepController on_step callback."""
        if rollout is not None and not isinstance(rollout, dict):
            self.source = rollout
        samples = samples_of(self.source)
        self.groups = group_samples(samples)
        keep = self.group.value if self.group.value in self.groups else None
        self.group.options = [(f"group {g} ({len(v)} samples)", g) for g, v in self.groups.items()]
        self.group.value = keep if keep is not None else next(iter(self.groups), None)
        rewards = [s.reward for s in samples if s.reward is not None]
        mean = sum(rewards) / len(rewards) if rewards else None
        versions = sorted({s.weight_version for s in samples})
        self.summary.value = (f"<span class='rlbench-rollout-summary'>{len(samples)} samples in "
                              f"{len(self.groups)} groups · mean reward {_fmt(mean)} · weight versions "
                              f"{versions}</span>")
        self._render()

    def _render(self) -> None:
        samples = self.groups.get(self.group.value, [])
        self.body.value = group_html(samples, self.tokenizer, self.color.value)
