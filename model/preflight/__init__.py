"""Compiling the generator's programs for a TPU topology this machine does not have, and what fits a chip.

Importing the package loads nothing: each module is imported where it is used."""
