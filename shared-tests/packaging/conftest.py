"""Registers the ``slow`` marker here, beside its only users, so it is known whether pytest
is started from the repository root or from inside this folder."""


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than a few seconds (still runs by default)")
