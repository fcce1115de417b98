"""Shared by every suite under shared-tests/: marker registration."""


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than a few seconds (still runs by default)")
