"""The process groups of a tensor-parallel layout, as DeepSpeed's engine asks for them (its `mpu`).

pp > 1   DeepSpeed's PipeModelDataParallelTopology (axes pipe, data, model: the model (tp) axis varies fastest,
         as dspipe.spec.layout orders its ranks); the PipelineModule builds its PipelineParallelGrid from it,
         whose slice group is the tp group (`topology`).
pp = 1   `Mesh`: data x Ulysses sequence x tensor groups from the layout itself, with tp or sp > 1 (DeepSpeed's own
         Ulysses groups, parallel_state_sp, assume the sequence ranks are neighbours, which they are not once tp is
         the fastest axis, and name the sequence group the model-parallel group, which leaves its BF16_Optimizer
         no gradient to take the norm of on sequence ranks > 0): data-parallel groups without the sp and tp
         ranks, sequence-data groups (ZeRO partitions and gradients are reduced over them), sequence groups
         (Ulysses' all-to-alls) and the tp group, which is also the model-parallel group (the gradient norm and
         overflow checks).
"""

from __future__ import annotations

from dspipe.spec.layout import ParallelLayout


def topology(layout: ParallelLayout):
    """DeepSpeed's pipeline topology of `layout` (sp 1: the Ulysses axis has no place in it)."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    if layout.sp != 1:
        raise RuntimeError(f"sp {layout.sp} with tp {layout.tp}: the tensor x pipeline mesh has no sequence axis")
    return PipeModelDataParallelTopology(num_pp=layout.pp, num_mp=layout.tp, num_dp=layout.dp)


def _groups(layout: ParallelLayout, rank: int, *axes: str):
    """Collective: a process group for every set of ranks that differ only along `axes` (every rank creates every
    group, in the same order); returns this rank's (group, its sorted ranks)."""
    import torch.distributed as dist

    mine = None
    seen = set()
    for r in range(layout.world):
        if r in seen:
            continue
        c = layout.coords(r)
        ranks = sorted(
            {layout.rank_of(**{**c, **dict(zip(axes, point, strict=True))}) for point in _points(layout, axes)}
        )
        seen.update(ranks)
        group = dist.new_group(ranks=ranks)
        if rank in ranks:
            mine = (group, ranks)
    return mine


def _points(layout: ParallelLayout, axes: tuple[str, ...]):
    points = [()]
    for axis in axes:
        points = [p + (i,) for p in points for i in range(layout.sizes[axis])]
    return points


class Mesh:
    """The mpu of a pp = 1 tensor-parallel layout (see the module's docstring). Collective to build."""

    def __init__(self, layout: ParallelLayout, *, rank: int):
        if layout.pp != 1:
            raise RuntimeError(f"pp {layout.pp}: a pipeline's mpu is its PipelineModule's grid")
        self.layout, self.rank, self.coords = layout, rank, layout.coords(rank)
        self.data, self.data_ranks = _groups(layout, rank, "data")
        self.seq_data, self.seq_data_ranks = _groups(layout, rank, "data", "seq")
        self.seq, self.seq_ranks = _groups(layout, rank, "seq")
        self.tensor, self.tensor_ranks = _groups(layout, rank, "tensor")

    def get_data_parallel_group(self):
        return self.data

    def get_data_parallel_rank(self) -> int:
        return self.coords["data"]

    def get_data_parallel_world_size(self) -> int:
        return self.layout.dp

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.data_ranks

    def get_sequence_data_parallel_group(self):
        return self.seq_data

    def get_sequence_data_parallel_rank(self) -> int:
        return self.seq_data_ranks.index(self.rank)

    def get_sequence_data_parallel_world_size(self) -> int:
        return len(self.seq_data_ranks)

    def get_sequence_parallel_group(self):
        return self.seq

    def get_sequence_parallel_rank(self) -> int:
        return self.coords["seq"]

    def get_sequence_parallel_world_size(self) -> int:
        return self.layout.sp

    def get_model_parallel_group(self):
        return self.tensor

    def get_model_parallel_rank(self) -> int:
        return self.coords["tensor"]

    def get_model_parallel_world_size(self) -> int:
        return self.layout.tp

    get_tensor_model_parallel_group = get_slice_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_slice_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_slice_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.tensor_ranks[0]

    def get_pipe_parallel_rank(self) -> int:
        return 0

    def get_pipe_parallel_world_size(self) -> int:
        return 1


def tensor_group(layout: ParallelLayout, *, rank: int, sequence_parallel: bool):
    """This rank's TensorGroup (its group set by whoever builds the process groups)."""
    from dspipe.runtime.tensor_parallel import TensorGroup

    return TensorGroup(rank=layout.coords(rank)["tensor"], size=layout.tp, sequence_parallel=sequence_parallel)
