"""One process: the model runs as it is."""

from .base import Strategy


class SingleDeviceStrategy(Strategy):
    """No wrapping, no communication."""
