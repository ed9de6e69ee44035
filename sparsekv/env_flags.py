"""On/off switches read from environment variables (``SPARSEKV_*``), spelled one way everywhere:
``1`` / ``true`` / ``yes`` / ``on`` and ``0`` / ``false`` / ``no`` / ``off``, any case, spaces
ignored."""

from __future__ import annotations

import os

ON_VALUES = ("1", "true", "yes", "on")
OFF_VALUES = ("0", "false", "no", "off")


def switched_on(name: str) -> bool:
    """True where environment variable ``name`` is set to an on value (unset: False)."""
    return os.environ.get(name, "").strip().lower() in ON_VALUES


def switched_off(name: str) -> bool:
    """True where environment variable ``name`` is set to an off value (unset: False)."""
    return os.environ.get(name, "").strip().lower() in OFF_VALUES
