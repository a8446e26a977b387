"""The production kernel's persistent tile walk: which Q tile each CTA takes, in which order,
and what that costs in load balance and in L2 reuse of K/V.

The kernel (ptx/sm90/production/forward.ptx, its walk in scheduler.ptxh) runs
grid = min(SMs, tiles) persistent CTAs. Tile t of the walk is a (query block, (batch, head)) pair; CTA c takes tile k*G + c in round k (plain
round-robin), or k*G + G-1-c in odd rounds (the snake of the masked build). Which tile t is:

  head-major     (batch, head) = t / M, m = t % M: the CTAs running at once share one head's K/V
  m_block-major  m = t / BH, (batch, head) = t % BH: longest first over every head (balance)
  sectioned (S)  the BH pairs in sections of S consecutive pairs (the last may be narrower);
                 sections one after another; within a section m_block-major:
                 sec = t / (S*M), r = t % (S*M), width = min(S, BH - sec*S),
                 m = r / width, (batch, head) = sec*S + r % width

(M query blocks per head, BH = batch * heads; the masked build then takes m_block M-1-m, the
longest rows first.) Sectioned with S = 1 is head-major, with S = BH m_block-major: one walk
whose section the host picks from the L2 size (section_pairs), in the spirit of
FlashAttention-3's L2-swizzled scheduler (sections of heads whose K/V fit a share of L2).

simulate() plays a walk: every CTA does its tiles one after another, a tile costing its K/V
steps (masked: the K/V tiles its rows see) plus a fixed per-tile overhead, and every K/V step
reads one K and one V tile through an LRU L2 shared by all CTAs (Q loads and O stores pass
through it too). It predicts the busiest CTA's load over the mean (what the static walk loses
to imbalance) and the hit rate of the K/V reads (what it sends to HBM, and so to power).
No GPU, no driver: a model for choosing the walk, checked against the kernel's own PTX in
tests/test_tile_walk.py.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict

H200_SMS = 132
H200_L2_BYTES = 50 * 1024 * 1024      # CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE on an H100/H200
# The share of L2 a section's K/V may fill (section_pairs); chosen with simulate() over the
# production set (bench/notes.md, "L2-local walk: prediction").
L2_SHARE = 0.64
BALANCE_TIE = 0.0025           # sizes whose busiest CTA is within 0.25% of the best tie
MAX_CANDIDATES = 32


@dataclasses.dataclass(frozen=True)
class Problem:
    """What the walk sees of a call: tile counts and the bytes of a K/V tile."""
    batch: int
    heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    heads_kv: int = 0
    window: tuple[int, int] | None = None   # (left, right) keys a row sees around its diagonal
    block_m: int = 128                      # (bottom-right), -1 unbounded; None: no mask
    block_n: int = 128

    def __post_init__(self):
        if not self.heads_kv:
            object.__setattr__(self, "heads_kv", self.heads)

    @classmethod
    def of(cls, batch, heads, seq_q, seq_k, head_dim, heads_kv=0, causal=False, window=None):
        """A problem with the production build's tiles for this head dim (stages.py); causal
        is the window (-1, 0)."""
        from .stages import PRODUCTION_VARIANTS
        window = tuple(window) if window is not None else ((-1, 0) if causal else None)
        v = PRODUCTION_VARIANTS[(head_dim, window is not None)]
        return cls(batch, heads, seq_q, seq_k, head_dim, heads_kv, window, v.block_m, v.block_n)

    @property
    def masked(self) -> bool:
        """The masked build: its walk goes longest first, with the snake."""
        return self.window is not None

    @property
    def m_blocks(self) -> int:
        return -(-self.seq_q // self.block_m)

    @property
    def bh(self) -> int:
        return self.batch * self.heads

    @property
    def tiles(self) -> int:
        return self.m_blocks * self.bh

    @property
    def group(self) -> int:
        return self.heads // self.heads_kv

    @property
    def kv_tiles(self) -> int:
        return -(-self.seq_k // self.block_n)

    @property
    def kv_head_bytes(self) -> int:
        """K and V of one (batch, K/V head), bf16."""
        return 2 * self.seq_k * self.head_dim * 2

    def kv_band_bytes(self, m_blocks: int) -> int:
        """K and V of one (batch, K/V head) that `m_blocks` consecutive query blocks of it see
        together, the widest such run: a window's band slides with the query block, so it is
        ~(left + right + m_blocks * block_m) keys, not seq_k; causal and unmasked calls see
        every key (kv_head_bytes)."""
        if self.window is None or self.window[0] < 0 or self.window[1] < 0:
            return self.kv_head_bytes
        run = max(1, min(m_blocks, self.m_blocks))
        first, count = kv_ranges(self)
        end = first + count                          # both rise with m (the band slides)
        tiles = int((end[run - 1:] - first[:self.m_blocks - run + 1]).max())
        return min(self.kv_head_bytes, 2 * tiles * self.block_n * self.head_dim * 2)

    def kv_range(self, m_block: int) -> tuple[int, int]:
        """(first K/V tile, count) that Q block m_block visits, as the kernel clamps it: the
        keys of its first row's window start to its last row's window end (bottom-right
        diagonal); every K/V tile without a mask."""
        if self.window is None:
            return 0, self.kv_tiles
        left, right = self.window
        diag = self.seq_k - self.seq_q
        q_row = m_block * self.block_m
        q_last = min(q_row + self.block_m - 1, self.seq_q - 1)
        key_first = 0 if left < 0 else q_row + diag - left
        key_first = min(max(key_first, 0), self.seq_k - 1)
        key_last = self.seq_k - 1 if right < 0 else q_last + diag + right
        key_last = min(max(key_last, key_first), self.seq_k - 1)
        first = key_first // self.block_n
        return first, key_last // self.block_n - first + 1


@functools.lru_cache(maxsize=64)
def kv_ranges(p: Problem):
    """Problem.kv_range of every query block as two read-only NumPy arrays (first, count):
    what section_pairs' candidates share (computed once per problem)."""
    import numpy as np
    first, count = np.array([p.kv_range(m) for m in range(p.m_blocks)], dtype=np.int64).T
    first.flags.writeable = count.flags.writeable = False
    return first, count


