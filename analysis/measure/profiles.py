"""Row-norm profiles, MP thresholds and excesses (docs/DEFINITIONS.md).

A `NormProfile` holds, for every layer and projection, the L2 and L1 norms of the rows of
W_Q, W_K, W_V and of the *columns* of W_O, head-major:

    q: [L, H, d]     k: [L, Hkv, d]     v: [L, Hkv, d]     o: [L, H, d]

It is computed once per model (from memory with `profile_model`, or from safetensors files
with `analysis.measure.streaming.profile_checkpoint`). Everything that depends on the threshold z is
an array operation on these cached norms: the per-population mean and std are memoized, so
moving z costs one subtraction per row and never touches the weights again. Scorers need only
each head's *sum* of excesses (`excess_sums`), and at z >= 1 only rows with a z-score >= 1 can
be in excess: those rows are indexed once, bucketed by z-score, so a new z reads just the rows of
the buckets above the new threshold (a prefix) and adds them into per-head bins.

Threshold of a population: tau = mean(n) + z * std(n), with the population std (ddof = 0) by
default, or the sample std (ddof = 1, PyTorch's `Tensor.std` default): `std="sample"`.
Population scope "layer": the rows of one projection of one layer; scope "model": the rows
of one projection across all layers. A population whose norms are all equal (std = 0) has
tau equal to that common norm and no row in excess.

Pruned heads of a full-shape model (the iterative pipeline zeroes them) are not part of the
model any more: `NormProfile.excluding(pruned)` leaves their Q rows / O columns, and the K/V rows
of KV groups with no query head left, out of every population (mean and std), so the remaining
heads are scored against the rows that are still there. Each remaining row counts once (where
surgery would copy a KV group's rows, kv_policy "expand", the copies are not counted again).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, ClassVar

import numpy as np
import torch

from analysis.arch.adapters import Adapter, HeadWeights, adapter_for
from analysis.core.errors import InputError, ModelLoadError
from analysis.core.progress import Progress, ShouldStop, check_stop, report
from analysis.measure.thresholds import (DEFAULT_STD, DEFAULT_Z, ORDS, SCOPES, STD_DDOF, Z_MAX,  # noqa: F401
                                         check_ord, check_scope, check_std, check_z)

PROJECTIONS = ("q", "k", "v", "o")
# the threshold options (order, scope, std, z): declared in analysis.measure.thresholds, re-exported here


@dataclass
class NormProfile:
    """Head-major row norms of one model; see the module docstring for shapes.

    `l2[p]` / `l1[p]` for p in PROJECTIONS, float64 numpy arrays. L1 may be left to
    `l1_loader` (a callable returning the L1 dict), computed on first use: the in-memory path
    reads the weights once for L2 and only reads them again if someone asks for L1. The stats
    cache (population mean/std keyed by ord, scope) is filled lazily.
    """

    l2: dict[str, np.ndarray]
    l1: dict[str, np.ndarray] | None = None
    source: str = ""
    l1_loader: Callable[[], dict[str, np.ndarray]] | None = field(default=None, repr=False, compare=False)
    members: dict[str, np.ndarray] | None = field(default=None, repr=False, compare=False)  # p -> bool [L, units]
    _stats: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_norm_table(self.l2)
        if self.l1 is not None:
            _check_norm_table(self.l1, self.l2)

    @property
    def n_layers(self) -> int:
        return self.l2["q"].shape[0]

    @property
    def n_heads(self) -> int:
        return self.l2["q"].shape[1]

    @property
    def n_kv_heads(self) -> int:
        return self.l2["k"].shape[1]

    @property
    def head_dim(self) -> int:
        return self.l2["q"].shape[2]

    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads

    def norms(self, ord: int = 2) -> dict[str, np.ndarray]:
        """The norm arrays for L2 (ord=2) or L1 (ord=1; computed now if it was left lazy)."""
        if check_ord(ord) == 2:
            return self.l2
        if self.l1 is None:
            if self.l1_loader is None:
                raise InputError("This profile has no L1 norms; profile the model again to get them.")
            self.l1 = _check_norm_table(self.l1_loader(), self.l2)
        return self.l1

    def stats(self, ord: int = 2, scope: str = "layer", std: str = DEFAULT_STD
              ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per projection (mean [L], std [L]) of the population; memoized.

        With scope "model" the one model-wide value is broadcast to every layer. `std`: the
        population ("population", ddof 0) or sample ("sample", ddof 1) standard deviation.
        """
        key = (check_ord(ord), check_scope(scope), check_std(std))
        if key not in self._stats:
            members = self.members or {}
            self._stats[key] = {p: population_stats(n, scope, STD_DDOF[std], members.get(p))
                                for p, n in self.norms(ord).items()}
        return self._stats[key]

    def excluding(self, pruned) -> "NormProfile":
        """This profile with the heads where pruned [L, H] is True left out of every population
        (their Q rows and O columns; the K/V rows of groups with no query head left). The norms
        are shared, not copied; an all-False mask gives a profile equal to this one."""
        p = np.asarray(pruned, dtype=bool)                                 # [L, H]
        if p.shape != (self.n_layers, self.n_heads):
            raise InputError(f"The pruned mask must have shape [{self.n_layers}, {self.n_heads}]; got {list(p.shape)}.")
        kept = ~p                                                          # [L, H]
        groups = kept.reshape(self.n_layers, self.n_kv_heads, self.group_size).any(axis=2)   # [L, Hkv]
        members = None if kept.all() else {"q": kept, "o": kept, "k": groups, "v": groups}
        return NormProfile(l2=self.l2, l1=self.l1, source=self.source, l1_loader=self.l1_loader, members=members)

    def memo(self, key, compute: Callable[[], np.ndarray]) -> np.ndarray:
        """A z-independent derived array (e.g. a scorer's plain-magnitude tie-break), computed once."""
        if key not in self._stats:
            self._stats[key] = compute()
        return self._stats[key]

    def thresholds(self, z: float = DEFAULT_Z, *, ord: int = 2, scope: str = "layer",
                   std: str = DEFAULT_STD) -> dict[str, np.ndarray]:
        """tau per projection, each [L]."""
        z = check_z(z)
        return {p: mean + z * sd for p, (mean, sd) in self.stats(ord, scope, std).items()}

    def excess(self, z: float = DEFAULT_Z, *, ord: int = 2, scope: str = "layer",
               std: str = DEFAULT_STD) -> dict[str, np.ndarray]:
        """e = max(0, n - tau) per projection, same shapes as the norms."""
        taus = self.thresholds(z, ord=ord, scope=scope, std=std)
        return {p: row_excess(n, taus[p]) for p, n in self.norms(ord).items()}

    def excess_sums(self, z: float = DEFAULT_Z, *, ord: int = 2, scope: str = "layer", std: str = DEFAULT_STD
                    ) -> tuple[np.ndarray, np.ndarray]:
        """(own [L, H], group [L, Hkv]): per query head the summed excess of its Q rows and O
        columns, per KV group that of its K and V rows. Each row's excess is the same float
        expression as `excess` (n - (mean + z*std), floored at 0); only the order of the sums differs.
        """
        z = check_z(z)
        if z < ExcessRows.Z_MIN:  # most rows are in excess: the dense sums are cheaper than an index
            return head_and_group_sums(self.excess(z, ord=ord, scope=scope, std=std))
        rows = self.memo(("excess-rows", check_ord(ord), check_scope(scope), check_std(std)),
                         lambda: ExcessRows.index(self.norms(ord), self.stats(ord, scope, std)))
        k = rows.prefix(z)  # the rows whose z-score bucket can hold a z-score > z
        excess = rows.norm[:k] - (rows.mean[:k] + z * rows.std[:k])  # [k]
        np.maximum(excess, 0.0, out=excess)  # [k]; rows of the lowest bucket below z add exact zeros
        sums = np.bincount(rows.bin[:k], weights=excess, minlength=rows.n_bins)  # [L*H + L*Hkv]
        L, H, Hkv = self.n_layers, self.n_heads, self.n_kv_heads
        return sums[: L * H].reshape(L, H), sums[L * H:].reshape(L, Hkv)


