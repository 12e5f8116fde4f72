"""The Beam metrics namespace of the job: every counter and distribution the job reports is under it."""

NAMESPACE = "flux2"
