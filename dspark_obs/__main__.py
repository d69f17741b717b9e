"""``python -m dspark_obs`` is the ``dspark-obs`` command."""

from dspark_obs.cli import main

main()
