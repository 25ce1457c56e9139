"""Kiln's test plugin: a platform, a general plugin and their misbehaving variants.

Environment variables switch each behaviour on, so the package can stay installed:
- KILN_TEST_PLATFORM=1          the ``kiln_test`` platform activates
- KILN_TEST_PLATFORM=misnamed   ... as a class whose ``Platform.name`` differs from the entry point
- KILN_TEST_PLATFORM_B=1        a second out-of-tree platform activates too
- KILN_TEST_OLD_API=1           a platform written for platform API 0.x activates
- KILN_TEST_BROKEN_DETECTOR=1   the ``kiln_test_broken`` detector raises
- KILN_TEST_FAIL_REGISTER=1     the ``kiln_test_failing`` general plugin raises
- KILN_TEST_PATCH=good|drift|missing|warn   the general plugin declares a patch of that kind
- KILN_TEST_WRONG_OP=1          the general plugin also registers a wrong op implementation
- KILN_TEST_BAD_CLASS=missing|signature     the platform names a communicator that does not
                                            implement the interface
- KILN_TEST_RUNNER=interface-only          the platform names a model runner with exactly
                                            ``ModelRunnerBase``'s members
- KILN_TEST_BAD_CLASS=unresolvable          ... a communicator path that does not resolve
- KILN_TEST_BAD_CLASS=attention             ... an attention backend that does not subclass
                                            ``AttentionBackend``
- KILN_TEST_BAD_CLASS=chunk-blind           ... an attention backend that ignores the cached
                                            context of a prefill chunk (a prefix-cache hit too)
- KILN_TEST_BAD_CLASS=copy-reduce           ... a communicator whose all_reduce returns its input
- KILN_TEST_BAD_CLASS=over-budget           ... a scheduler that schedules past the token budget
- KILN_TEST_BAD_CLASS=dynamic               ... a scheduler that changes its budget each step
                                            (within the contract)
- KILN_TEST_COMMUNICATOR_LOG=PATH           the platform's communicator notes in PATH which
                                            collectives each rank ran
- KILN_TEST_GRAPH_LOG=PATH                  the platform's graph wrapper notes in PATH each capture
                                            (parallel sizes, rank, buckets)
- KILN_TEST_NON_IDEMPOTENT=raise|grow       the general plugin's register() raises when run
                                            again, or registers one more model each run
"""

from __future__ import annotations

import os

REGISTER_CALLS: list[int] = []
"""One entry per call of ``register`` in this process (tests check idempotence with it)."""


def detect_test_platform() -> str | None:
    if os.environ.get("KILN_TEST_PLATFORM") == "misnamed":
        return "kiln_test_plugin.platform.MisnamedPlatform"
    return (
        "kiln_test_plugin.platform.TestPlatform" if os.environ.get("KILN_TEST_PLATFORM") else None
    )


def detect_second_platform() -> str | None:
    if os.environ.get("KILN_TEST_PLATFORM_B"):
        return "kiln_test_plugin.platform.SecondPlatform"
    return None


def detect_old_api_platform() -> str | None:
    return (
        "kiln_test_plugin.platform.OldApiPlatform" if os.environ.get("KILN_TEST_OLD_API") else None
    )


def detect_broken() -> str | None:
    if os.environ.get("KILN_TEST_BROKEN_DETECTOR"):
        raise RuntimeError("probe of the kiln_test_broken device failed")
    return None


def register() -> None:
    """Register everything through Kiln's public registries (idempotent)."""
    from kiln_test_plugin import registration

    REGISTER_CALLS.append(os.getpid())
    registration.register_all(os.environ.get("KILN_TEST_PATCH"))


def register_failing() -> None:
    if os.environ.get("KILN_TEST_FAIL_REGISTER"):
        raise RuntimeError("kiln_test_failing could not register")
