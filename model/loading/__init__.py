"""From a checkpoint (local folder, gs:// prefix, Hugging Face Hub id or bundled preset) to its configs,
tokenizer and weights on the devices.

Importing the package loads nothing: each module is imported where it is used."""
