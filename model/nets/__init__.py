"""The networks (Qwen3 text encoder, Flux2 transformer, VAE) in Flax NNX, their layers, attention kernels and
the flow-match schedule.

Importing the package loads nothing: each module is imported where it is used."""
