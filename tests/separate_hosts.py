"""The tests' name for ``loraflow.dev.separate_hosts`` (local processes standing in for separate hosts)."""

from loraflow.dev.separate_hosts import HOST_DIRS, host_dirs

__all__ = ["HOST_DIRS", "host_dirs"]
