"""The (data, model) device mesh and where each parameter lives on it.

Importing the package loads nothing: each module is imported where it is used."""
