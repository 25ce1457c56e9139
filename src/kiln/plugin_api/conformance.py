"""Kiln's conformance kit, for a plugin's test suite: ``from kiln.plugin_api.conformance import *``
collects its tests and fixtures into the test module (see ``kiln.testing.conformance`` for what
each checks and the fixtures a plugin overrides)."""

from kiln.testing.conformance import *  # noqa: F403
from kiln.testing.conformance import __all__ as __all__
