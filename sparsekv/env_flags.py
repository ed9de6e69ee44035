"""On/off switches read from environment variables (``SPARSEKV_*``), spelled one way everywhere:
``1`` / ``true`` / ``yes`` / ``on`` and ``0`` / ``false`` / ``no`` / ``off``, any case, spaces
ignored; and the kernel-variant setting ``SPARSEKV_KERNEL_ISA``, read the same way by every
kernel family."""

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


KERNEL_ISA = "SPARSEKV_KERNEL_ISA"


def kernel_isa_setting() -> str:
    """``SPARSEKV_KERNEL_ISA`` as the kernel families read it: spaces stripped, lower case
    (variant names are: ``AVX2`` means ``avx2``); ``""`` where unset. Read per call (tests set
    it)."""
    return os.environ.get(KERNEL_ISA, "").strip().lower()
