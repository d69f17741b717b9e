"""dspark-obs: observability and acceptance-ceiling analytics for DSpark speculative decoding."""

__version__ = "0.1.0"