# ---- the walks ----------------------------------------------------------------------------

def section_pairs(p: Problem, l2_bytes: int = H200_L2_BYTES, share: float = L2_SHARE,
                  grid: int | None = None, band: bool = False) -> int:
    """The host's section: a number of (batch, head) pairs in whole GQA groups (the query
    heads of one K/V head share its K/V) whose K/V working set fits share * L2 (at least one
    group, at most BH), and among those sizes the one whose static walk balances best
    (balance(); within BALANCE_TIE of the best, the smallest: the fewest heads' K/V in
    flight). The working set of S pairs: S / group K/V heads, each with the K/V that its
    ceil(grid / S) query blocks running at once see (band, Problem.kv_band_bytes: a window's
    band, not the head's whole K/V: walk "l2-band"); by default (band=False) every head counts
    its whole K/V. The band rule balances the window case better but measured worse sustained:
    fewer L2 hits, more DRAM bytes, a lower clock (bench/notes.md, session 10)."""
    grid = min(H200_SMS, p.tiles) if grid is None else grid
    budget = int(share * l2_bytes)

    def fits(s):
        per_head = p.kv_band_bytes(-(-grid // s)) if band else p.kv_head_bytes
        return (s // p.group) * per_head <= budget

    sizes = [s for s in range(p.group, p.bh + 1, p.group) if fits(s)] or [p.group]
    if len(sizes) > MAX_CANDIDATES:                  # many pairs fit: the smallest ones
        sizes = sizes[:MAX_CANDIDATES - 1] + [sizes[-1]]
    scores = {s: balance(p, s, grid=grid) for s in sizes}
    best = min(scores.values())
    return min(s for s, v in scores.items() if v <= best + BALANCE_TIE)


def today_section(p: Problem) -> int:
    """The walk before the sectioned one as a section: m_block-major (S = BH) for masked calls
    with B*H <= 32, else head-major (S = 1)."""
    return p.bh if p.masked and p.bh <= 32 else 1


def tile_of(t: int, p: Problem, section: int, alternate: bool = True) -> tuple[int, int]:
    """(m_block, bh) of tile t in the sectioned walk (the kernel's arithmetic). alternate:
    every other section walks its query blocks the other way, counted from the last section
    (which always walks longest first, so that the walk ends on the shortest tiles)."""
    per_section = section * p.m_blocks
    sec, r = divmod(t, per_section)
    width = min(section, p.bh - sec * section)
    m, j = divmod(r, width)
    sections = -(-p.bh // section)
    if alternate and (sections - 1 - sec) % 2:
        m = p.m_blocks - 1 - m                         # this section: shortest first
    if p.masked:                                       # longest rows first
        m = p.m_blocks - 1 - m
    return m, sec * section + j


def cta_tiles(c: int, grid: int, tiles: int, snake: bool) -> list[int]:
    """The tile indices CTA c of `grid` takes, in order: round k's k*G + c, or k*G + G-1-c on
    odd rounds with the snake."""
    out, k = [], 0
    while True:
        t = k * grid + (grid - 1 - c if snake and k % 2 else c)
        if t >= tiles:
            # with the snake an odd round's index falls past the end before the even one's
            return out
        out.append(t)
        k += 1


def walk(p: Problem, section: int, grid: int | None = None, snake: bool | None = None,
         alternate: bool = True):
    """Per CTA, its (m_block, bh) tiles in order. snake: the masked build's (default: masked)."""
    grid = min(H200_SMS, p.tiles) if grid is None else grid
    snake = p.masked if snake is None else snake
    return [[tile_of(t, p, section, alternate) for t in cta_tiles(c, grid, p.tiles, snake)]
            for c in range(grid)]


def balance(p: Problem, section: int, *, grid: int | None = None, snake: bool | None = None,
            alternate: bool = True, overhead: float = 1.0) -> float:
    """The busiest CTA's work over the mean CTA's (a tile: its K/V steps + overhead), for the
    static walk, exactly and fast (NumPy over the tiles): what section_pairs minimizes."""
    import numpy as np
    grid = min(H200_SMS, p.tiles) if grid is None else grid
    snake = p.masked if snake is None else snake
    t = np.arange(p.tiles, dtype=np.int64)
    per_section = section * p.m_blocks
    sec, r = t // per_section, t % per_section
    width = np.minimum(section, p.bh - sec * section)
    m = r // width
    if alternate:
        sections = -(-p.bh // section)
        m = np.where((sections - 1 - sec) % 2 == 1, p.m_blocks - 1 - m, m)
    if p.masked:
        m = p.m_blocks - 1 - m
    steps = kv_ranges(p)[1].astype(np.float64)
    k, pos = t // grid, t % grid
    cta = np.where(snake & (k % 2 == 1), grid - 1 - pos, pos)
    loads = np.bincount(cta, weights=steps[m] + overhead, minlength=grid)
    return float(loads.max() / loads.mean())


# ---- the model ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Prediction:
    section: int
    busiest_over_mean: float      # the busiest CTA's work / the mean CTA's
    makespan_over_ideal: float    # when the last CTA ends / total work spread evenly
    kv_hit_rate: float            # K/V tile reads that found their line in the LRU L2
    kv_hit_rate_strict: float     # ... and not still in flight from a miss (latency)
    kv_dram_bytes: int            # K/V bytes the misses fetch (reads of lines in flight: none)
    kv_read_bytes: int


def simulate(p: Problem, section: int, *, grid: int | None = None, snake: bool | None = None,
             alternate: bool = True, l2_bytes: int = H200_L2_BYTES, overhead: float = 1.0,
             other_traffic: bool = True, latency: float = 0.5, jitter: float = 0.0,
             seed: int = 0) -> Prediction:
    """Play the walk (see the module doc). A K/V step lasts 1 (1 +- jitter: uniform, seeded,
    so that CTAs drift apart as real ones do), a tile `overhead` more, half before its first
    step (Q arrives) and half after its last (the lone PV, the epilogue, O leaves); a CTA
    reads K and V of a step at the step's start. The L2 holds lines of one K or V tile
    (block_n x D x 2 bytes), least recently used out first (K and V of a step are read
    together, so they are one line of twice the bytes here: the same hits, half the work);
    every tile's Q and O pass through it as lines used once (other_traffic). A line that
    missed is in flight for `latency` step times: reads of it then fetch nothing more, but
    kv_hit_rate_strict does not count them as hits (as a hardware counter may not). Reads are
    played in time order (ties: CTA, then tile, then step), the order the CTAs would reach
    the L2 if each ran at the same speed."""
    import numpy as np
    grid = min(H200_SMS, p.tiles) if grid is None else grid
    per_cta = walk(p, section, grid, snake, alternate)
    ranges = [p.kv_range(m) for m in range(p.m_blocks)]
    loads = [sum(overhead + ranges[m][1] for m, _ in tiles) for tiles in per_cta]
    # every event of every CTA: (time, cta, tile, step, line), steps -1 (Q) and count (O)
    rng = np.random.default_rng(seed)
    times, ctas, tile_ix, steps, lines = [], [], [], [], []
    line_bytes = 2 * p.block_n * p.head_dim * 2                   # K and V of one step
    q_lines = max(1, p.block_m * p.head_dim * 2 // line_bytes) if other_traffic else 0
    finish = []
    for c, tiles in enumerate(per_cta):
        counts = np.array([ranges[m][1] for m, _ in tiles], dtype=np.int64)
        firsts = np.array([ranges[m][0] for m, _ in tiles], dtype=np.int64)
        bhs = np.array([bh for _, bh in tiles], dtype=np.int64)
        total = int(counts.sum())
        dur = 1.0 + (jitter * (2 * rng.random(total) - 1) if jitter else np.zeros(total))
        # a step's start: the tile's start + overhead/2 + the steps before it in the tile
        tile_of_step = np.repeat(np.arange(len(tiles)), counts)
        step_no = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
        before = np.concatenate(([0.0], np.cumsum(dur)))[:-1]      # step time before each
        start_steps = before + overhead * (tile_of_step + 0.5)
        tile_step0 = np.cumsum(counts) - counts                    # first step of each tile
        tile_start = np.concatenate(([0.0], np.cumsum(dur)))[tile_step0] \
            + overhead * np.arange(len(tiles))
        tile_kv_end = np.concatenate(([0.0], np.cumsum(dur)))[tile_step0 + counts] \
            + overhead * (np.arange(len(tiles)) + 0.5)
        finish.append(float(tile_kv_end[-1] + overhead / 2) if len(tiles) else 0.0)
        b, h = bhs // p.heads, bhs % p.heads
        kv_line = ((b * p.heads_kv + h // p.group) * p.kv_tiles + firsts)[tile_of_step] + step_no
        times.append(start_steps)
        ctas.append(np.full(total, c))
        tile_ix.append(tile_of_step)
        steps.append(step_no)
        lines.append(kv_line)
        for j in range(q_lines):                                   # Q in, O out: once-used
            for when, step in ((tile_start, -1), (tile_kv_end, counts)):
                times.append(when)
                ctas.append(np.full(len(tiles), c))
                tile_ix.append(np.arange(len(tiles)))
                steps.append(np.broadcast_to(step, len(tiles)) + j * 0)
                lines.append(np.full(len(tiles), -1))
    t, c_, i_, s_, ln = (np.concatenate(x) for x in (times, ctas, tile_ix, steps, lines))
    order = np.lexsort((s_, i_, c_, t))
    t, ln = t[order].tolist(), ln[order].tolist()
    capacity = max(1, l2_bytes // line_bytes)
    lru: OrderedDict = OrderedDict()                   # line -> when its fetch completes
    hits = strict = reads = 0
    unique = 0
    for now, key in zip(t, ln):
        if key < 0:                                    # a Q or O line, used once
            unique += 1
            key = -unique
        else:
            reads += 1
            ready = lru.get(key)
            if ready is not None:
                lru.move_to_end(key)
                hits += 1
                strict += now >= ready
                continue
        lru[key] = now + latency
        if len(lru) > capacity:
            lru.popitem(last=False)
    mean = sum(loads) / grid
    return Prediction(section=section,
                      busiest_over_mean=max(loads) / mean,
                      makespan_over_ideal=max(finish) / mean,
                      kv_hit_rate=hits / reads if reads else 1.0,
                      kv_hit_rate_strict=strict / reads if reads else 1.0,
                      kv_dram_bytes=(reads - hits) * line_bytes, kv_read_bytes=reads * line_bytes)


def sector_hit_ceiling(p: Problem) -> float:
    """The best L2 hit rate over every sector the kernel moves (K/V and Q reads, O stores)
    that any walk can get: each K/V and Q byte misses once (from HBM), nothing else misses.
    What ncu's lts__t_sector_hit_rate can reach at most (bench/notes.md, session 10): a
    window's K/V tile is read by only ~(window + block_m) / block_m query blocks, so with a
    short window the first reads alone keep it low (1024 at 16k: 84.6%) whatever the walk."""
    line = 2 * p.block_n * p.head_dim * 2
    ranges = [p.kv_range(m) for m in range(p.m_blocks)]
    kv_reads = p.bh * sum(n for _, n in ranges) * line
    seen = len({t for first, n in ranges for t in range(first, first + n)})  # tiles read
    q = p.bh * p.seq_q * p.head_dim * 2                       # = O's bytes
    first_reads = p.batch * p.heads_kv * seen * line + q
    return 1 - first_reads / (kv_reads + 2 * q)


# ---- predictions for the benchmark -------------------------------------------------------

WALKS = ("today", "head-major", "l2-walk", "l2-band")
SECTION_RULE = "section:"   # "section:N", a measurement's forced section of N pairs
COUNTER_JITTER = 0.05   # the drift with which the model's strict rate met ncu's 92.5% at dense 8k


def is_rule(name) -> bool:
    """A walk rule: one of WALKS, or "section:N" with N >= 1."""
    if name in WALKS:
        return True
    n = name[len(SECTION_RULE):] if isinstance(name, str) and name.startswith(SECTION_RULE) \
        else ""
    return n.isdigit() and int(n) >= 1


def rule_error(name) -> str:
    return (f"walk_rule: expected one of {', '.join(WALKS)} or {SECTION_RULE}N (N >= 1), "
            f"got {name!r}")


def check_rule(name: str) -> str:
    """name if it is a walk rule (is_rule), else ValueError."""
    if not is_rule(name):
        raise ValueError(rule_error(name))
    return name


def walk_section(p: Problem, name: str, l2_bytes: int = H200_L2_BYTES,
                 grid: int | None = None) -> tuple[int, bool]:
    """(section, alternate) of a named walk as the kernel runs it when given that section
    (walk_section): "today" the rule of the walk before the sectioned one (today_section),
    "head-major" section 1, "l2-walk" the host's section (section_pairs), what attention()
    passes, "l2-band" section_pairs with a window's band as its working set (a measurement's:
    it lost sustained, session 10), "section:N" N pairs
    (at most B*H: the kernel clamps it too). The kernel alternates the sections' directions
    always (alternate=False models the builds before it: with section B*H, one section, the
    same walk)."""
    check_rule(name)
    if name == "today":
        return today_section(p), True
    if name == "head-major":
        return 1, True
    if name == "l2-walk":
        return section_pairs(p, l2_bytes, grid=grid), True
    if name == "l2-band":
        return section_pairs(p, l2_bytes, grid=grid, band=True), True
    return min(int(name[len(SECTION_RULE):]), p.bh), True


def predict(problems: dict, *, l2_bytes: int = H200_L2_BYTES, sm_count: int = H200_SMS,
            walks=WALKS, jitter: float = COUNTER_JITTER) -> dict:
    """{case: {walk: Prediction}} for named problems."""
    out = {}
    for name, p in problems.items():
        grid = min(sm_count, p.tiles)
        out[name] = {}
        for w in walks:
            section, alternate = walk_section(p, w, l2_bytes, grid)
            out[name][w] = simulate(p, section, grid=grid, alternate=alternate,
                                    l2_bytes=l2_bytes, jitter=jitter)
    return out


def format_predictions(rows: dict) -> str:
    head = ("case", "walk", "section", "busiest/mean", "K/V L2 reuse %", "counter-like %",
            "K/V DRAM GB")
    cells = [(case, w, str(r.section), f"{r.busiest_over_mean:.3f}", f"{100 * r.kv_hit_rate:.1f}",
              f"{100 * r.kv_hit_rate_strict:.1f}", f"{r.kv_dram_bytes / 1e9:.2f}")
             for case, walks in rows.items() for w, r in walks.items()]
    widths = [max(len(x) for x in col) for col in zip(head, *cells)]
    lines = ["  ".join(f"{c:<{w}}" if i < 2 else f"{c:>{w}}" for i, (c, w) in
                       enumerate(zip(line, widths))) for line in (head, *cells)]
    lines.append("model (ptxattn/tile_walk.py): static walk, a tile = its K/V steps + 1; LRU L2 of "
                 "K/V tiles shared by the CTAs; reuse: reads that find their line; counter-like: "
                 "not still in flight from a miss (0.5 step), with 5% step jitter")
    return "\n".join(lines)


def problem_of_case(case) -> Problem:
    """A benchmark Case (bench.Case) as the walk sees it."""
    return Problem.of(case.batch, case.heads, case.seq_q, case.seq_k, case.head_dim,
                      case.heads_kv, causal=case.causal,
                      window=case.window if case.window is not None else None)


# ---- the launcher's side -----------------------------------------------------------------

@functools.lru_cache(maxsize=256)
def _cached_section(p: Problem, l2_bytes: int, grid: int, rule: str) -> int:
    return walk_section(p, rule, l2_bytes, grid)[0]


def host_section(p: Problem, l2_bytes: int | None, sm_count: int, rule: str = "l2-walk") -> int:
    """The kernel parameter walk_section for one call: the section of the named walk (WALKS;
    "l2-walk", section_pairs, is what every call of attention() gets) on a device with this
    L2 (None or 0: the H200's) and this many CTAs at most (the grid is min(that, tiles)).
    Cached per (problem, device), so a prepared call pays for the model once per shape."""
    grid = max(1, min(sm_count, p.tiles))
    return _cached_section(p, int(l2_bytes or H200_L2_BYTES), grid, rule)
