"""A plugin that fails to import (a missing dependency)."""

import a_package_that_is_not_installed  # noqa: F401
