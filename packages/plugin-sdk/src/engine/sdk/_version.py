"""The SDK's own version (semver). A major bump is the only breaking change."""

__version__ = "1.1.0"

#: Major version of the contract: a plugin built against another major is refused at load time.
SDK_MAJOR = int(__version__.split(".")[0])
