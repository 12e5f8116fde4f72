"""The job's command-line errors, shared by pipeline/run.py and pipeline/demo.py (re-exported by pipeline.run)."""


class UsageError(ValueError):
    """A bad combination of options, reported without a traceback."""
