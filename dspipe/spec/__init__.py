"""The package's vocabulary: what the user asks for (core: model, cluster, training, strategy specs and their
limits), the model presets, the GPU catalog, measured profiles and the rank layout. Below planner/, model/ and
runtime/; imports neither torch nor deepspeed."""
