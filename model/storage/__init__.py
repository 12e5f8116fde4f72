"""Storage, the model's lowest room: the one Google Cloud Storage client and its credential policy, gs:// URIs,
ranged reads and transfer_manager transfers, atomic and abandonable writes, crc32c, and the leases (files or objects
created only if absent) that the compile lease and the job's output lease are made of.

Free of JAX and Beam, and below every other room: it imports nothing from them. Importing the package loads nothing:
each module is imported where it is used."""
