"""Defaults of the transforms' settings that the job's options declare (pipeline/option_specs.py), in a Beam-free
module: the command line checks its arguments against those options without importing Beam. Each is defined here
only; the transforms and the option table import it from here. (Beam-free modules own theirs: transforms/layout.py
the image encoding's, transforms/shards.py the shard size, transforms/inputs/columns.py the column names,
model/contract.py the request limits and sizes, model/options.py the load settings'.)"""

# What a record that does not give them gets (--num_images, --seed; transforms.inputs.validation.RequestDefaults).
DEFAULT_NUM_IMAGES = 1
DEFAULT_SEED = 0

# Images in the preview gallery (--preview; transforms.preview).
DEFAULT_PREVIEW = 64
# Extra columns of one record, as compact JSON (they are copied into every manifest row of its images;
# --max_metadata_bytes; transforms.inputs.validation).
DEFAULT_MAX_METADATA_BYTES = 16 * 1024
DEFAULT_INFERENCE_RETRIES = 2  # extra attempts for a failed inference batch (--inference_retries; transforms.inference)
# Seconds one generate call may take (--inference_timeout_s; transforms.inference): generous, since the first batch of
# each shape compiles within it (minutes for klein-4B on a TPU chip) and a 50-step base-model batch at 2048x2048 takes
# minutes too.
DEFAULT_INFERENCE_TIMEOUT_S = 1800
# Seconds one read of an input file or a reference image may take (--read_timeout_s; transforms.bounded_reads): a
# stall, not a file's size (reads are cut into 8 MiB pieces), so far above any healthy store's latency; a whole
# reference read (at most 4 bytes per --max_reference_pixels pixel plus 1 MiB, retries included) ends within it too.
DEFAULT_READ_TIMEOUT_S = 120
# Near-duplicate groups (transforms/duplicates.py): pHash bits apart; benchmarks/phash_distances.py measures why 4.
DEFAULT_NEAR_DUPLICATE_DISTANCE = 4
MAX_NEAR_DUPLICATE_DISTANCE = 16
