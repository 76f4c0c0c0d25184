"""The same GPT blocks as a DeepSpeed PipelineModule: LayerSpecs, a tied embedding/head pair, the loss at the end."""

from __future__ import annotations

from typing import Callable

from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

from dspipe.model.gpt import Block, Embedding, FinalNorm, LMHead, lm_loss
from dspipe.spec.model import ModelSpec

TIED_KEY = "embed"


def _tied_logits(embedding: Embedding, x):
    return embedding.logits(x)


class _MadeLayerSpec(LayerSpec):
    """A LayerSpec whose layer is made by `make(cls, *args, **kwargs)` (keeps cls as its typename, which
    DeepSpeed's type: partitioning and checkpointable_layers read)."""

    def __init__(self, make: Callable, typename, *args, **kwargs):
        super().__init__(typename, *args, **kwargs)
        self.make = make

    def build(self, log=False):
        return self.make(self.typename, *self.module_args, **self.module_kwargs)


class _MadeTiedLayerSpec(TiedLayerSpec):
    def __init__(self, make: Callable, key, typename, *args, **kwargs):
        super().__init__(key, typename, *args, **kwargs)
        self.make = make

    def build(self, log=False):
        return self.make(self.typename, *self.module_args, **self.module_kwargs)


def layer_specs(*, model: ModelSpec, seed: int, make: Callable | None = None) -> list[LayerSpec]:
    """Embedding, one LayerSpec per block, final norm, head (tied to the embedding's wte when asked). `make`: how
    a layer is made from (cls, model, **kwargs) (default: cls(model, **kwargs), which fills it from `seed`)."""

    def spec(cls, *args, **kwargs):
        return LayerSpec(cls, *args, **kwargs) if make is None else _MadeLayerSpec(make, cls, *args, **kwargs)

    def tied(*args, **kwargs):
        return TiedLayerSpec(*args, **kwargs) if make is None else _MadeTiedLayerSpec(make, *args, **kwargs)

    if model.tied_embeddings:
        first = tied(TIED_KEY, Embedding, model, seed=seed, tied_weight_attr="wte.weight")
        last = tied(TIED_KEY, Embedding, model, seed=seed, forward_fn=_tied_logits, tied_weight_attr="wte.weight")
    else:
        first, last = spec(Embedding, model, seed=seed), spec(LMHead, model, seed=seed)
    blocks = [spec(Block, model, index=i, seed=seed) for i in range(model.layers)]
    return [first, *blocks, spec(FinalNorm, model, seed=seed), last]


class GPTPipeline(PipelineModule):
    """PipelineModule that counts each layer's parameters (partition_method 'parameters') from a meta-device build
    of the whole layer: no rank draws or allocates the layers of other stages to count them, and every tensor-
    parallel rank counts the same (whole) sizes, so all agree on the stage boundaries even where shards differ in
    size (an uneven vocabulary split)."""

    def _count_layer_params(self):
        import torch

        counts = []
        for spec in self._layer_specs:
            if not isinstance(spec, LayerSpec):
                counts.append(0)
                continue
            with torch.device("meta"):
                layer = spec.typename(*spec.module_args, **{**spec.module_kwargs, "seed": None})
            counts.append(sum(p.numel() for p in layer.parameters() if p.requires_grad))
        return counts


def build_pipeline(
    *,
    model: ModelSpec,
    stages: int,
    partition_method: str,
    activation_checkpoint_interval: int,
    checkpoint_fn: Callable,
    seed: int,
    topology=None,
    make: Callable | None = None,
    loss_fn: Callable = lm_loss,
) -> PipelineModule:
    """Full recomputation goes through the pipeline's activation_checkpoint_interval (blocks only); selective
    recomputation is wired into the blocks afterwards (dspipe.runtime.parallelize.recompute). `topology`: DeepSpeed's
    process topology when the stages are tensor-parallel too (None: pipe x data); `make`: layer_specs's."""
    return GPTPipeline(
        layers=layer_specs(model=model, seed=seed, make=make),
        num_stages=None if topology is not None else stages,
        topology=topology,
        loss_fn=loss_fn,
        partition_method=partition_method,
        activation_checkpoint_interval=activation_checkpoint_interval,
        activation_checkpoint_func=checkpoint_fn,
        checkpointable_layers=["Block"],
    )
