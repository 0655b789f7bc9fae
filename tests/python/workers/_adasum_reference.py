"""A NumPy reference of Adasum in rvod's combination order, for the workers that check Adasum: the pair
formula of Horovod's paper, extra ranks (beyond the largest power of two p) folded into rank r - p first,
then the power-of-two tree."""

import math

import numpy as np

THRESHOLD = math.sqrt(np.finfo(np.float64).tiny)


def pair(a, b):
    dot, aa, bb = float(np.dot(a, b)), float(np.dot(a, a)), float(np.dot(b, b))
    ca = 1.0 - dot / (2 * aa) if aa >= THRESHOLD else 1.0
    cb = 1.0 - dot / (2 * bb) if bb >= THRESHOLD else 1.0
    return ca * a + cb * b


def reference(vectors):
    """Adasum of one tensor's per-rank values (flattened, float64) in rvod's combination order."""
    v = [np.asarray(x, dtype=np.float64).ravel() for x in vectors]
    n = len(v)
    core = 1 << (n.bit_length() - 1)
    for extra in range(core, n):
        v[extra - core] = pair(v[extra - core], v[extra])
    d = 1
    while d < core:
        for base in range(0, core, 2 * d):
            v[base] = pair(v[base], v[base + d])
        d *= 2
    return v[0]
