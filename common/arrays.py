"""numpy arrays ↔ their wire form (`common.messages.Array`): raw little-endian int32 or float32 bytes
next to their shape. numpy only: the gateway and every worker use it."""

from __future__ import annotations

import numpy as np

from common.messages import Array


def wire_array(a: np.ndarray) -> Array:
    """An array as it travels: float kinds as float32, everything else as int32, little-endian."""
    a = np.asarray(a)
    dtype = "<f4" if a.dtype.kind == "f" else "<i4"
    return Array(dtype, list(a.shape), np.ascontiguousarray(a, dtype=dtype).tobytes())


def np_array(a: Array) -> np.ndarray:
    """The array a wire `Array` holds (read-only, over its bytes: no copy). Raises ValueError when
    its bytes are no such array (`Array.error`)."""
    error = a.error()
    if error:
        raise ValueError(error)
    return np.frombuffer(a.data, dtype=a.dtype).reshape(a.shape)
