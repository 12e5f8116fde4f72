"""The checkpoint's configs as typed values (transformer, text encoder, VAE, scheduler, the pipeline's class names),
read from its JSON files and checked: the room every other room of the model reads its sizes from.

JAX-free, and below nets, loading, engine and preflight: it imports nothing from them. Importing the package loads
nothing: each module is imported where it is used."""
