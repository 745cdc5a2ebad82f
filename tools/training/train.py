"""The training loop: token windows in, AdamW steps out, with progress lines and validation loss.

Owns batching (random windows starting at line starts, each led by <s>),
the learning-rate schedule (linear warm-up, cosine decay to a floor) and
perplexity. Knows nothing about files: it takes token tensors and returns
the trained model's history.

Every window is <s> followed by `context` tokens; the model reads <s> and
the first context-1 of them and is scored on all `context`, so every text
token is predicted, the first from <s> alone. Validation uses the same
layout over consecutive, non-overlapping windows of the held-out stream.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tools.training.model import LlamaForCausalLM


@dataclass(slots=True)
class TrainSettings:
    steps: int
    batch_size: int
    context: int
    lr: float
    min_lr_ratio: float = 0.1
    warmup_steps: int = 40
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_windows: int = 8
    log_every: int = 10
    use_bf16: bool = True


@dataclass(slots=True)
class TrainHistory:
    wall_seconds: float = 0.0
    num_tokens: int = 0
    train_losses: list[tuple[int, float]] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)


def line_starts(stream: torch.Tensor, newline_ids: torch.Tensor, context: int) -> torch.Tensor:
    """Positions that follow a newline token and leave a whole window after them: where windows may begin."""
    is_newline = torch.isin(stream[:-1], newline_ids)  # [len - 1]
    starts = torch.nonzero(is_newline).squeeze(1) + 1
    return starts[starts + context <= len(stream)]


def sample_batch(stream: torch.Tensor, starts: torch.Tensor, bos_id: int, settings: TrainSettings,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), both [batch, context]: inputs are <s> + window[:-1], targets the window."""
    picks = starts[torch.randint(len(starts), (settings.batch_size,), generator=generator)]
    offsets = torch.arange(settings.context)
    targets = stream[picks[:, None] + offsets]  # [batch, context]
    return with_bos(targets, bos_id), targets


def with_bos(targets: torch.Tensor, bos_id: int) -> torch.Tensor:
    bos = torch.full((targets.shape[0], 1), bos_id, dtype=targets.dtype)
    return torch.cat([bos, targets[:, :-1]], dim=1)  # [batch, context]


def validation_windows(stream: torch.Tensor, context: int, limit: int | None = None) -> torch.Tensor:
    """Consecutive non-overlapping windows of the held-out stream: [num_windows, context] (the tail is dropped)."""
    num_windows = len(stream) // context
    if limit is not None:
        num_windows = min(num_windows, limit)
    return stream[: num_windows * context].view(num_windows, context)


@torch.no_grad()
def mean_nll(model: LlamaForCausalLM, windows: torch.Tensor, bos_id: int, use_bf16: bool,
             batch_size: int = 8) -> float:
    """Mean negative log-likelihood (nats per token) of every token of `windows` given <s> and the ones before it."""
    model.eval()
    total, count = 0.0, 0
    for batch in windows.split(batch_size):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
            logits = model(with_bos(batch, bos_id))  # [batch, context, vocab]
        total += F.cross_entropy(logits.float().flatten(0, 1), batch.flatten(), reduction="sum").item()
        count += batch.numel()
    model.train()
    return total / count


def lr_at(step: int, settings: TrainSettings) -> float:
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
    floor = settings.lr * settings.min_lr_ratio
    return floor + (settings.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model: LlamaForCausalLM, settings: TrainSettings) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only, not on norm weights."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": settings.weight_decay}, {"params": vectors, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=settings.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


def train(model: LlamaForCausalLM, train_stream: torch.Tensor, val_stream: torch.Tensor, newline_ids: torch.Tensor,
          bos_id: int, settings: TrainSettings, seed: int, log=print) -> TrainHistory:
    generator = torch.Generator().manual_seed(seed)
    starts = line_starts(train_stream, newline_ids, settings.context)
    eval_windows = validation_windows(val_stream, settings.context, settings.eval_windows)
    optimizer = make_optimizer(model, settings)
    history = TrainHistory()
    tokens_per_step = settings.batch_size * settings.context
    begin = time.perf_counter()
    model.train()
    for step in range(settings.steps):
        inputs, targets = sample_batch(train_stream, starts, bos_id, settings, generator)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, settings)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.use_bf16):
            logits = model(inputs)  # [batch, context, vocab]
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        history.num_tokens += tokens_per_step
        done = step + 1
        if done % settings.log_every == 0 or done == settings.steps:
            history.train_losses.append((done, loss.item()))
            log(_progress_line(done, settings, loss.item(), history.num_tokens, time.perf_counter() - begin))
        if done % settings.eval_every == 0 or done == settings.steps:
            val = mean_nll(model, eval_windows, bos_id, settings.use_bf16)
            history.val_losses.append((done, val))
            log(f"step {done:5d}  val loss {val:.4f}  (ppl {math.exp(val):.1f}, first {len(eval_windows)} windows)")
    history.wall_seconds = time.perf_counter() - begin
    return history


def _progress_line(done: int, settings: TrainSettings, loss: float, num_tokens: int, elapsed: float) -> str:
    rate = num_tokens / elapsed
    eta = elapsed / done * (settings.steps - done)
    return (f"step {done:5d}/{settings.steps}  loss {loss:.4f}  lr {lr_at(done - 1, settings):.2e}  "
            f"{rate:,.0f} tok/s  elapsed {_clock(elapsed)}  ETA {_clock(eta)}")


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes:d}:{secs:02d}"
