"""Private numba kernels used by the drafters and the tree code, and the checks their inputs pass first."""
import numpy as np

INT32_MAX = int(np.iinfo(np.int32).max)


def check_id_range(ids: np.ndarray, name: str) -> None:
    """Raise ``ValueError`` unless every id of the integer array ``ids`` lies in ``[0, 2**31)``."""
    if not ids.size:
        return
    if ids.size <= 64:  # a step's few tokens: Python's min and max cost less than two numpy reductions
        values = ids.tolist()
        low, high = min(values), max(values)
    else:
        low, high = ids.min(), (ids.max() if ids.dtype != np.int32 else 0)
    if low < 0 or high > INT32_MAX:
        raise ValueError(f"{name} holds token ids outside [0, 2**31)")
