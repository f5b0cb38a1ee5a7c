"""A user model module that cannot be imported: it needs a package that is not installed."""

import package_that_is_not_installed  # noqa: F401


def build():
    raise AssertionError("never reached")
