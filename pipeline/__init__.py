"""Wires the pipeline options to the transforms: `python -m pipeline.run`."""
