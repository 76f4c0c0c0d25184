"""The package's vocabulary: what the user asks for (model, cluster, train, strategy: the specs, checked by checks
against values; core: the four together, their settings and limits), the model presets, the GPU catalog, measured
profiles and the rank layout. Below planner/, model/ and runtime/; imports neither torch nor deepspeed."""
