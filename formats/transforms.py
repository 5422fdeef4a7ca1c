"""Constants of the record transforms that writers and every reader share. No framework.

The CT values here are part of the on-disk contract: the converter writes
`CT_PADDING_HU` where a slice has no data (PixelPaddingValue), and every loader
pads patches that reach outside a volume with the same value.
"""

from __future__ import annotations

# Hounsfield units written for padding and used to fill patches outside a volume (air is -1000).
CT_PADDING_HU = -1024
# The HU range a loader keeps by default (clipped): the padding value up to the 12-bit maximum.
DEFAULT_HU_WINDOW = (-1024.0, 3071.0)
