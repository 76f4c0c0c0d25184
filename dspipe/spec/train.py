"""TrainSpec: how long and how hard to train (batch, steps, lr, checkpoints, evaluation).

A plain frozen dataclass, validated on construction. No torch, no deepspeed.
"""

from __future__ import annotations

from dataclasses import dataclass

from dspipe.errors import SpecError
from dspipe.spec.checks import add_limits, flag, int_range, limit, number, one_of, positive, show, text
from dspipe.spec.settings import FIELD_DEFAULT, setting
from dspipe.spec.values import DATA_ORDERS, PRECISIONS, token_count

INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class TrainSpec:
    """How long and how hard to train."""

    global_batch: int = setting(kind="int", limit=2**24, cli_default=256, help="sequences per optimizer step")
    """Sequences per optimizer step, across all data-parallel ranks."""
    micro_batch: int = setting(
        kind="auto_int", limit=2**24, section="strategy", after="", help="sequences per rank per forward [auto]"
    )
    """Sequences per forward/backward on one rank."""
    steps: int = setting(
        kind="int", limit=INT32_MAX, fallback=1000, help="optimizer steps [default: {fallback}; or from --tokens]"
    )
    """Optimizer steps to run."""
    lr: float = setting(6e-4, kind="float", limit=1.0, cli_default=FIELD_DEFAULT, help="peak learning rate")
    """Peak learning rate reached after warmup."""
    min_lr_ratio: float = setting(0.1, kind="float", cli_default=FIELD_DEFAULT, help="final lr / peak lr")
    """Final learning rate of the cosine decay, as a fraction of lr."""
    warmup_steps: int = setting(
        100,
        key="warmup",
        kind="int",
        limit=INT32_MAX,
        help="lr warmup steps [default: steps/10, at least 1, at most 2000]",
    )
    """Linear warmup length in optimizer steps."""
    weight_decay: float = setting(
        0.1, kind="float", limit=1.0, cli_default=FIELD_DEFAULT, help="AdamW weight decay (not on biases and norms)"
    )
    """AdamW decoupled weight decay (not applied to biases and norms)."""
    grad_clip: float = setting(
        1.0, kind="float", limit=1e6, cli_default=FIELD_DEFAULT, help="global gradient-norm clipping"
    )
    """Global gradient-norm clipping threshold."""
    precision: str = setting(
        "bf16",
        kind="auto_choice",
        choices=PRECISIONS,
        section="strategy",
        after="nvme_path",
        help="[auto: bf16 on GPUs, fp32 on cpu]",
    )
    """bf16, fp16 or fp32 training."""
    seed: int = setting(1234, kind="int", limit=2**32 - 1, cli_default=FIELD_DEFAULT, help=None)
    """Seed for weights, data order and dropout."""
    log_interval: int = setting(
        10, kind="int", limit=INT32_MAX, cli_default=FIELD_DEFAULT, section="logging", help="steps between log lines"
    )
    """Print and record metrics every this many steps."""
    save_interval: int = setting(
        1000,
        kind="auto_int",
        limit=INT32_MAX,
        cli_default=FIELD_DEFAULT,
        help="steps between checkpoints (0: only at the end and on SIGTERM/SIGINT; auto: "
        "gen-config's Young interval from the write time and the failure rate)",
    )
    """Save a DeepSpeed checkpoint every this many steps (0: only at the end and on SIGTERM/SIGINT)."""
    keep_checkpoints: int = setting(
        3,
        kind="int",
        limit=10**6,
        cli_default=FIELD_DEFAULT,
        help="complete checkpoints to keep (older ones are deleted)",
    )
    """Keep the newest this many complete checkpoints; older ones are deleted."""
    keep_every: int = setting(
        0,
        kind="int",
        limit=INT32_MAX,
        cli_default=FIELD_DEFAULT,
        help="also keep, for good, every checkpoint at a multiple of this many steps (0: none)",
    )
    """Milestones: a checkpoint at a multiple of this many steps is never deleted by keep_checkpoints (0: none)."""
    async_save: bool = setting(
        True,
        kind="bool",
        flag="--async-save/--sync-save",
        cli_default=FIELD_DEFAULT,
        help="write checkpoints in the background: the step waits only for a copy of the rank's state in host memory",
    )
    """Checkpoint files written by a background process per rank (dspipe.runtime.async_save); False: in the step."""
    compile: bool = setting(
        False,
        kind="bool",
        flag="--compile/--no-compile",
        cli_default=FIELD_DEFAULT,
        help="torch.compile every transformer block (one compiled graph serves all the blocks "
        "of a kind; the first steps pay the compilation)",
    )
    """torch.compile each transformer block in place (dspipe.runtime.parallelize.compile_blocks), as torchtitan does:
    the norms, activations, residual adds and rotary fuse into few kernels; the attention and GEMMs stay the same."""
    eval_interval: int = setting(
        100, kind="int", limit=INT32_MAX, cli_default=FIELD_DEFAULT, help="steps between validation passes (0: none)"
    )
    """Validation loss and perplexity every this many steps and at the end (0: never)."""
    eval_batches: int = setting(
        10,
        kind="int",
        limit=INT32_MAX,
        cli_default=FIELD_DEFAULT,
        help="micro-batches per data-parallel rank in one validation pass",
    )
    """Micro-batches per data-parallel rank in one validation pass (capped by the validation split)."""
    max_skipped_steps: int = setting(
        10,
        kind="int",
        limit=INT32_MAX,
        cli_default=FIELD_DEFAULT,
        help="consecutive non-finite steps before the run saves and stops (0: never)",
    )
    """Save and stop after this many consecutive steps skipped for a non-finite loss or gradient norm (0: never)."""
    spike_window: int = setting(
        100, kind="int", limit=2**20, cli_default=FIELD_DEFAULT, help="steps of loss history for loss-spike detection"
    )
    """Steps of recent loss that a loss spike is measured against."""
    spike_sigma: float = setting(
        4.0,
        kind="float",
        limit=1e6,
        cli_default=FIELD_DEFAULT,
        help="log a loss spike above mean + this many std of the window",
    )
    """A loss above mean + this many standard deviations of the window is logged as a spike."""
    data_order: str = setting(
        "dspipe",
        kind="choice",
        choices=DATA_ORDERS,
        section="data",
        after="data",
        cli_default=FIELD_DEFAULT,
        help="dspipe: fixed windows per source, a seeded permutation every epoch; megatron: "
        "Megatron-LM's GPTDataset/BlendedDataset order for the same seed (Megatron "
        "prefixes only)",
    )
    """The training sample order: dspipe's (dspipe.data.loader) or Megatron-LM's (dspipe.data.megatron_order)."""
    tokens: str | None = setting(
        None,
        kind="tokens",
        limit=1e18,
        after="steps",
        help="the run's length as a token budget (300B, 1.5T, 2e9) instead of --steps",
    )
    """The token budget as the user gave it ('300B', '1.5T', '2e9'), from which gen-config derived steps =
    ceil(tokens / (global_batch x seq_len)); None: steps was given directly. Kept as written (shown in plan,
    gen-config and the runner's first line); `dspipe extend` may lengthen steps past it."""
    init_from: str | None = setting(
        None,
        section="model",
        after="model",
        metavar="HF_DIR",
        help="continue pretraining a Hugging Face directory (GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM, "
        "Qwen3ForCausalLM, MistralForCausalLM): its config is the model, its weights step 0 (prepare the data "
        "with --tokenizer HF_DIR)",
    )
    """Hugging Face model directory whose weights initialise step 0 (None: dspipe's seeded initialisation)."""

    def __post_init__(self) -> None:
        positive(
            "train",
            global_batch=self.global_batch,
            micro_batch=self.micro_batch,
            steps=self.steps,
            warmup_steps=self.warmup_steps,
            log_interval=self.log_interval,
            keep_checkpoints=self.keep_checkpoints,
        )
        for name in ("save_interval", "eval_interval", "max_skipped_steps", "keep_every"):
            int_range("train", name, getattr(self, name), low=0)
        if self.keep_every and self.save_interval and self.keep_every % self.save_interval:
            raise SpecError(
                f"train.keep_every {self.keep_every} is not a multiple of save_interval "
                f"{self.save_interval} ({self.keep_every} % {self.save_interval} = "
                f"{self.keep_every % self.save_interval}): "
                "no checkpoint would be saved at a multiple of it"
            )
        positive("train", eval_batches=self.eval_batches, spike_window=self.spike_window)
        int_range("train", "seed", self.seed, low=0)
        number(
            "train",
            "spike_sigma",
            self.spike_sigma,
            low=0,
            high=limit("spike_sigma"),
            low_open=True,
            rule="must be positive",
        )
        if self.tokens is not None:
            text("train", "tokens", self.tokens)
            count = token_count(self.tokens)
            if count is None:
                raise SpecError(
                    f"train.tokens {show(self.tokens)} is not a token count like 300B, 1.5T or 2e9 "
                    f"(allowed: finite, (0, {limit('tokens'):g}])"
                )
            if count > limit("tokens"):
                raise SpecError(
                    f"train.tokens {show(self.tokens)} is too large (allowed: finite, (0, {limit('tokens'):g}])"
                )
        one_of("train", "precision", self.precision, PRECISIONS)
        one_of("train", "data_order", self.data_order, DATA_ORDERS)
        number("train", "lr", self.lr, low=0, high=limit("lr"), low_open=True, rule="must be positive")
        number("train", "min_lr_ratio", self.min_lr_ratio, low=0, high=1, rule="must be in [0, 1]")
        for name in ("weight_decay", "grad_clip"):
            number("train", name, getattr(self, name), low=0, high=limit(name), rule="must be >= 0")
        text("train", "init_from", self.init_from, optional=True)
        flag("train", "async_save", self.async_save)
        flag("train", "compile", self.compile)


add_limits(TrainSpec)
