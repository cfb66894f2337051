"""Hand-made norm profiles for the profile / scoring / mask tests (owned by the scoring issue).

`hand_profile()`: L = 3 layers, H = 2 query heads, Hkv = 1 KV head (G = 2), d = 4.
Norms (the same numbers for L2 and L1, except where `l1_scale` multiplies L1):

    layer 0   q: h0 [1,1,1,1]  h1 [3,3,3,3]    o: h0 [1,1,3,3]  h1 [1,1,3,3]
              k: [1,1,3,3]                      v: [2,2,2,2]        (v has zero std)
    layer 1   q: h0 [0,4,4,4]  h1 [4,4,4,4]    o: h0 [4,4,4,4]  h1 [4,4,4,4]
              k: [2,2,2,2]                      v: [1,1,1,1]        (every row in the bulk at z=0.5)
    layer 2   every norm 0.1                                        (zero std everywhere)

Hand results at z = 0.5, scope "layer" (population std, ddof = 0):
    layer 0: q mean 2 std 1 -> tau 2.5, excess h1 4 x 0.5 = 2;  o tau 2.5 -> excess 1 per head;
             k tau 2.5 -> E_kv = 1;  v tau 2 -> 0.
             MP   = [0 + 1 + 1, 2 + 1 + 1]            = [2, 4]
             MP-G = [1 + 1/2, 3 + 1/2]                = [1.5, 3.5]
    layer 1: q mean 3.5, std sqrt(1.75) -> tau 4.16 > 4: nothing in excess; o, k, v constant.
             MP = MP-G = [0, 0]; magnitude (MP sums of norms) = [12+16+8+4, 16+16+8+4] = [40, 44]
    layer 2: MP = 0; magnitude = [1.6, 1.6] (an exact tie -> (layer, head) decides)
"""

import numpy as np

from analysis.measure.profiles import NormProfile

HAND_Q = [[[1, 1, 1, 1], [3, 3, 3, 3]], [[0, 4, 4, 4], [4, 4, 4, 4]], [[0.1] * 4] * 2]
HAND_O = [[[1, 1, 3, 3], [1, 1, 3, 3]], [[4, 4, 4, 4], [4, 4, 4, 4]], [[0.1] * 4] * 2]
HAND_K = [[[1, 1, 3, 3]], [[2, 2, 2, 2]], [[0.1] * 4]]
HAND_V = [[[2, 2, 2, 2]], [[1, 1, 1, 1]], [[0.1] * 4]]

HAND_MP_Z05 = np.array([[2.0, 4.0], [0.0, 0.0], [0.0, 0.0]])
HAND_MPG_Z05 = np.array([[1.5, 3.5], [0.0, 0.0], [0.0, 0.0]])
HAND_MAGNITUDE = np.array([[4 + 8 + 8 + 8, 12 + 8 + 8 + 8], [40.0, 44.0], [1.6, 1.6]])
# prune-first order (flat index = layer * 2 + head): zero scores by magnitude, then layer/head
HAND_ORDER_Z05 = [4, 5, 2, 3, 0, 1]


def hand_profile(l1_scale: float = 1.0) -> NormProfile:
    arrays = {p: np.array(a, dtype=np.float64) for p, a in
              (("q", HAND_Q), ("k", HAND_K), ("v", HAND_V), ("o", HAND_O))}
    return NormProfile(l2=arrays, l1={p: a * l1_scale for p, a in arrays.items()}, source="hand")


def random_profile(L: int = 4, H: int = 6, Hkv: int = 2, d: int = 5, seed: int = 0) -> NormProfile:
    """Positive random norms with a few outliers, for property tests."""
    rng = np.random.default_rng(seed)

    def draw(units):
        x = rng.gamma(4.0, 0.25, size=(L, units, d))  # [L, units, d]
        x[rng.random(x.shape) < 0.05] *= 4.0  # outliers
        return x

    l2 = {"q": draw(H), "k": draw(Hkv), "v": draw(Hkv), "o": draw(H)}
    return NormProfile(l2=l2, l1={p: a * 3.0 for p, a in l2.items()}, source="random")


def constant_profile(value: float, L: int = 1, H: int = 3, d: int = 4) -> NormProfile:
    """Every norm equal to `value` (12 rows per q/o population: naive mean/std drift here)."""
    arrays = {p: np.full((L, H, d), value) for p in ("q", "k", "v", "o")}
    return NormProfile(l2=arrays, l1=dict(arrays))
