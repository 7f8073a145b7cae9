"""The data contract and pure conversions shared by producer and consumer."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("genqueue")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+local"
