"""dspark-obs: observability and acceptance-ceiling analytics for DSpark speculative decoding.

The public API is per package (``dspark_obs.store``, ``.analytics``, ``.sinks``, ...; see
docs/house.md for the layers). Nothing is re-exported here: every ``import dspark_obs.x``
runs this file, so importing one package must not load all of them.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
