"""The generator: its compiled programs per shape bucket, the compile lease and counts, the runtime start,
reference images and the per-shape caches.

Importing the package loads nothing: each module is imported where it is used."""
