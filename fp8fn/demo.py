"""Train a small character-level GPT in fp8 with delayed scaling, next to a float32 baseline.

Run it with `python -m fp8fn.demo` (`--help` lists the flags). The text is Python's own help
pages (`pydoc_data.topics`), so nothing is downloaded. Both runs start from the same weights and
see the same batches in the same order; they differ only in whether the linear layers of the
transformer blocks run in float8:

* **fp8**: `fp8fn.transform(model, recipe, checkpoint_fn=<every Block>)`, trained with
  `torch.func.grad_and_value` over `(params, state)` and `fp8fn.update` after each step. The
  recipe is `--recipe`: `delayed` (`fp8fn.DelayedScaling()`, the default), `current`,
  `rowwise`, `blockwise` or `mx` (the last four are stateless: their state has no sites), or
  `nvfp4` (`fp8fn.NVFP4Scaling()`, 4-bit, emulated: its state holds only the random key of its
  stochastic rounding and Hadamard signs, seeded with `--seed`). The output layer (`head`)
  stays in float32, as is usual for fp8 training.
* **float32**: the same transform and training loop with no fp8 layers (`filter_fn` rejects
  all), so the comparison isolates the cost and the effect of the fp8 casts.

The optimizer is `fp8fn.optim.adamw`, a pair of pure functions (`init`, `update`) of
`{name: tensor}` dicts; `--optim` picks its moments for both runs: `adamw` (float32, the
default), `adamw-bf16` or `adamw-fp8` (block-scaled float8, docs/optim.md).

`--moe` gives each block a mixture of experts instead of its MLP (`MoE`: 4 experts, top 2, an
`nn.Linear` router; the experts are two 3-D weights run by `F.grouped_mm`, as transformers'
`grouped_mm` experts). The fp8 run's experts GEMMs run in float8 per expert (recipe `delayed`
or `current`), the router stays in float32 like the head; the header gives the share of the
matmul weights in float8 (`fn.summary()`).

`--seeds N` repeats both runs with the seeds `seed`, ..., `seed + N - 1` (other initial weights
and batches) and reports each loss and the fp8 - float32 gap as the mean ± standard deviation
over the seeds, so that the gap can be read against float32's own seed-to-seed spread.

`--threads` (default 1) sets torch's CPU threads. The demo's matrices are small, and with more
threads than free cores every parallel op waits for a thread that lost its core (OpenMP
threads spin while they wait): on a shared 2-core machine at load 3-4, `--steps 1` took 54 s
with two threads and 7 s with one, which keeps a fair share beside busy processes
(`benchmarks/demo_load.py` measures it).

Data parallel: `torchrun --nproc-per-node 2 -m fp8fn.demo` runs one process per rank (gloo on
CPU, NCCL with `--device cuda`, one GPU per `LOCAL_RANK`). Every rank draws the same batch and
trains on its `1 / world_size` share of it; after each backward the loss and the parameter
gradients are averaged over the ranks in one `all_reduce`, and the observations are combined
by `fp8fn.all_reduce` (the max over the ranks) before `fp8fn.update`, so every rank holds the
same parameters and scaling state. Only rank 0 prints (and saves `--plot`).

FSDP2: `torchrun --nproc-per-node 2 -m fp8fn.demo --fsdp` shards each run's model with
`fully_shard` (every `Block`, then the root) and trains it the usual way: `fp8fn.optim.AdamW` on
the module's own (sharded) parameters, plain autograd (`fp8fn.observe`, `loss.backward()`,
`fp8fn.observations`), `fp8fn.all_reduce` and `fp8fn.update`. FSDP2's hooks gather each block's
parameters just in time and reshard them after. With `delayed` or `current` the fp8 run's
linear weights are all-gathered in float8 (`fp8fn.float8_all_gather`, before `fully_shard`):
each rank casts its shard with the step's scale, and FSDP2 moves 1 byte per element. (Under
`--fsdp` the blocks are not recomputed in the backward, and `--compile` is not available.)

With `--compile` the step is `torch.compile(fp8fn.value_and_grad(loss_fn, argnums=(0, 1)))`:
the same gradients with respect to `(params, state)`, built on `torch.autograd.grad`, which
dynamo compiles with fp8fn's backward intact (fp8fn refuses to be compiled inside a `torch.func`
transform, where compilation would drop its backward, pytorch#193279). The loss (forward and
backward) is one compiled graph; the thin wrapper around `torch.autograd.grad` runs eagerly. The
checkpointed blocks are not traced (dynamo falls back to eager for `fp8fn.checkpoint`), so
`--compile --no-checkpoint` is the combination that compiles the whole model. The compiled fp8
run is not bit-identical to the eager one: inductor fuses LayerNorm and GELU, which changes
float32 rounding of the fp8 layers' inputs, and the casts amplify that. With `--device cuda` the
fp8 matmuls use `torch._scaled_mm` on GPUs that have it (sm >= 8.9).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import fp8fn

FORWARDS_THE_MODEL = True  # an error raised here is the demo's model's (`fp8fn.init` says so)

# ----------------------------------------------------------------------------- the model


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one `qkv` projection, SDPA, one output `proj`."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(
                f"fp8fn.demo: expected `d_model` divisible by `n_heads`, got {d_model} and "
                f"{n_heads}."
            )
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: `(batch, seq, d_model)` float32 -> `(batch, seq, d_model)` float32."""
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    """`fc2(gelu(fc1(x)))`, 4x wide."""

    def __init__(self, d_model: int):
        super().__init__()
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class MoE(nn.Module):
    """A mixture of `experts` GELU MLPs (2x wide), each token to its `top_k` best by a linear
    `router` (softmax weights over the chosen ones); the experts are 3-D weights `w_in`
    `(E, 2d, d)` and `w_out` `(E, d, 2d)`, run by `F.grouped_mm` on the tokens sorted by
    expert."""

    def __init__(self, d_model: int, experts: int = 4, top_k: int = 2):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(d_model, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, 2 * d_model, d_model) * 0.02)
        self.w_out = nn.Parameter(torch.randn(experts, d_model, 2 * d_model) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(tokens).softmax(-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        ids, order = chosen.flatten().sort(stable=True)
        offs = torch.bincount(ids, minlength=self.w_in.shape[0]).cumsum(0).int()
        rows = tokens[order // self.top_k]
        h = F.gelu(F.grouped_mm(rows, self.w_in.transpose(-2, -1), offs=offs))
        out = F.grouped_mm(h, self.w_out.transpose(-2, -1), offs=offs)
        out = out * weights.flatten()[order, None]
        combined = torch.zeros_like(tokens).index_add(0, order // self.top_k, out)
        return combined.reshape(x.shape)


class Block(nn.Module):
    """A pre-norm transformer block: `x + attn(ln1(x))`, then `x + mlp(ln2(x))` (`mlp` a `MoE`
    with `moe`)."""

    def __init__(self, d_model: int, n_heads: int, moe: bool = False):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MoE(d_model) if moe else MLP(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A character-level GPT: token and position embeddings, `Block`s, a linear `head`."""

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        d_model: int,
        n_layers: int,
        n_heads: int,
        moe: bool = False,
    ):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, moe) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The logits of the next character, or with `targets` their mean cross-entropy.

        Args:
          idx: `(batch, seq)` int64 character ids.
          targets: `(batch, seq)` int64, the ids that follow (`idx` shifted by one), or None.

        Returns:
          logits `(batch, seq, vocab_size)` float32 without `targets`; with them the loss,
          float32 `()`. Training takes the loss from the model, so that its output is not a
          view of the logits: FSDP2 warns that an in-place op on a view returned by a sharded
          module would skip its pre-backward hook.
        """
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# ----------------------------------------------------------------------------- the data


@dataclasses.dataclass
class Corpus:
    """Python's help texts as character ids, split 90/10 into train and validation."""

    chars: list[str]
    train: torch.Tensor  # (n_train,), int64
    val: torch.Tensor  # (n_val,), int64

    @classmethod
    def load(cls) -> Corpus:
        """The corpus: the texts of `pydoc_data.topics` (shipped with Python) joined in key
        order; `chars` is their sorted set of characters, and a character's id its index."""
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[key] for key in sorted(topics))
        chars = sorted(set(text))
        index = {c: i for i, c in enumerate(chars)}
        ids = torch.tensor([index[c] for c in text], dtype=torch.int64)
        n_train = int(0.9 * len(ids))
        return cls(chars, ids[:n_train], ids[n_train:])

    def encode(self, text: str) -> torch.Tensor:
        """The ids of `text`'s characters, int64 `(len,)`; characters not in `chars` dropped."""
        index = {c: i for i, c in enumerate(self.chars)}
        return torch.tensor([index[c] for c in text if c in index], dtype=torch.int64)

    def decode(self, ids) -> str:
        """The text of the ids `ids` (ints, or a tensor's `.tolist()`)."""
        return "".join(self.chars[i] for i in ids)


def batches(data: torch.Tensor, n: int, batch_size: int, seq_len: int, seed: int):
    """`n` batches `(x, y)` of random windows, `(batch_size, seq_len)` int64; `y` is `x` + 1."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        starts = torch.randint(len(data) - seq_len - 1, (batch_size,), generator=gen)
        window = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


# ----------------------------------------------------------------------------- the optimizer


ADAMW = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, decay_mask=lambda p: p.dim() >= 2)
OPTIMIZERS = {"adamw": "fp32", "adamw-bf16": "bf16", "adamw-fp8": "fp8"}  # --optim: moments


def optimizer(lr, moments: str = "fp32") -> fp8fn.optim.PureOptimizer:
    """The demo's AdamW, `fp8fn.optim.adamw`: betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on
    tensors of 2 or more dimensions only (weights and embeddings, not biases or norms).

    Args:
      lr: the learning rate: a float, or a schedule `lr(count)` of the steps taken.
      moments: "fp32", "bf16" or "fp8" (`fp8fn.optim.adamw`'s `moments`).
    """
    return fp8fn.optim.adamw(lr, moments=moments, **ADAMW)


def adamw_init(params: dict, moments: str = "fp32") -> fp8fn.optim.AdamWState:
    """The optimizer state of `params` (`{name: tensor}`): zero moments, step 0."""
    return optimizer(0.0, moments).init(params)


def adamw_update(params: dict, grads: dict, opt, lr: float):
    """One step of the demo's AdamW with learning rate `lr`: `(new_params, new_opt)`, nothing
    passed in modified (`fp8fn.optim.adamw`'s pure update)."""
    return optimizer(lr, opt.config.moments).update(grads, opt, params)


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warmup to `peak`, then cosine decay to `peak / 10`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


# ----------------------------------------------------------------------------- training


def functional_grad(loss_fn):
    """`(params, state, x, y) -> (loss, (param_grads, obs))` with `torch.func.grad_and_value`."""
    grad_and_value = torch.func.grad_and_value(loss_fn, argnums=(0, 1))

    def value_and_grad(params, state, x, y):
        grads, loss = grad_and_value(params, state, x, y)
        return loss, grads

    return value_and_grad


def compiled_grad(loss_fn):
    """The same with `torch.compile(fp8fn.value_and_grad(...))`: the route that compiles."""
    return torch.compile(fp8fn.value_and_grad(loss_fn, argnums=(0, 1)))


# ----------------------------------------------------------------------------- data parallel


@dataclasses.dataclass(frozen=True)
class Ranks:
    """Where this process runs: its rank among `world_size` (1 without torchrun)."""

    rank: int = 0
    world_size: int = 1
    backend: str | None = None  # "gloo" or "nccl" under torchrun
    owns_group: bool = False  # this process created the process group: it destroys it

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def __str__(self) -> str:
        return f"{self.world_size} rank{'s' * (self.world_size != 1)} ({self.backend})"

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous `1 / world_size` share of the batch dim of `t`."""
        n = t.shape[0] // self.world_size
        return t[self.rank * n : (self.rank + 1) * n]

    def average(self, loss: torch.Tensor, grads: dict) -> tuple[torch.Tensor, dict]:
        """The mean of `loss` and of each gradient over the ranks, in one `all_reduce`."""
        if self.world_size == 1:
            return loss, grads
        flat = torch.cat([loss.detach().reshape(1), *(g.flatten() for g in grads.values())])
        dist.all_reduce(flat)  # sum
        flat /= self.world_size
        sizes = [1, *(g.numel() for g in grads.values())]
        parts = flat.split(sizes)
        averaged = {k: part.view_as(g) for (k, g), part in zip(grads.items(), parts[1:])}
        return parts[0].reshape(()), averaged

    def combine(self, obs: fp8fn.State) -> fp8fn.State:
        """The observations of all ranks: `fp8fn.all_reduce`, the max of every amax."""
        return obs if self.world_size == 1 else fp8fn.all_reduce(obs)


def setup_ranks(device_type: str) -> tuple[Ranks, torch.device]:
    """Join the process group `torchrun` describes (`WORLD_SIZE`, `RANK`, `LOCAL_RANK`).

    Without `WORLD_SIZE` in the environment this is one process on `device_type`. Under
    torchrun: gloo on CPU, NCCL on CUDA with one GPU per `LOCAL_RANK`.
    """
    if "WORLD_SIZE" not in os.environ:
        return Ranks(), torch.device(device_type)
    device = torch.device(device_type)
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    ranks = Ranks(dist.get_rank(), dist.get_world_size(), dist.get_backend(), owns_group)
    return ranks, device


# ----------------------------------------------------------------------------- training steps


@torch.no_grad()
def batch_losses(apply, params, state, data_batches) -> list[float]:
    """The model's loss `apply(params, state, x, y)` on each of `data_batches` `(x, y)`."""
    return [apply(params, state, x, y).item() for x, y in data_batches]


def mean(losses: list[float]) -> float:
    """The mean of `losses`, summed in order (the same float for the same losses)."""
    return sum(losses) / len(losses)


class Run:
    """One training run: an `fp8fn.Transformed` model, its params, scaling and AdamW state.

    `step(x, y)` is the whole training step: gradients with respect to `(params, state)` on
    this rank's share of the batch, averaged (gradients) and max-combined (observations) over
    the ranks, AdamW on the params, `fp8fn.update` on the scaling state.
    """

    def __init__(self, name, fn, params, example, cfg, ranks=Ranks()):
        self.name, self.fn, self.cfg, self.ranks = name, fn, cfg, ranks
        self.params, self.state = params, fn.init(example, seed=cfg.seed)
        schedule = lambda count: learning_rate(int(count), cfg.steps, cfg.lr, cfg.warmup)  # noqa: E731
        self.optimizer = optimizer(schedule, OPTIMIZERS[cfg.optim])
        self.opt = self.optimizer.init(params)

        def loss_fn(params, state, x, y):
            return fn.apply(params, state, x, y)  # the model's own loss (`GPT.forward`)

        self.value_and_grad = compiled_grad(loss_fn) if cfg.compile else functional_grad(loss_fn)
        self.train_curve, self.val_curve, self.step_times = [], [], []

    def step(self, step: int, x: torch.Tensor, y: torch.Tensor) -> float:
        start = time.perf_counter()
        loss, (grads, obs) = self.value_and_grad(self.params, self.state, x, y)
        loss, grads = self.ranks.average(loss, grads)
        obs = self.ranks.combine(obs)
        grads, _ = fp8fn.optim.clip_by_global_norm(grads, 1.0)
        self.params, self.opt = self.optimizer.update(grads, self.opt, self.params)
        self.state = fp8fn.update(self.state, obs)
        loss = loss.item()  # waits for the step (on CUDA)
        self.step_times.append(time.perf_counter() - start)
        self.train_curve.append(loss)
        return loss

    def losses(self, data_batches) -> list[float]:
        return batch_losses(self.fn.apply, self.params, self.state, data_batches)

    def summary(self, train_fixed, val_fixed, curve_batches) -> dict:
        """Final params, state, curves, losses on fixed batches, median step time (ms).

        The val curve's last point is the mean over the first `curve_batches` of `val_fixed`,
        read from the final evaluation (the same losses, not computed twice)."""
        measured = self.step_times[min(5, len(self.step_times) - 1) :]  # skip warm-up
        val = self.losses(val_fixed)
        self.val_curve.append((len(self.train_curve), mean(val[:curve_batches])))
        return {
            "params": self.params,
            "state": self.state,
            "train_curve": self.train_curve,
            "val_curve": self.val_curve,
            "train_loss": mean(self.losses(train_fixed)),
            "val_loss": mean(val),
            "step_ms": 1000 * statistics.median(measured),
        }


class FsdpRun(Run):
    """A `Run` on an FSDP2 model (`--fsdp`): the module's own sharded parameters, trained with
    `fp8fn.optim.AdamW` (a torch.optim.Optimizer) and plain autograd.

    Args:
      name: "float32" or "fp8".
      model: this run's own model (FSDP2 changes it), before `fully_shard`.
      recipe: the fp8fn recipe; `filter_fn` picks the fp8 layers (none for float32).
      float8_all_gather: whether FSDP2 gathers the fp8 layers' weights in float8.
    """

    def __init__(self, name, model, recipe, filter_fn, example, cfg, ranks, float8_all_gather):
        from torch.distributed.fsdp import fully_shard

        self.name, self.cfg, self.ranks, self.model = name, cfg, ranks, model
        if float8_all_gather:
            fp8fn.float8_all_gather(model, filter_fn=filter_fn)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        with warnings.catch_warnings():  # converting no layer is the point of the baseline
            warnings.filterwarnings("ignore", "fp8fn.transform: no layer was converted")
            self.fn = fp8fn.transform(model, recipe, filter_fn=filter_fn)
        self.state = self.fn.init(example)
        decay = [p for p in model.parameters() if p.dim() >= 2]  # as `optimizer`
        rest = [p for p in model.parameters() if p.dim() < 2]
        self.opt = fp8fn.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=ADAMW["betas"],
            eps=ADAMW["eps"],
            moments=OPTIMIZERS[cfg.optim],
        )
        self.train_curve, self.val_curve, self.step_times = [], [], []

    @property
    def params(self) -> dict:
        return dict(self.model.named_parameters())

    def step(self, step: int, x: torch.Tensor, y: torch.Tensor) -> float:
        start = time.perf_counter()
        stateful = len(self.state) > 0
        observed = fp8fn.observe(self.state) if stateful else self.state
        loss = self.fn.apply(self.params, observed, x, y)
        loss.backward()  # FSDP2 reduce-scatters the gradients (their mean over the ranks)
        if stateful:
            obs = fp8fn.all_reduce(fp8fn.observations(observed))
            self.state = fp8fn.update(self.state, obs)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        for group in self.opt.param_groups:
            group["lr"] = learning_rate(step, self.cfg.steps, self.cfg.lr, self.cfg.warmup)
        self.opt.step()
        self.opt.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss)  # the mean over the ranks, for the report
        loss = loss.item() / self.ranks.world_size
        self.step_times.append(time.perf_counter() - start)
        self.train_curve.append(loss)
        return loss


def train(runs: list[Run], corpus: Corpus, cfg, device, ranks=Ranks()) -> dict:
    """Train `runs` in lockstep: every run takes step `i` on the same batch, one after the other.

    Interleaving makes the data order identical by construction and exposes both runs to the
    same machine load, so their step times compare fairly. Each rank trains on its share of
    every batch (`ranks.shard`); evaluation uses the whole fixed batches on every rank.

    Returns:
      `{run.name: run.summary(...)}`.
    """

    def fixed(data, seed):
        return [
            (x.to(device), y.to(device))
            for x, y in batches(data, cfg.eval_batches, cfg.batch_size, cfg.seq_len, seed)
        ]

    val_fixed, train_fixed = fixed(corpus.val, cfg.seed + 1), fixed(corpus.train, cfg.seed + 2)
    eval_every = max(1, cfg.steps // 10)
    data = batches(corpus.train, cfg.steps, cfg.batch_size, cfg.seq_len, cfg.seed)
    bar = tqdm(data, total=cfg.steps, desc="training", disable=cfg.quiet or not ranks.is_main)
    for step, (x, y) in enumerate(bar):
        x, y = ranks.shard(x).to(device), ranks.shard(y).to(device)
        losses = {run.name: f"{run.step(step, x, y):.3f}" for run in runs}
        if (step + 1) % eval_every == 0 and step + 1 < cfg.steps:  # the last: in `summary`
            for run in runs:
                run.val_curve.append((step + 1, mean(run.losses(val_fixed[:2]))))
        bar.set_postfix(losses)
    bar.close()
    return {run.name: run.summary(train_fixed, val_fixed, 2) for run in runs}


@torch.no_grad()
def sample(fn, params, state, corpus, prompt, n_chars, seq_len, seed, device) -> str:
    """`n_chars` characters sampled after `prompt` (temperature 0.8), with `fn`'s forward."""
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = corpus.encode(prompt).to(device)[None]
    for _ in range(n_chars):
        logits = fn.apply(params, state, ids[:, -seq_len:])[0, -1] / 0.8
        nxt = torch.multinomial(logits.softmax(-1), 1, generator=gen)
        ids = torch.cat([ids, nxt[None]], dim=1)
    return corpus.decode(ids[0].tolist())


# ----------------------------------------------------------------------------- the report


def fsdp_label(cfg, ranks) -> str:
    gather = " with float8 all-gathers" if cfg.recipe in FLOAT8_ALL_GATHER else ""
    return f"FSDP2 on {ranks}{gather}"


def report(cfg, results) -> str:
    """The final table as plain text, under a line saying what ran where."""
    base, fp8 = results["float32"], results["fp8"]
    ranks = results["ranks"]
    where = f"{cfg.device}, 1 process"
    if cfg.fsdp:
        where = f"{cfg.device}, {fsdp_label(cfg, ranks)}"
    elif ranks.world_size > 1:
        where = f"{cfg.device}, data parallel on {ranks}"
    label = f"fp8 ({cfg.recipe})"
    per_seed = results.get("seeds", [results])

    def cell(values, fmt):  # one seed: the value; several: mean ± sample standard deviation
        if len(values) == 1:
            return format(values[0], fmt)
        return f"{format(statistics.fmean(values), fmt)} ± {statistics.stdev(values):.{fmt[-2]}f}"

    def run_row(name, key):
        losses = [[r[key][f"{split}_loss"] for r in per_seed] for split in ("train", "val")]
        return (
            name,
            cell(losses[0], ".4f"),
            cell(losses[1], ".4f"),
            f"{results[key]['step_ms']:.1f}",
        )

    gaps = [[r[f"{split}_gap_pct"] for r in per_seed] for split in ("train", "val")]
    rows = [
        ("run", "train loss", "val loss", "step (ms)"),
        run_row("float32", "float32"),
        run_row(label, "fp8"),
        (
            "gap (%)",
            cell(gaps[0], "+.2f"),
            cell(gaps[1], "+.2f"),
            f"x{fp8['step_ms'] / base['step_ms']:.2f}",
        ),  # fmt: skip
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    caption = f"{cfg.steps} steps of {cfg.batch_size} sequences x {cfg.seq_len} chars ({where})"
    if cfg.optim != "adamw":
        caption += f", optimizer {cfg.optim}"
    if len(per_seed) > 1:
        seeds = ", ".join(str(r["config"]["seed"]) for r in per_seed)
        caption += f"\nmean ± standard deviation over {len(per_seed)} seeds ({seeds})"
    return "\n".join([caption, *lines])


def plot(path, cfg, results) -> None:
    """Save the loss curves (top) and the fp8 - float32 loss difference per step (bottom).

    Over several seeds (`--seeds`) each curve is the mean over the seeds, in a band from their
    minimum to their maximum.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_seed = results.get("seeds", [results])

    def band(ax, steps, curves, color, **kwargs):
        """The mean of `curves` (one list per seed) over `steps`, between their min and max."""
        columns = list(zip(*curves))
        ax.plot(steps, [statistics.fmean(c) for c in columns], color=color, **kwargs)
        if len(curves) > 1:
            low, high = [min(c) for c in columns], [max(c) for c in columns]
            ax.fill_between(steps, low, high, color=color, alpha=0.2, lw=0)

    fig, (ax, gap_ax) = plt.subplots(
        2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    label = f"fp8 ({cfg.recipe})"
    steps = range(1, cfg.steps + 1)
    val_steps = [s for s, _ in per_seed[0]["fp8"]["val_curve"]]
    for name, color in (("float32", "tab:blue"), ("fp8", "tab:orange")):
        band(ax, steps, [r[name]["train_curve"] for r in per_seed], color, alpha=0.35, lw=0.8)
        val = [[v for _, v in r[name]["val_curve"]] for r in per_seed]
        shown = name if name == "float32" else label
        band(ax, val_steps, val, color, marker="o", ms=3, label=f"{shown} (val)")
    ax.set_ylabel("cross-entropy (nats/char)")
    seeds = f"\nmean of {len(per_seed)} seeds, band from min to max" if len(per_seed) > 1 else ""
    ax.set_title(f"char-level GPT on Python's help texts: train (faint) and val{seeds}")
    ax.legend()

    def diff(r, curve):
        return [a - b for a, b in zip(r["fp8"][curve], r["float32"][curve])]

    train_diffs = [diff(r, "train_curve") for r in per_seed]
    gap_ax.axhline(0.0, color="black", lw=0.8)
    band(gap_ax, steps, train_diffs, "tab:orange", alpha=0.35, lw=0.8, label="train, per step")
    window = max(1, cfg.steps // 20)
    if window > 1:
        smooth = [[sum(d[max(0, i - window + 1) : i + 1]) / min(i + 1, window)
                   for i in range(len(d))] for d in train_diffs]  # fmt: skip
        band(gap_ax, steps, smooth, "tab:orange", lw=1.5, label=f"train, mean of {window}")
    val_diffs = [[a - b for (_, a), (_, b) in zip(r["fp8"]["val_curve"], r["float32"]["val_curve"])]
                 for r in per_seed]  # fmt: skip
    band(gap_ax, val_steps, val_diffs, "tab:red", marker="o", ms=3, ls="none", label="val")
    gap_ax.set_xlabel("step")
    gap_ax.set_ylabel(f"{label} - float32 loss")
    gap_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------- main


RECIPES = {
    "delayed": fp8fn.DelayedScaling,  # per tensor, scales from an amax history: has state
    "current": fp8fn.CurrentScaling,  # per tensor, from the tensor itself
    "rowwise": fp8fn.RowwiseScaling,  # per row, power-of-two scales (torchao "rowwise")
    "blockwise": fp8fn.BlockwiseScaling,  # 1x128 tiles, 128x128 weight blocks (DeepSeek-V3)
    "mx": fp8fn.MXScaling,  # OCP MXFP8: 32-element blocks, power-of-two E8M0 scales
    "nvfp4": fp8fn.NVFP4Scaling,  # 4-bit E2M1, 16-element blocks, SR and Hadamard (emulated)
}


FLOAT8_ALL_GATHER = ("delayed", "current")  # recipes whose weights FSDP2 gathers in float8


def build_parser() -> argparse.ArgumentParser:
    """The demo's command line (`python -m fp8fn.demo --help`)."""
    p = argparse.ArgumentParser(
        prog="python -m fp8fn.demo",
        description="Train a char-level GPT in fp8 (fp8fn) next to a float32 baseline. "
        "Data parallel: torchrun --nproc-per-node N -m fp8fn.demo [flags].",
    )

    def positive(value):
        n = int(value)
        if n < 1:
            raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
        return n

    p.add_argument("--steps", type=positive, default=400, help="training steps (default 400)")
    p.add_argument(
        "--recipe",
        choices=tuple(RECIPES),
        default="delayed",
        help="fp8 scaling recipe: delayed (default: scales from amax histories, the state), "
        "or the stateless current, rowwise, blockwise, mx (scales from each tensor), or nvfp4 "
        "(4-bit, emulated; its state is the random key)",
    )
    p.add_argument(
        "--checkpoint",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="recompute every Block in the backward (fp8fn checkpoint_fn; default on)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="train with torch.compile(fp8fn.value_and_grad(...)) instead of torch.func",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="under torchrun: shard the models with FSDP2 (fully_shard per block and root) and "
        "train with torch.optim; delayed and current gather the fp8 weights in float8",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu (float8 emulated; default) or cuda (delayed and current use "
        "torch._scaled_mm on sm >= 8.9)",
    )
    p.add_argument(
        "--plot", metavar="PATH", help="save the loss curves and the fp8 - float32 gap as a PNG"
    )
    p.add_argument(
        "--optim",
        choices=tuple(OPTIMIZERS),
        default="adamw",
        help="the optimizer of both runs, fp8fn.optim.adamw: adamw (float32 moments, default), "
        "adamw-bf16 (bfloat16 moments) or adamw-fp8 (block-scaled float8 moments)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of weights, data and sampling")
    p.add_argument(
        "--seeds",
        type=positive,
        default=1,
        help="repeat both runs with the seeds seed, seed+1, ... and report the losses and the "
        "gap as mean ± standard deviation over them, the fp8 gap beside float32's own "
        "seed-to-seed spread (default 1)",
    )
    p.add_argument(
        "--threads",
        type=positive,
        default=1,
        help="CPU threads per process (default 1: the demo's matrices are small, and on a "
        "busy machine more threads spin-wait for each other; see benchmarks/demo_load.py)",
    )
    p.add_argument("--d-model", type=positive, default=128, help="model width (default 128)")
    p.add_argument("--layers", type=positive, default=2, help="transformer blocks (default 2)")
    p.add_argument("--heads", type=positive, default=4, help="attention heads (default 4)")
    p.add_argument("--seq-len", type=positive, default=64, help="context in chars (default 64)")
    p.add_argument(
        "--batch-size",
        type=positive,
        default=32,
        help="sequences per step over all ranks; divisible by their number (default 32)",
    )
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument(
        "--eval-batches",
        type=positive,
        default=8,
        help="batches in the final train and val losses (default 8)",
    )
    p.add_argument(
        "--sample-chars",
        type=int,
        help="characters sampled from the fp8 model (default 200, or 0 with --quiet, which "
        "does not print the sample)",
    )
    p.add_argument(
        "--quiet",
        action="store_true",
        help="print only the final table (no progress bar, header or sample)",
    )
    p.add_argument(
        "--moe",
        action="store_true",
        help="a mixture of experts (4, top 2) in each block instead of its MLP; the experts "
        "run in float8 per expert (--recipe delayed or current)",
    )
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.sample_chars is None:
        args.sample_chars = 0 if args.quiet else 200
    if args.sample_chars < 0:
        p.error(f"--sample-chars: expected an integer >= 0, got {args.sample_chars}")
    if args.d_model % args.heads:
        p.error(f"--d-model ({args.d_model}) must be divisible by --heads ({args.heads})")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    if args.plot:  # checked before training, which a failing plot would throw away
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            p.error("--plot: needs matplotlib, which is not installed: pip install matplotlib")
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(folder):
            p.error(f"--plot: expected a path in an existing folder, got {args.plot}")
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if args.batch_size % world_size:
        p.error(
            f"--batch-size ({args.batch_size}) must be divisible by the number of ranks "
            f"({world_size})"
        )
    if args.fsdp:
        if "WORLD_SIZE" not in os.environ:
            p.error(
                "--fsdp: expected to run under torchrun, got one process. Run "
                "`torchrun --nproc-per-node 2 -m fp8fn.demo --fsdp`."
            )
        if args.compile:
            p.error("--fsdp: --compile is not available with FSDP2 in this demo")
        args.checkpoint = False  # fp8fn.checkpoint under FSDP2 is not part of this demo
    if args.moe:
        if args.recipe not in ("delayed", "current"):
            p.error(f"--moe: expected --recipe delayed or current, got {args.recipe}")
        if args.fsdp or args.compile:
            p.error("--moe: --fsdp and --compile are not available with experts in this demo")
    args.warmup = max(1, args.steps // 20)
    return args


def main(argv=None) -> dict:
    """Run the demo; returns the results (also printed as a table, on rank 0).

    Returns:
      `{"config": vars(args), "recipe": recipe, "ranks": Ranks, "float32": run, "fp8": run,
      "train_gap_pct": float, "val_gap_pct": float, "sample": str, "fp8_layers": [...],
      "checkpointed": [...]}` with each `run` as returned by `train`. Gaps are
      `100 * (fp8 - float32) / float32`.
    """
    cfg = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)  # restored after: tests call main in their process
    ranks, device = setup_ranks(cfg.device)
    try:
        return _main(cfg, ranks, device)
    finally:
        if ranks.owns_group:
            dist.destroy_process_group()
        torch.set_num_threads(threads)


def _main(cfg, ranks: Ranks, device: torch.device) -> dict:
    say = print if ranks.is_main else (lambda *args, **kwargs: None)
    corpus = Corpus.load()
    per_seed = []
    for i in range(cfg.seeds):
        seed_cfg = argparse.Namespace(**{**vars(cfg), "seed": cfg.seed + i})
        if i > 0:  # the header once, the sample of the first seed
            seed_cfg.quiet, seed_cfg.sample_chars = True, 0
        per_seed.append(compare(seed_cfg, corpus, ranks, device, say))
    results = {**per_seed[0], "config": vars(cfg), "seeds": per_seed}
    for split in ("train", "val"):
        gaps = [r[f"{split}_gap_pct"] for r in per_seed]
        results[f"{split}_gap_pct"] = statistics.fmean(gaps)
        results[f"{split}_gap_std"] = statistics.stdev(gaps) if len(gaps) > 1 else None
    if not cfg.quiet:
        say()
    say(report(cfg, results), flush=True)  # the table first: a failing plot cannot lose it
    if not cfg.quiet:
        say()
        say(f"sample from the fp8 model:\n{results['sample']}")
    if cfg.plot and ranks.is_main:
        plot(cfg.plot, cfg, results)
        if not cfg.quiet:
            say(f"\nloss curves saved to {cfg.plot}")
    return results


def compare(cfg, corpus: Corpus, ranks: Ranks, device: torch.device, say) -> dict:
    """The float32 and the fp8 run of one seed (`cfg.seed`): the results of `main` for it."""
    torch.manual_seed(cfg.seed)
    model = GPT(len(corpus.chars), cfg.seq_len, cfg.d_model, cfg.layers, cfg.heads, cfg.moe).to(
        device
    )
    init = {k: v.detach().clone() for k, v in model.named_parameters()}

    recipe = RECIPES[cfg.recipe]()
    checkpoint_fn = (lambda name, m: isinstance(m, Block)) if cfg.checkpoint else None

    def fp8_fn_filter(name, m):
        return name != "head" and not name.endswith("router")

    def no_layer(name, m):
        return False

    fp8_fn = fp8fn.transform(model, recipe, filter_fn=fp8_fn_filter, checkpoint_fn=checkpoint_fn)
    with warnings.catch_warnings():  # converting no layer is the point of the baseline
        warnings.filterwarnings("ignore", "fp8fn.transform: no layer was converted")
        hp_fn = fp8fn.transform(model, recipe, filter_fn=no_layer, checkpoint_fn=checkpoint_fn)
    if not cfg.quiet:
        n_params = sum(p.numel() for p in init.values())
        say(
            f"char-level GPT: {n_params / 1e6:.2f}M parameters, vocab {len(corpus.chars)}, "
            f"{len(corpus.train):,} train / {len(corpus.val):,} val chars; "
            f"{len(fp8_fn.layers)} fp8 layers ({recipe}), "
            f"checkpointed: {fp8_fn.checkpointed or 'none'}"
        )
        if ranks.world_size > 1 or cfg.fsdp:
            how = fsdp_label(cfg, ranks) if cfg.fsdp else "data parallel"
            if not cfg.fsdp:
                how += f" on {ranks}"
            say(f"{how}: {cfg.batch_size // ranks.world_size} sequences per rank and step")

    results = {
        "config": vars(cfg),
        "recipe": recipe,
        "ranks": ranks,
        "fp8_layers": list(fp8_fn.layers),
        "checkpointed": list(fp8_fn.checkpointed),
    }
    x0, _ = next(batches(corpus.train, 1, cfg.batch_size, cfg.seq_len, cfg.seed))
    x0 = ranks.shard(x0).to(device)
    if cfg.fsdp:  # each run shards its own copy of the model
        gather = cfg.recipe in FLOAT8_ALL_GATHER
        runs = [
            FsdpRun("float32", copy.deepcopy(model), recipe, no_layer, x0, cfg, ranks, False),
            FsdpRun("fp8", model, recipe, fp8_fn_filter, x0, cfg, ranks, gather),
        ]
        fp8_fn = runs[1].fn
    else:
        runs = [
            Run("float32", hp_fn, dict(init), x0, cfg, ranks),
            Run("fp8", fp8_fn, dict(init), x0, cfg, ranks),
        ]
    results["fp8_layers"] = list(fp8_fn.layers)  # with the experts weights `init` found
    if cfg.moe:
        results["float8_share"] = fp8_fn.summary().splitlines()[0]
        if not cfg.quiet:
            say(results["float8_share"])
    results.update(train(runs, corpus, cfg, device, ranks))
    for split in ("train", "val"):
        hp, lp = results["float32"][f"{split}_loss"], results["fp8"][f"{split}_loss"]
        results[f"{split}_gap_pct"] = 100 * (lp - hp) / hp
    fp8 = results["fp8"]
    results["sample"] = sample(
        fp8_fn,
        fp8["params"],
        fp8["state"],
        corpus,
        "The ",
        cfg.sample_chars,
        cfg.seq_len,
        cfg.seed,
        device,
    )
    return results


if __name__ == "__main__":
    main()
