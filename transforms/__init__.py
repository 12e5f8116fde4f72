"""Beam building blocks of the batch job: request parsing, the RunInference model handler, image/manifest outputs.

Each module is usable on its own; `pipeline/` only wires options to them. Nothing here imports `model` at module
level: the model (and JAX) is imported lazily inside the handler's `load_model`, so pickling a transform or
constructing a pipeline never pulls in the accelerator stack.
"""
