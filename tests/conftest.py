"""Shared test configuration: fixtures live in tests/fixtures/, one module per concern."""

import os

# Servers that tests start as child processes leave the HTTP front off unless the test gives it a
# port: its default port (8080) is one for the whole host, and tests run side by side.
os.environ.setdefault("SSDRBM_HTTP_PORT", "0")
# Workers that tests start run one training slot, whatever the machine's cores: tests speak of
# "the worker" taking jobs in turn (the slot tests ask for more).
os.environ.setdefault("SSDRBM_WORKER_SLOTS", "1")

pytest_plugins = [
    "tests.fixtures.browser",
    "tests.fixtures.redis",
    "tests.fixtures.service",
    "tests.fixtures.threads",
]