_Z_MARGIN = 1e-9  # z-scores are rounded: rows this close below z are read too, and n > tau decides


@dataclass(frozen=True)
class ExcessRows:
    """The rows that can be in excess at some z >= Z_MIN -- z-score (n - mean) / std above Z_MIN,
    in a population with std > 0 -- grouped by z-score into buckets of width BUCKET_Z, highest
    bucket first, so the rows that can be in excess at z are a prefix. (Buckets, not a full sort:
    a stable sort of 8-bit keys is a radix sort, ~10x cheaper to build.) Below Z_MIN most rows
    above the mean are in excess and `excess_sums` uses the dense sums instead. Each row carries
    its norm, its population's mean and std, and its bin: l*H + h for Q rows and O columns of
    query head h, L*H + l*Hkv + g for K/V rows of group g.
    """

    norm: np.ndarray  # [M]
    mean: np.ndarray  # [M]
    std: np.ndarray  # [M]
    bin: np.ndarray  # [M] int
    ends: np.ndarray  # [N_BUCKETS] prefix length that covers buckets N_BUCKETS-1 .. b
    n_bins: int

    Z_MIN: ClassVar[float] = 1.0
    BUCKET_Z: ClassVar[float] = 0.125
    N_BUCKETS: ClassVar[int] = int(Z_MAX / 0.125) + 1  # the last one holds every z-score >= Z_MAX

    def prefix(self, z: float) -> int:
        """Rows to read at threshold z: every bucket that can hold a z-score above z (with a
        margin for the rounding of z-scores; the exact test n > tau is made on the rows read)."""
        lowest = min(int(max(z - _Z_MARGIN, 0.0) / self.BUCKET_Z), self.N_BUCKETS - 1)
        return int(self.ends[lowest])

    @classmethod
    def index(cls, norms: dict[str, np.ndarray], stats: dict[str, tuple[np.ndarray, np.ndarray]]) -> "ExcessRows":
        L, H = norms["q"].shape[:2]
        Hkv = norms["k"].shape[1]
        offsets = {"q": 0, "o": 0, "k": L * H, "v": L * H}  # own bins first, then group bins
        parts = []
        for p, n in norms.items():
            units, d = n.shape[1:]
            mean_l, std_l = stats[p]  # [L] each
            floor = mean_l + (cls.Z_MIN - _Z_MARGIN) * std_l  # [L] a little below tau at Z_MIN
            keep = (n > floor[:, None, None]) & (std_l > 0)[:, None, None]  # [L, units, d]
            rows = np.flatnonzero(keep)  # [m] flat indices l*units*d + u*d + j
            layer = rows // (units * d)  # [m]
            parts.append((n.reshape(-1)[rows], mean_l[layer], std_l[layer], offsets[p] + rows // d))
        norm, mean, std, bins = (np.concatenate(column) for column in zip(*parts))  # [M] each
        bucket = np.minimum((norm - mean) / std / cls.BUCKET_Z, cls.N_BUCKETS - 1).astype(np.uint8)  # [M]
        key = cls.N_BUCKETS - 1 - bucket  # [M] uint8, 0 = highest bucket
        order = np.argsort(key, kind="stable")  # [M] a radix sort for 8-bit keys
        ends = np.cumsum(np.bincount(key, minlength=cls.N_BUCKETS))[::-1].copy()  # [N_BUCKETS] by bucket
        return cls(norm=norm[order], mean=mean[order], std=std[order], bin=bins[order],
                   ends=ends, n_bins=L * H + L * Hkv)


def _check_norm_table(table: dict[str, np.ndarray], like: dict[str, np.ndarray] | None = None) -> dict:
    """Validate {q, o: [L, H, d], k, v: [L, Hkv, d]} (shapes equal to `like` when given)."""
    missing = [p for p in PROJECTIONS if p not in table]
    if missing:
        raise InputError(f"a norm profile needs projections {PROJECTIONS}; missing {missing}.")
    q, k, v, o = (np.shape(table[p]) for p in PROJECTIONS)
    if len(q) != 3 or q != o or k != v or len(k) != 3 or k[0] != q[0] or k[2] != q[2] or q[1] % k[1]:
        raise InputError("norm arrays must be q/o [L, H, d] and k/v [L, Hkv, d] with Hkv dividing H; got "
                         f"q {q}, k {k}, v {v}, o {o}.")
    if like is not None and any(np.shape(table[p]) != np.shape(like[p]) for p in PROJECTIONS):
        raise InputError("L1 and L2 norm arrays of a profile must have the same shapes.")
    return table


def head_and_group_sums(rows: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per-row values {q,o: [L, H, d], k,v: [L, Hkv, d]} -> (own [L, H], group [L, Hkv]).

    own = sum over the head's Q rows and O columns; group = sum over the group's K and V rows.
    """
    own = rows["q"].sum(axis=-1) + rows["o"].sum(axis=-1)  # [L, H]
    group = rows["k"].sum(axis=-1) + rows["v"].sum(axis=-1)  # [L, Hkv]
    return own, group


def population_stats(norms: np.ndarray, scope: str, ddof: int = 0, members: np.ndarray | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Mean and std (ddof 0: population, 1: sample) of norms [L, units, d] per layer (scope
    "layer") or model-wide.

    members: optional bool [L, units], the units (heads / KV groups) still in the population
    (None = all). Returns (mean [L], std [L]). A population with all-equal norms gets its exact
    common value as mean and std 0, so floating-point noise cannot put a row above tau; a layer
    with no member left gets mean 0 and std 0 (it has no rows to score).
    """
    if members is not None:
        return _member_stats(norms, scope, ddof, np.asarray(members, dtype=bool))
    n_layers = norms.shape[0]
    flat = norms.reshape(n_layers, -1) if scope == "layer" else norms.reshape(1, -1)  # [P, rows]
    mean = flat.mean(axis=1)  # [P]
    std = flat.std(axis=1, ddof=ddof)  # [P]
    constant = flat.max(axis=1) == flat.min(axis=1)  # [P]
    mean = np.where(constant, flat[:, 0], mean)  # [P]
    std = np.where(constant, 0.0, std)  # [P]
    if scope == "model":
        mean = np.repeat(mean, n_layers)  # [L]
        std = np.repeat(std, n_layers)  # [L]
    return mean, std


def _member_stats(norms: np.ndarray, scope: str, ddof: int, members: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """population_stats over the rows of the member units only (members [L, units])."""
    n_layers = norms.shape[0]
    rows = np.broadcast_to(members[:, :, None], norms.shape)              # [L, units, d]
    pops = ([(norms[layer][rows[layer]]) for layer in range(n_layers)] if scope == "layer"
            else [norms[rows]])                                            # P x [rows]
    mean, std = np.zeros(len(pops)), np.zeros(len(pops))                   # [P]
    for i, flat in enumerate(pops):
        if flat.size == 0:
            continue
        constant = flat.max() == flat.min()
        mean[i] = flat[0] if constant else flat.mean()
        std[i] = 0.0 if constant or flat.size <= ddof else flat.std(ddof=ddof)
    if scope == "model":
        mean, std = np.repeat(mean, n_layers), np.repeat(std, n_layers)  # [L]
    return mean, std


def row_excess(norms: np.ndarray, tau: np.ndarray) -> np.ndarray:
    """max(0, n - tau) for norms [L, units, d] and tau [L]."""
    return np.maximum(norms - tau[:, None, None], 0.0)  # [L, units, d]


IN_MEMORY_CHUNK = 1 << 22  # elements of one float temp in memory, where the model is resident anyway
STREAM_CHUNK = 1 << 17  # and when streaming: 512 KiB of float32, cache-sized, so |x|, x^2 and the sums hit L2
SUM_BLOCK = 64  # O's columns are cut only at multiples of this many: a multiple of the 4-vector column group
                # torch's outer sum takes (4 x 8 floats on AVX2 / NEON, 4 x 16 on AVX512), so each column is
                # summed by the same code path, in the same order, whatever the chunk (only the last
                # H*d mod 4-vectors columns take torch's tail paths, in every chunking alike)
ROW_BLOCK = 32  # O's norms run down W_O's columns ROW_BLOCK rows at a time (contiguous reads, not a strided
                # gather of columns), each block's column sums added in row order: the same blocks, hence
                # the same bits, whatever the chunk (a 70B layer: 32 x 8192 float32 = 1 MiB, cache-sized)


def _pieces(n_rows: int, width: int, chunk_elements: int) -> list[slice]:
    """Slices of the n_rows = units * d contiguous rows of a layer's [units * d, width] rows, each
    about chunk_elements elements (each row's norm runs over its own last axis alone)."""
    step = max(1, chunk_elements // max(1, width))
    return [slice(r, r + step) for r in range(0, n_rows, step)]


def row_norms(rows: torch.Tensor, ords: tuple[int, ...] = (2,), chunk_elements: int = IN_MEMORY_CHUNK,
              scratch: dict | None = None) -> dict[int, torch.Tensor]:
    """{ord: norms [units, d]} over the last axis of rows [units, d, width], ord 1 (L1) and/or 2 (L2).

    Computed and returned in float32 (float64 stays float64); `stack_layers` makes them numpy.
    Contiguous rows (Q/K/V in the head view) take one fused `vector_norm` per order, no copy, for
    float32 / float64; half types are upcast a piece of rows at a time (`_pieces`, across head
    boundaries, at most ~`chunk_elements` elements, so a bf16 tensor never exists whole in
    float32 and the piece stays in cache) into a float32 temp, whose L2 is the same fused
    `vector_norm` and whose L1 is |x| and a sum. A strided last axis -- O's
    *columns* in the head view (o[h, j, :] = W_O[:, h*d + j]), where `vector_norm` is ~10x slower
    than a sum -- is summed down W_O's columns in cache-sized blocks of its contiguous rows
    (`_column_norms`); pass the same `scratch` dict to every call of a pass and its temp is
    allocated once, not once per layer. Every chunk size and every choice of `ords` gives the same
    bits (tests/test_profiles.py), so the streamed profile (STREAM_CHUNK) equals the in-memory one.
    """
    rows = rows.detach()
    exact = rows.dtype in (torch.float32, torch.float64)
    if exact and rows.stride(-1) == 1:
        return {o: torch.linalg.vector_norm(rows, ord=o, dim=-1) for o in ords}  # [units, d] each
    units, d, width = rows.shape
    flat = rows.flatten(0, 1)  # [units * d, width]: a view (the head view's units and d axes nest)
    dtype = rows.dtype if exact else torch.float32
    out = {o: torch.empty(units * d, dtype=dtype, device=rows.device) for o in ords}  # [units * d] each
    scratch = {} if scratch is None else scratch
    if rows.stride(-1) != 1:
        return {o: values.view(units, d) for o, values in _column_norms(flat.t(), ords, dtype, chunk_elements,
                                                                        scratch).items()}
    for span in _pieces(units * d, width, chunk_elements):  # contiguous half rows, a piece at a time
        part = flat[span]  # [<=step, width]
        upcast = _temp_like(part, dtype, scratch).copy_(part)  # [<=step, width] float32
        if 2 in ords:  # the float32 kernel on float32 values, whichever orders are asked for
            torch.linalg.vector_norm(upcast, ord=2, dim=-1, out=out[2][span])  # [<=step]
        if 1 in ords:  # vector_norm's L1 is ~2x slower than |x| and a sum
            out[1][span] = upcast.abs_().sum(dim=-1)  # [<=step]
    return {o: values.view(units, d) for o, values in out.items()}  # [units, d] each


def _column_norms(cols: torch.Tensor, ords: tuple[int, ...], dtype: torch.dtype, chunk_elements: int,
                  scratch: dict) -> dict[int, torch.Tensor]:
    """{ord: norms [n]} down the columns of cols [m, n] (O's head rows are W_O's columns: cols = W_O
    [D_out, H*d], its rows contiguous), in `dtype`. Blocks of ROW_BLOCK rows x a multiple of
    SUM_BLOCK columns (about chunk_elements elements): each block upcast (or copied) into a temp
    laid out like it, |x| and / or x^2 in place (x^2 alone when L1 is not asked for: |x|^2 == x^2
    bit for bit), summed down its rows, and the block sums added in row order. The blocks' rows do
    not depend on the chunk, and their columns start at SUM_BLOCK multiples, so every chunk size
    gives the same bits."""
    m, n = cols.shape
    exact = cols.dtype == dtype
    step = max(SUM_BLOCK, chunk_elements // ROW_BLOCK // SUM_BLOCK * SUM_BLOCK)  # columns per block
    acc = {o: torch.zeros(n, dtype=dtype, device=cols.device) for o in ords}  # [n] each
    for c in range(0, n, step):
        span = slice(c, c + step)
        for r in range(0, m, ROW_BLOCK):
            part = cols[r:r + ROW_BLOCK, span]  # [<=ROW_BLOCK, <=step]
            powered = _temp_like(part, dtype, scratch)  # [<=ROW_BLOCK, <=step]
            if 1 not in ords:
                if exact:
                    torch.square(part, out=powered)
                else:
                    powered.copy_(part).square_()  # the upcast first: x^2 is taken in float32
            else:
                if exact:
                    torch.abs(part, out=powered)
                else:
                    powered.copy_(part).abs_()
                acc[1][span] += powered.sum(dim=0)  # [<=step]
                if 2 in ords:
                    powered.square_()
            if 2 in ords:
                acc[2][span] += powered.sum(dim=0)  # [<=step] squared L2 so far
    if 2 in acc:
        acc[2].sqrt_()
    return acc


def _temp_like(part: torch.Tensor, dtype: torch.dtype, scratch: dict) -> torch.Tensor:
    """A dense `dtype` tensor of part's shape whose strides run in part's order (reused via scratch)."""
    key = (tuple(part.shape), part.stride(), dtype, part.device)
    if key not in scratch:
        order = sorted(range(part.dim()), key=lambda i: -part.stride(i))  # outermost axis first
        dense = torch.empty([part.shape[i] for i in order], dtype=dtype, device=part.device)  # [part's axes, outermost first]
        scratch.clear()  # one temp at a time: a new shape replaces the last one
        scratch[key] = dense.permute([order.index(i) for i in range(part.dim())])  # [<=step, d, width]
    return scratch[key]


def head_norms(hw: HeadWeights, ords: tuple[int, ...] = (2,), chunk_elements: int = IN_MEMORY_CHUNK,
               scratch: dict | None = None) -> dict[int, dict[str, torch.Tensor]]:
    """{ord: {projection: norms [units, d]}} of one layer's head-major weights (see row_norms)."""
    ords = tuple(check_ord(o) for o in ords)
    # q [H, d, D], k/v [Hkv, d, D], o [H, d, D_out]: every norm runs over the last axis
    per_projection = {p: row_norms(getattr(hw, p), ords, chunk_elements, scratch) for p in PROJECTIONS}
    return {o: {p: norms[o] for p, norms in per_projection.items()} for o in ords}


def check_finite_norms(norms: dict[str, torch.Tensor], layer: int, tensors: dict[str, str] | None = None,
                       where: str = "the model") -> None:
    """ModelLoadError naming the tensor and layer when a projection's row norms are NaN or infinite
    (its weights hold NaN / Inf, or values so large their norms overflow): such scores would be
    silently wrong, so the in-memory and the streaming profile both refuse them. `tensors`: role
    -> tensor name where known (the streaming reader knows the checkpoint's names)."""
    for projection, values in norms.items():
        if not bool(torch.isfinite(values).all()):
            name = next((n for role, n in (tensors or {}).items() if role.split(".")[0] in (projection, "qkv")), None)
            tensor = f"tensor {name}" if name else f"the {projection} projection's weight"
            raise ModelLoadError(f"The weights of {where} hold NaN or infinite values in layer {layer} ({tensor}); "
                                 f"its heads cannot be scored. Use an intact copy of the weights (re-download or "
                                 f"re-save them).")


def stack_layers(layers: list[dict[str, torch.Tensor]]) -> dict[str, np.ndarray]:
    """Per-layer {projection: [units, d]} (on any device) -> {projection: [L, units, d]} float64 numpy."""
    return {p: torch.stack([layer[p].cpu() for layer in layers]).numpy().astype(np.float64) for p in PROJECTIONS}


def profile_model(
    model: torch.nn.Module,
    *,
    adapter: Adapter | None = None,
    source: str = "",
    progress: Progress | None = None,
    should_stop: ShouldStop | None = None,
) -> NormProfile:
    """Row norms of every layer of an in-memory model, read through its adapter.

    L2 now; L1 on first use (`NormProfile.norms(1)`), from the same model. The norms are taken
    where the weights are (a GPU's, or an offloaded layer's real weights, loaded one layer at a
    time) and in float32 for half-precision weights (`row_norms`).
    """
    adapter = adapter or adapter_for(model)
    geometry = adapter.geometry(model)

    def norms_of(ord: int, progress_of: Progress | None = None) -> dict[str, np.ndarray]:
        layers, scratch = [], {}
        with torch.no_grad():
            for layer in range(geometry.n_layers):
                check_stop(should_stop, "Profiling")
                with adapter.real_weights(model, layer):  # offloaded weights: loaded for this layer only
                    layers.append(head_norms(weight_views(model, adapter, layer, geometry), (ord,), scratch=scratch)[ord])
                check_finite_norms(layers[-1], layer, where=source or "the model")
                report(progress_of, (layer + 1) / geometry.n_layers, f"row norms of layer {layer + 1}/{geometry.n_layers}")
        return stack_layers(layers)

    return NormProfile(l2=norms_of(2, progress), source=source, l1_loader=lambda: norms_of(1))


def weight_views(model: torch.nn.Module, adapter: Adapter, layer: int, geometry) -> HeadWeights:
    """Head-major *views* of a layer's projection weights (no copy, unlike read_heads; read only).

    For an offloaded model call it inside `adapter.real_weights(model, layer)`."""
    tensors = {f"{role}.weight": module.weight
               for role, module in adapter.projection_modules(model, layer).items()}
    return adapter.heads_from_tensors(tensors, geometry)
