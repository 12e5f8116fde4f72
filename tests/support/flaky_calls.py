"""A call that fails with a retryable error a given number of times, then works: what the retry tests wrap in a
google-api-core `Retry` policy (short delays) to see the policy and its hooks at work."""

from google.api_core import exceptions


def fails_then_works(policy, times: int, timeout: float | None = None):
    calls = []

    def call():
        calls.append(1)
        if len(calls) <= times:
            raise exceptions.ServiceUnavailable("try again")
        return "ok"

    policy = policy.with_delay(initial=0.001, maximum=0.002)  # a copy, as Beam's tests and ours make
    return (policy.with_timeout(timeout) if timeout is not None else policy)(call)
