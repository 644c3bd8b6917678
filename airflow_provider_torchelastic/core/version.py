"""The provider's version: one place, read by packaging (pyproject's dynamic version), provider info and the
payload header (which the runner compares). Here, not in the package's ``__init__``, so that the pure core reads it
without importing the public surface."""

__version__ = "0.1.0"
