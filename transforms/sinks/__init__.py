"""Where a job's generated images go, and the pieces every output is made with.

    encoding.py    the one image encoding (PNG, WebP, JPEG) and the text every image carries
    writes.py      atomic writes, and the encoder-thread pool that stores images
    existing.py    what an output already holds (--skip_existing): images checked against their tasks
"""
