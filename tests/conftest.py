"""Shared test configuration: fixtures live in tests/fixtures/, one module per concern."""

pytest_plugins = [
    "tests.fixtures.redis",
    "tests.fixtures.service",
    "tests.fixtures.threads",
]
