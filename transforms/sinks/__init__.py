"""Where a job's generated images go: one sink per --output_format, behind one interface (base.Sink).

    registry.py    the output formats: one row per sink (its --output_format value, what it writes, its class)
    base.py        the Sink interface (plan before generation, expand after it), its settings and the keys of the
                   collections it receives and returns
    files.py       --output_format files: one object per image, metadata.jsonl
    webdataset.py  --output_format webdataset: tar shards placed by the input alone (transforms/shards.py)
    encoding.py    the one image encoding (PNG, WebP, JPEG) and the text every image carries
    writes.py      atomic writes, and the encoder-thread pool every sink stores its images with
    existing.py    what an output already holds (--skip_existing): images checked against their tasks

Every sink's manifest rows come from the one builder, `transforms.layout.manifest_row`, and every image's identity
(what it records of its request and model, in its text and rows alike) from `transforms.identity`.

Nothing is imported here, so that a Beam-free module (such as `registry`, which the option table reads) stays so.
"""
