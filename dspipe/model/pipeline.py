"""The same GPT blocks as a DeepSpeed PipelineModule: LayerSpecs, a tied embedding/head pair, the loss at the end."""
from __future__ import annotations

from typing import Callable

from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

from dspipe.errors import SpecError
from dspipe.model.gpt import Block, Embedding, FinalNorm, LMHead, lm_loss
from dspipe.spec.core import ModelSpec

TIED_KEY = "embed"


def _tied_logits(embedding: Embedding, x):
    return embedding.logits(x)


def layer_specs(*, model: ModelSpec, seed: int) -> list[LayerSpec]:
    """Embedding, one LayerSpec per block, final norm, head (tied to the embedding's wte when asked)."""
    if model.experts:
        raise SpecError(f"model.experts {model.experts}: a mixture-of-experts model does not run as a pipeline "
                        f"(pp 1 only: the stages would drop the load-balancing loss)")
    if model.tied_embeddings:
        first = TiedLayerSpec(TIED_KEY, Embedding, model, seed=seed, tied_weight_attr="wte.weight")
        last = TiedLayerSpec(TIED_KEY, Embedding, model, seed=seed, forward_fn=_tied_logits,
                             tied_weight_attr="wte.weight")
    else:
        first, last = LayerSpec(Embedding, model, seed=seed), LayerSpec(LMHead, model, seed=seed)
    blocks = [LayerSpec(Block, model, index=i, seed=seed) for i in range(model.layers)]
    return [first, *blocks, LayerSpec(FinalNorm, model), last]


def build_pipeline(*, model: ModelSpec, stages: int, partition_method: str, activation_checkpoint_interval: int,
                   checkpoint_fn: Callable, seed: int) -> PipelineModule:
    """Full recomputation goes through the pipeline's activation_checkpoint_interval (blocks only); selective
    recomputation is wired into the blocks afterwards (dspipe.runtime.parallelize.recompute)."""
    return PipelineModule(layers=layer_specs(model=model, seed=seed), num_stages=stages, loss_fn=lm_loss,
                          partition_method=partition_method,
                          activation_checkpoint_interval=activation_checkpoint_interval,
                          activation_checkpoint_func=checkpoint_fn, checkpointable_layers=["Block"])
