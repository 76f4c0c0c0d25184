"""Ulysses sequence parallelism for the GPT: every sp rank of a replica holds a contiguous slice of each
sequence; attention all-to-alls from (sequence slice, all heads) to (whole sequence, heads / sp) and back through
DeepSpeed's `deepspeed.sequence.layer.DistributedAttention`. The model itself stays unaware: this module swaps each
block's attention core over the sequence group (dspipe.runtime.mesh.Mesh builds it) and sets the position offsets
(`shard_sequence`, called by dspipe.runtime.parallelize); the engine slices the batches (`local_slice`) and scales
the loss (`loss_share`).
"""

from __future__ import annotations

from dspipe.model.gpt import GPT, Attention


class _UlyssesCore:
    """Attention.core replacement: (batch, seq/sp, heads, head_dim) in and out, whole-sequence attention inside.
    The inner core is the block's own local_core, which therefore sees the whole sequence (for heads / sp heads):
    a sliding window counts whole-sequence positions, as without sp."""

    def __init__(self, attention: Attention, group):
        from deepspeed.sequence.layer import DistributedAttention

        # scatter the heads (dim 2), gather the sequence (dim 1); batch is dim 0
        self.spread = DistributedAttention(attention.local_core, group, scatter_idx=2, gather_idx=1)

    def __call__(self, q, k, v):
        return self.spread(q, k, v, 0)


def shard_sequence(model: GPT, *, group, start: int) -> None:
    """Make `model` work on the sequence slice that begins at token `start`: distributed attention in every block,
    positions (learned or rotary) offset by the slice start."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.core = _UlyssesCore(module, group)
            module.position_offset = start  # rotary angles of this slice's positions
    model.embed.position_offset = start  # learned positions of this slice


def local_slice(tensor, *, start: int, stop: int):
    """This rank's slice [start, stop) of dim 1 (the sequence) of a (batch, seq) tensor. Labels are sliced after
    they were shifted on the whole sequence, so every rank's last label is the next slice's first token."""
    return tensor[:, start:stop]


def loss_share(loss, *, sp: int):
    """A rank's share of its replica's mean loss: its own token mean x its tokens / the replica's tokens (every
    slice holds seq/sp tokens, all valid). The shares sum to the replica's loss over the sp group; dividing by the
    rank's own count instead would make the gradients sp times too large (AdamW hides it, clipping does not)."""
    return loss / sp
