"""The one exception type of the conversion package.

Its own module so that every other module (atomic output, loading, the Hub job, the CLI) can raise or catch it
without importing the heavier ones.
"""


class ConversionError(ValueError):
    """A conversion problem the user can fix; the message names the problem and the fix."""


__all__ = ["ConversionError"]
