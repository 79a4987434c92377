"""Continuous batching, speculation inside the batch: many generations share one target forward per step.

Each request is a *row*. A new row is prefilled alone on its own solo cache (`runtime.prefill`'s chunks, one
chunk per step, interleaved with the running batch), samples its first token, and joins the batch: its cache rows
are copied into the batch's caches (`cache.BatchKVCache`, buffer row = position, per-row lengths in a shared
`cache.BatchLayout`). Every step then:

1. each row plans what it feeds: a plain row its last token; a speculative row its anchor and the k drafts its own
   drafter proposes (DFlash, DFlash 2, MTP, n-gram; each row has its own drafter state);
2. one target forward over all rows, padded to the widest block (ragged widths: a row's padding is masked from
   every other position and never committed), with the taps the rows' drafters need;
3. each row accepts through `verify` exactly as `engine.SpeculativeDecoder` does alone — the same drafts, the same
   sampler calls in the same order (a per-request RNG stream) — commits its tokens (`BatchLayout.commit`: the
   anchor and the accepted drafts stay, the rest is overwritten later) and hands the taps of the committed positions
   to its drafter.

So a request's tokens do not depend on what else is in the batch: greedy output equals serving it alone, and a
seeded sampled one does too (up to the last bits of fp32 matmuls, which differ between batch shapes). Rows leave when
they finish or are cancelled (`cancel`); `finished_cache` hands a finished row's cache back as a solo cache (for a
prompt cache across conversations).

`BatchGenerator.step` returns each row's `GenerationChunk` of that step (EOS, stop strings, max_tokens through
`runtime.loop.TokenStream`, the same rules as a solo generation).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field

import mlx.core as mx

from ..cache import KVCache, make_batch_cache
from ..runtime.loop import GenerationChunk, GenerationStats, TokenStream
from ..runtime.prefill import DEFAULT_PREFILL_STEP
from ..sampling import Sampler, history_window
from .dflash import batches_with as dflash_batches
from .dflash import propose_batch as dflash_propose_batch
from .mtp import batches_with as mtp_batches
from .mtp import propose_batch as mtp_propose_batch
from .protocol import Drafter
from .verify import expected_acceptance, target_distribution, verify_greedy, verify_sampling

DEFAULT_MAX_BATCH = 16
PRUNE_EVERY = 16  # steps between two checks that an auto row's model drafters could still pay
SPAN_MAX = 64  # steps a measured stretch (`Span`) runs to at most before it goes to the chooser's books


@dataclass
class Launched:
    """A batched forward built (and queued) but not read back yet: the rows it fed (in its batch order), how many
    positions each fed, its logits and taps, and the plain rows' sampled tokens as lazy arrays (by id(row))."""
    rows: list
    widths: list[int]
    logits: mx.array
    tapped: list | None
    want: tuple
    tokens: dict
    t0: float
    chained: bool = False  # queued on the tokens of the step before it (pipelined)
    drafting: float = 0.0  # seconds its rows' drafters spent proposing


@dataclass
class Span:
    """What a speculative stretch of the batch measurably cost (`BatchGenerator._observe`): the plain step read back
    just before it when that step's time was cut short, its speculative steps, and the plain steps after it until
    `BatchAuto.span_after` of them ran (a stretch starting sooner joins the span). Step by step the times of a
    pipelined loop mix: where queueing a step runs most of its forward (MLX's CPU back-end), the plain step read back
    with nothing queued behind it costs a fraction of a step, and the first plain step after the stretch two (its
    own forward and the next one's); a stretch can leave the machine slower for some steps (BLAS threads spinning on,
    caches its drafter took). Summed over the span they are what the stretch cost, whatever the back-end.
    steps: (seconds, the plain step's price for its rows, what it committed in plain steps of its rows — None: a
    speculative step no auto row drafted in —, whether it was a plain step)."""
    n: int = 0  # positions of its latest speculative step (its estimate gets the plain steps' excess)
    rows: int = 0  # ... and that step's rows
    steps: list = field(default_factory=list)
    after: int = 0  # plain steps since its latest speculative step
    credited: bool = False  # an auto row drafted in it: the ledger's
    priced: bool = True  # no step in it was the first of its shape (a kernel build: neither charged nor credited)


@dataclass
class BatchRequest:
    """One generation for `BatchGenerator.add`. drafter: this row's own drafter (its own state; None: plain
    decoding), width: drafts per round (None: the drafter's most). cache: a solo cache already holding ids[:reuse]
    (a prompt-cache hit); with a drafter and reuse > 0 the drafter's state must cover exactly ids[:reuse]
    (`Drafter.rewind_context`), and it is extended instead of started, as `SpeculativeDecoder.prefill` does."""
    ids: list[int]
    sampler: Sampler
    max_tokens: int
    eos: set[int]
    tokenizer: object = None
    stop: list[str] | None = None
    drafter: Drafter | None = None
    width: int | None = None
    input_embeddings: mx.array | None = None
    cache: list[KVCache] | None = None
    reuse: int = 0
    stats: GenerationStats = field(default_factory=GenerationStats)
    tag: object = None  # the caller's handle (a server job)
    auto: bool = False  # `auto`: the batch's chooser picks this row's drafter and width each step (no `drafter`)
    # auto: its drafters by kind, each holding the state for ids[:reuse] (default: `BatchAuto.options`, without the
    # model drafters when reuse > 0 — they would have no state for the reused prefix)
    options: dict | None = None


def batch_drafts(rows: list, plans: dict) -> dict:
    """{row index: (drafts, q)} for the rows that draft together this step (`plans`: {row index: (drafter, k)}):
    the DFlash rows (v1 or v2) of one drafter model in one drafter forward (`dflash.propose_batch`), the MTP
    rows of one set of layers at one depth with one forward per depth (`mtp.propose_batch`), wherever two or more
    rows share it. Each row's drafts are drawn with its own sampler, as alone; the other rows draft on their own."""
    groups: dict[tuple, list[int]] = {}
    for b, (d, k) in plans.items():
        if k > 0 and d is not None and d.kind in ("dflash", "mtp"):
            model = d.assistant if d.kind == "dflash" else d.head
            groups.setdefault((d.kind, id(model)), []).append(b)
    out = {}
    for (kind, _), members in groups.items():
        together = dflash_batches if kind == "dflash" else mtp_batches
        members = [b for b in members if together(plans[b][0], plans[b][0])]  # each fit to batch at all
        members = [b for b in members if together(plans[members[0]][0], plans[b][0])] if members else []
        if len(members) < 2:
            continue
        propose = dflash_propose_batch if kind == "dflash" else mtp_propose_batch
        out.update(zip(members, propose([plans[b][0] for b in members], [rows[b].history[-1] for b in members],
                                        [len(rows[b].history) - 1 for b in members], [plans[b][1] for b in members],
                                        [rows[b].sampler for b in members], [rows[b].history for b in members])))
    return out


class Row:
    """A request in the batch: its history, token stream, sampler, drafter and statistics."""

    def __init__(self, req: BatchRequest, model, prefill_step: int, options: dict | None = None):
        if req.drafter is not None:
            trained = req.drafter.max_drafts
            width = trained if req.width is None else req.width
            if not isinstance(width, int) or isinstance(width, bool) or not 1 <= width <= trained:
                raise ValueError(f"{req.drafter.width_name} must be an int in [1, {trained}], got {width!r}")
            req.width = width
        self.req, self.sampler, self.drafter = req, req.sampler, req.drafter
        self.options = options  # auto: its own fork of every option's drafter, all kept in step ({kind: drafter})
        self.choice: tuple | None = None  # auto: (option name, its drafter kind) drafting this step, or None
        # auto at T > 0: what this step's drafts are accepted on average (`verify.expected_acceptance`): its option's
        # estimates learn from that, not from the step's coins (`auto.batch.BatchAuto.update`)
        self.expected: list[tuple[float, float]] | None = None
        self.out = TokenStream(max_tokens=req.max_tokens, eos=req.eos, tokenizer=req.tokenizer, stop=req.stop)
        self.history = list(req.ids)
        self.cache = req.cache if req.cache is not None else model.make_cache()
        self.done_prefill = req.reuse  # prompt positions in the solo cache
        self.prefill_step = prefill_step
        self.prefill_taps: list = []
        self.stats = req.stats
        self.stats.mode = "auto" if options is not None else "ar" if self.drafter is None else self.drafter.kind
        self.t_added = time.perf_counter()
        self.t_first = None
        self.cancelled = False
        self.rounds = self.plain_rounds = 0
        self.hist = Counter()
        self.batch_sizes = 0  # sum of the batch sizes of the steps this row was in
        self.steps = 0  # decode steps it was in
        self.drafts: list[int] = []
        self.q = None
        self.here: dict = {}  # auto: how its rounds of each model drafter did against the estimates (`BatchAuto.rho`)
        self.final_cache: list[KVCache] | None = None
        self.ahead = False  # its length already counts the token of a step not read back yet

    @property
    def regime(self) -> str:
        return "greedy" if self.sampler.params.greedy else "sampling"

    def tau(self) -> float:
        """Tokens committed per round so far (1 before any round, and for plain rows)."""
        return sum(n * c for n, c in self.hist.items()) / self.rounds if self.rounds else 1.0

    @property
    def finished(self) -> bool:
        return self.out.finish is not None or self.cancelled

    @property
    def first_pending(self) -> bool:
        """Joined on its last prompt token (`BatchGenerator._prefill_chunk`): its first token is still to come. That
        step is a plain round, whatever its drafters — alone, the prefill samples it with one sampler call."""
        return len(self.history) == len(self.req.ids)

    def start_drafters(self, taps: dict) -> None:
        """After its prefill: every drafter takes the prompt (`taps`: {target layer: its rows over the prefilled
        positions}) — extended from the state it continues on a reused prefix, started afresh otherwise."""
        for d in self.drafters:
            (d.extend if self.req.reuse else d.start)([taps[layer] for layer in d.taps], self.history)

    def started(self) -> None:
        """Its first token is out: the prompt's statistics."""
        self.t_first = time.perf_counter()
        self.stats.prompt_tokens, self.stats.prompt_time = len(self.req.ids), self.t_first - self.t_added

    # -- one step --------------------------------------------------------------------------------------------------
    @property
    def drafters(self) -> list:
        """Every drafter whose state follows this row's tokens."""
        if self.options is not None:
            return list(self.options.values())
        return [] if self.drafter is None else [self.drafter]

    def drafting(self, choice: tuple | None = None) -> tuple:
        """(the drafter that drafts this step or None, drafts k): choice: an auto row's (option name, drafts) for
        this step (option None: plain)."""
        if self.first_pending:
            self.choice = None
            return None, 0
        if self.options is not None:
            name, k = choice if choice is not None else (None, 0)
            self.choice = None if name is None else (name, name.split("@")[0])
            return (None, 0) if name is None else (self.options[self.choice[1]], k)
        return (None, 0) if self.drafter is None else (self.drafter, min(self.req.width, self.out.budget - 1))

    def plan(self, drafter, k: int, drafted: tuple | None = None) -> list[int]:
        """What this row feeds the next forward: [last token] (a plain round: k 0) or [anchor, d1..dk] from
        `drafter` (`drafting`); drafted: its (drafts, q) when drafted together with other rows' (`batch_drafts`)."""
        anchor = self.history[-1]
        if k == 0:
            self.drafts, self.q = None, None
            return [anchor]
        if drafted is not None:
            self.drafts, self.q = drafted
        else:
            pos = len(self.history) - 1  # the anchor's position: the cache holds every committed token but the anchor
            self.drafts, self.q = drafter.propose(anchor, pos, k, self.sampler, self.history)
        if not self.drafts:  # nothing drafted (n-gram lookup found no match): a plain round, as the solo engine's
            self.drafts, self.q, self.choice = None, None, None
            return [anchor]
        return [anchor] + self.drafts

    def available(self, k_max: int) -> dict:
        """An auto row's {option: most drafts it gives now} (n-gram lookup: as the option it offers,
        `NGramDrafter.offer`, only where the context's suffix occurred before)."""
        out = {}
        for kind, d in self.options.items():
            if kind == "ngram":
                drafts, name = d.offer(k_max)
                if drafts:
                    out[name] = len(drafts)
            else:
                out[kind] = min(k_max, d.max_drafts)
        return out

    def accept(self, logits: mx.array, taps: tuple[int, dict] | None, token: int | None = None) -> list[int]:
        """logits [len(feed), V] of this row; taps: (this row's index in the step, {target layer: the step's output of
        that layer [B, L, D]}), cut here once to the row's committed positions for all its drafters (a cut per layer
        and drafter after one per layer were ~14 MLX ops a row and step with DFlash and MTP carried along plain steps,
        where the host's work sets a small model's pace on an accelerator);
        token: a plain round's token when already picked (greedy rows batched). Returns the new committed tokens
        (the cache keeps the anchor and the accepted drafts: len(new) rows)."""
        p = self.sampler.params
        first = self.first_pending  # its first token: the prefill's sample, not a round
        drafters = self.drafters
        if self.drafts is None:  # a plain round (PlainDecoder's sampler call)
            if token is None:
                token = int(self.sampler(logits[-1:], history_window(p, self.history)).item())
            new = [token]
            self.plain_rounds += int(bool(drafters) and not first)
        else:
            if p.greedy:
                n, nxt = verify_greedy(logits, self.drafts, self.sampler, self.history)
            else:
                pd = target_distribution(logits, self.sampler, self.history, self.drafts)
                if self.options is not None:  # p and q evaluated with the verify, read after it (`AutoDecoder.sampled`)
                    mx.async_eval([a for a in (pd, self.q) if a is not None])
                n, nxt = verify_sampling(pd, self.q, self.drafts, self.sampler)
                if self.options is not None:
                    self.expected = expected_acceptance(pd, self.q, self.drafts)
            new = self.drafts[:n] + [nxt]
        self.history.extend(new)
        if drafters:
            cut = {}
            if taps is not None:
                j, layers = taps
                cut = {t: a[j : j + 1, : len(new)] for t, a in layers.items()}
            for d in drafters:
                d.accept([cut[t] for t in d.taps], new)
        if first:
            self.started()
        elif drafters:
            self.rounds += 1
            self.hist[len(new)] += 1
        return new

    def stats_extra(self) -> dict:
        d = {"batch_size_mean": self.batch_sizes / max(1, self.steps)}
        if self.drafters:
            committed = sum(n * c for n, c in self.hist.items())
            d.update(rounds=self.rounds, plain_rounds=self.plain_rounds,
                     tau=committed / self.rounds if self.rounds else 0.0,
                     acceptance_histogram={int(n): int(c) for n, c in sorted(self.hist.items())})
            if self.options is None:
                d["max_drafts"] = self.req.width
        return d


class BatchGenerator:
    """Rows join (`add`) and leave at any step; `step()` runs at most one prefill chunk of the oldest waiting row
    (those before it with all but their last prompt token cached join without one, as many as there is room for)
    and one batched decode step of the rows in the batch, and returns [(row, chunk)] of this step. max_batch: rows
    decoding together (more wait, prefilled one by one as rows leave). auto: the `auto.batch.BatchAuto` that
    chooses for the rows added with `auto=True` (needed only for them)."""

    def __init__(self, model, *, max_batch: int = DEFAULT_MAX_BATCH, prefill_step: int = DEFAULT_PREFILL_STEP,
                 auto=None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model, self.max_batch, self.prefill_step = model, max_batch, prefill_step
        self.auto = auto
        self.layout, self.cache = make_batch_cache(model.args)
        self.rows: list[Row] = []  # in the batch, in layout order
        self.waiting: deque[Row] = deque()  # being prefilled, in arrival order
        self.steps = 0
        self.step_rows = Counter()  # batch size -> decode steps
        self.pending: Launched | None = None  # a queued step not read back yet (plain rows, pipelined)
        self._landed: float | None = None  # when the latest step was read back
        self._prefilling = 0.0  # seconds of prefill chunks since then
        self._span: Span | None = None  # the speculative stretch being measured (`_observe`)
        self._cut: tuple[float, float] | None = None  # the latest step when it was a plain step read back short

    def __len__(self) -> int:
        return len(self.rows) + len(self.waiting)

    def add(self, req: BatchRequest) -> Row:
        if req.auto and (self.auto is None or req.drafter is not None):
            raise ValueError("an auto row needs the batch's auto chooser and no drafter of its own")
        # an auto row's drafters are chosen when its prefill starts (`_prefill_chunk`), not here
        options = (req.options if req.options is not None else {}) if req.auto else None
        row = Row(req, self.model, self.prefill_step, options=options)
        self.waiting.append(row)
        return row

    def cancel(self, row: Row) -> None:
        """Stop a row at the next step (its chunk of that step is not produced)."""
        row.cancelled = True

    # -- prefill ---------------------------------------------------------------------------------------------------
    def _prefill_chunk(self, row: Row) -> GenerationChunk | None:
        """One prefill chunk of `row`; after the last one its first token (the chunk returned) and it joins — or it
        joins with its last prompt token still to feed (no chunk: its first token comes from a batch step)."""
        ids, s = row.req.ids, row.done_prefill
        if s == row.req.reuse and row.req.auto and row.req.options is None:
            # an auto row's own drafters (before its prefill: they take its taps), for the batch it will decode in:
            # the rows decoding now and those queued with it, which join before it or right after (a burst of
            # requests added at once must not each be sized as if alone — the first would carry a model drafter,
            # its taps and bookkeeping, until `PRUNE_EVERY` steps drop it)
            n = min(self.max_batch, len(self.rows) + len(self.waiting))
            row.options = self.auto.options(row.regime, max(1, n), row.out.budget)
            if row.req.reuse:  # a model drafter has no state for the reused prefix (a server passes the states
                # its prompt cache kept, as `options`): only n-gram lookup, which rebuilds its index from the ids
                row.options = {kind: d for kind, d in row.options.items() if not d.taps}
        if s == len(ids) - 1 and row.req.input_embeddings is None and not any(d.taps for d in row.drafters):
            # all but its last prompt token cached (a prompt-cache hit, or a prompt one token past a chunk): that
            # token is the row's anchor as after any round, so it joins now and the batch's next forward samples its
            # first token — the forward a prefill would spend on one token is saved (`Row.first_pending`)
            row.start_drafters({})  # n-gram lookup: its index of the prompt; the first token extends it
            self._join(row)
            return None
        e = min(len(ids), s + row.prefill_step)
        want = tuple(sorted({t for d in row.drafters for t in d.taps}))
        taps = want if row.drafters else None
        kw = {} if row.req.input_embeddings is None else {"input_embeddings": row.req.input_embeddings[:, s:e]}
        last = e >= len(ids)
        # the last position's logits only (the taps cover every position): a row with drafters once took the whole
        # chunk's — its positions × the vocabulary, a prompt's worth of lm-head work for one token
        out = self.model(mx.array([ids[s:e]], dtype=mx.int32), row.cache, taps=taps, last=1, **kw)
        logits, tapped = out if taps is not None else (out, None)
        if tapped is not None:
            row.prefill_taps.append(tapped)
        row.done_prefill = e
        if not last:
            mx.eval([c.state for c in row.cache] + (tapped or []))
            return None
        y = row.sampler(logits[:, -1], history_window(row.sampler.params, row.history))
        t = int(y.item())
        row.started()
        row.history.append(t)
        if row.drafters:
            parts = row.prefill_taps
            joined = {layer: mx.concatenate([p[i] for p in parts], axis=1) if len(parts) > 1 else parts[0][i]
                      for i, layer in enumerate(want)}
            row.start_drafters(joined)
            row.prefill_taps = []
        chunk = row.out.push([t])
        if not row.finished:
            self._join(row)
        return chunk

    def _join(self, row: Row) -> None:
        b = self.layout.append(row.cache[0].offset)
        self.rows.append(row)
        for bc, c in zip(self.cache, row.cache):
            bc.put_row(b, c)
        row.cache = None  # its rows live in the batch now

    def _leave(self, finished: list[int], keep_cache: bool) -> None:
        for b in finished:
            if keep_cache and not self.rows[b].cancelled:
                self.rows[b].final_cache = [c.row_cache(b) for c in self.cache]
        keep = [b for b in range(len(self.rows)) if b not in set(finished)]
        if keep:
            for c in self.cache:
                c.remove_rows(keep)
            self.layout.keep(keep)
        else:  # an empty batch: its buffers go
            self.layout, self.cache = make_batch_cache(self.model.args)
        self.rows = [self.rows[b] for b in keep]

    # -- a step ----------------------------------------------------------------------------------------------------
    def step(self, keep_cache: bool = False) -> list[tuple[Row, GenerationChunk]]:
        """keep_cache: a row that finishes keeps its cache as a solo cache (`Row.final_cache`).

        Plain rows are pipelined as the solo plain loop is: when every row of the batch steps plainly (no drafter,
        no repetition penalty), the next step's forward is queued on the sampled tokens before they are read back
        (`mx.async_eval`), so the host's work — reading, stop strings, streaming — overlaps the model's. A row that
        finishes meanwhile has fed one token too many: never committed, never seen."""
        events: list[tuple[Row, GenerationChunk]] = []
        if self.pending is not None:
            nxt = self._launch(self.pending) if self.rows and self._chainable(self.pending) else None
            events += self._land(self.pending, keep_cache, queued=nxt is not None)
            self.pending = nxt
        while self.waiting and len(self.rows) < self.max_batch:  # one prefill forward a step; joins without one
            row = self.waiting[0]
            if row.cancelled:
                self.waiting.popleft()
                continue
            t, done = time.perf_counter(), row.done_prefill
            chunk = self._prefill_chunk(row)
            spent = time.perf_counter() - t
            self._prefilling += spent
            if self.auto is not None:
                self.auto.observe_prefill(row.done_prefill - done, spent)
            if chunk is not None or row.cache is None:  # prefilled: it joined, or finished at its first token
                self.waiting.popleft()
            if chunk is not None:
                events.append((row, chunk))
                if row.finished:  # done at its first token: it never joined, its solo cache is the whole prompt
                    if keep_cache and not row.cancelled:
                        row.final_cache, row.cache = row.cache, None
                    self._finish(row)
            if chunk is not None or row.cache is not None:  # it ran a forward: the batch's step comes next
                break
        if self.pending is None:
            gone = [b for b, r in enumerate(self.rows) if r.cancelled]
            if gone:
                self._leave(gone, keep_cache=False)
            if self.rows:
                launched = self._launch(None)
                if self._chainable(launched):
                    self.pending = launched  # read back in the next step, after the one after it is queued
                else:
                    events += self._land(launched, keep_cache, queued=False)
        return events

    def _chainable(self, st: Launched) -> bool:
        """Whether the next step can be queued before this one is read: every row steps plainly (no fixed-mode
        drafter; `auto` rows only when the chooser, asked on their state one token behind — the way the solo `auto`
        plans a plain stretch — picks a plain step for all of them), no repetition penalty (its window needs the
        token read back), none cancelled. A speculative step is then chosen afresh once the tokens are known."""
        if not all(id(r) in st.tokens for r in st.rows):  # a row of `st` verifies drafts: its tokens decide
            return False
        if not all(r.drafter is None and r.sampler.params.repetition_penalty == 1.0 and not r.cancelled
                   for r in self.rows):
            return False
        return not any(c[0] is not None for c in self._choose(self.rows).values())

    def _choose(self, rows: list[Row]) -> dict[int, tuple]:
        """The auto rows' choices for this step ({row index: (option, drafts)}), from the batch's chooser."""
        # an auto row with no option left (an auto without n-gram lookup whose model drafters could not pay) steps
        # plainly, as a fixed plain row
        autos = [b for b, r in enumerate(rows) if r.options and not r.first_pending]
        if not autos:
            return {}
        if self.steps % PRUNE_EVERY == 0:
            # a model drafter the batch's choice could no longer take for the row (`BatchAuto.carries`: it does not
            # pay at this batch size by its mean estimate, and exploring it no longer would — its estimate narrowed,
            # the batch grew, the row went past the phases where it pays) is no longer carried. The row is asked
            # about as if its whole budget were still ahead: a drafter is never dropped because the request nears
            # its end — its state outlives the request (the prompt cache keeps it for the conversation's next turn,
            # which without it prefills the conversation again or goes without the drafter), and following the few
            # steps left costs the row little
            for b in autos:
                r = rows[b]
                for kind in [k for k, d in r.options.items() if d.taps]:
                    if not self.auto.carries(kind, r.regime, len(rows), r.out.max_tokens, r.out.n,
                                             self.auto.rho(kind, r.regime, r.here)):
                        del r.options[kind]
            autos = [b for b in autos if rows[b].options]
            if not autos:
                return {}
        chosen = set(autos)
        fixed = [r for b, r in enumerate(rows) if b not in chosen]  # a row's first token: a plain round
        fixed_width = max((1 + min(r.req.width, r.out.budget - 1) if r.drafter is not None and not r.first_pending
                           else 1 for r in fixed), default=1)
        # (a fixed row that feeds a block makes the step speculative anyway: the auto rows are asked what to add)
        if self.auto.closed(fixed_width) or fixed_width == 1 and not self.auto.asks():
            return {}
        k_max = max(d.max_drafts for b in autos for d in rows[b].options.values())
        fixed_tokens = sum(r.tau() for r in fixed)
        _, plan = self.auto.choose([(self.auto.key(r.regime, r.out.n), r.out.budget, r.available(k_max),
                                     self.auto.rhos(r.here, r.regime), self._behind(r))
                                    for r in (rows[b] for b in autos)], len(fixed), fixed_width, fixed_tokens, k_max)
        return dict(zip(autos, plan))

    def _behind(self, row: Row) -> tuple:
        """((option, seconds), ...): what each of an auto row's model drafters would spend beyond a steady round
        taking in its backlog, where it has one (`_backlog_price`)."""
        prices = ((kind, self._backlog_price(row, kind, d)) for kind, d in row.options.items())
        return tuple((kind, cost) for kind, cost in prices if cost > 0.0)

    def _backlog_price(self, row: Row, kind: str, d) -> float:
        """What row `row`'s drafter `d` of option `kind` spends beyond a steady round taking in its backlog
        (`BatchAuto.backlog_cost`; a drafter without taps has none)."""
        return self.auto.backlog_cost(kind, d.backlog, len(row.history) - 1) if d.taps else 0.0

    def _launch(self, after: Launched | None) -> Launched:
        """Build (and queue) one batched forward. after: the launched step not read back yet whose sampled tokens
        this one feeds (every row plain): those rows' lengths are advanced now by the token that step commits."""
        rows = list(self.rows)
        choices = {} if after is not None else self._choose(rows)
        if choices and self.auto.exploring is not None:
            self.auto.explored[self.auto.exploring] = self.auto.explored.get(self.auto.exploring, 0) + 1
        lazies = {b: after.tokens.get(id(r)) for b, r in enumerate(rows)} if after is not None else {}
        plans = {b: r.drafting(choices.get(b)) for b, r in enumerate(rows) if lazies.get(b) is None}
        # what each auto row's drafter takes in beyond a steady round, priced (`_behind`): its round's time less that
        # is what its drafting costs in a run of rounds (`BatchAuto.observe_draft`)
        behind = {b: self._backlog_price(rows[b], rows[b].choice[0], d)
                  for b, (d, k) in plans.items() if k > 0 and rows[b].choice is not None}
        t = time.perf_counter()
        drafted = batch_drafts(rows, plans)
        shared = (time.perf_counter() - t) / max(1, len(drafted))  # each batched row's share of the drafting
        drafting = shared * len(drafted)
        parts, widths = [], []
        for b, r in enumerate(rows):
            lazy = lazies.get(b)
            if lazy is not None:
                self.layout.commit(b, 1)
                r.ahead = True
                r.drafts, r.q, r.choice = None, None, None
                parts.append(lazy.reshape(1, 1).astype(mx.int32))
                widths.append(1)
            else:
                c = choices.get(b)
                t = time.perf_counter()
                f = r.plan(*plans[b], drafted.get(b))
                spent = time.perf_counter() - t
                if plans[b][1] > 0:  # a row that drafts, in a fixed mode as well: the step's time is without it
                    drafting += spent  # (counted in, a fixed DFlash row's drafter forward priced every 1 × 16 step
                    # ~1.8x what its forward costs, and auto's own rounds paid their drafting twice on that price)
                if r.choice is not None:  # what the chosen drafter's round measurably costs
                    self.auto.observe_draft(c[0], c[1], spent + (shared if b in drafted else 0.0) - behind.get(b, 0.0))
                parts.append(f)
                widths.append(len(f))
        L = max(widths)
        x = mx.concatenate([mx.array([p + [p[-1]] * (L - len(p))], dtype=mx.int32) if isinstance(p, list) else p
                            for p in parts], axis=0)
        want = tuple(sorted({t for r in rows for d in r.drafters for t in d.taps}))
        t0 = time.perf_counter()
        out = self.model(x, self.cache, taps=want or None)
        logits, tapped = out if want else (out, None)
        # plain rows without a penalty: their tokens as lazy arrays (greedy: one argmax for all of them, greedy_token's
        # arithmetic; sampled: each row's own sampler, its own key chain, in row order)
        plain = [b for b, r in enumerate(rows) if r.drafts is None and r.sampler.params.repetition_penalty == 1.0]
        greedy = [b for b in plain if rows[b].sampler.params.greedy]
        tokens = {}
        if greedy:
            g = mx.argmax(logits[mx.array(greedy), 0].astype(mx.float32), axis=-1)
            tokens = {id(rows[b]): g[i : i + 1] for i, b in enumerate(greedy)}
        for b in plain:
            if id(rows[b]) not in tokens:
                tokens[id(rows[b])] = rows[b].sampler(logits[b : b + 1, 0])
        if tokens:
            mx.async_eval(list(tokens.values()))
        self.steps += 1
        self.step_rows[len(rows)] += 1
        return Launched(rows, widths, logits, tapped, want, tokens, t0, chained=after is not None, drafting=drafting)

    def _land(self, st: Launched, keep_cache: bool, queued: bool) -> list[tuple[Row, GenerationChunk]]:
        """Read a launched step back: each row accepts, commits and streams its tokens; finished rows leave. queued:
        the next step was queued behind it before it was read back."""
        ids = list(st.tokens)
        values = dict(zip(ids, mx.concatenate([st.tokens[i] for i in ids]).tolist())) if ids else {}
        index = {id(r): b for b, r in enumerate(self.rows)}
        B, L = len(st.rows), max(st.widths)
        events, finished, committed, drafted = [], [], 0, False
        layers = dict(zip(st.want, st.tapped)) if st.want else None  # each row cuts its own (`Row.accept`)
        for j, r in enumerate(st.rows):
            b = index.get(id(r))
            if b is None or r.finished:  # left the batch after this step was queued
                continue
            n_fed = st.widths[j]
            r.batch_sizes += B
            r.steps += 1
            new = r.accept(st.logits[j, :n_fed], None if layers is None else (j, layers), token=values.get(id(r)))
            committed += len(new)
            if r.choice is not None:
                drafted = True
                self.auto.update(r.choice[0], self.auto.key(r.regime, r.out.n), len(r.drafts), len(new) - 1,
                                 here=r.here, expected=r.expected)
                r.expected = None
            if r.ahead:  # the step after this one already counted this token
                r.ahead = False
            else:
                self.layout.commit(b, len(new))
            chunk = r.out.push(new)
            r.stats.generation_tokens = r.out.n
            r.stats.generation_time = time.perf_counter() - r.t_first
            events.append((r, chunk))
            if r.finished:
                finished.append(b)
        now = time.perf_counter()
        if self.auto is not None:
            self.auto.decoded += committed
            self._observe(st, B, L, now, committed if drafted else None, queued)
        self._landed, self._prefilling = now, 0.0
        if finished:
            for b in finished:
                self._finish(self.rows[b])
            self._leave(finished, keep_cache)
            if not self.rows and self.auto is not None:  # the batch ran dry: a stretch is measured as far as it went
                self._close_span()
        return events

    def step_seconds(self, st: Launched, now: float) -> float:
        """What step `st`, read back at `now`, cost in a run of steps: the time since the previous read-back less the
        prefill chunks run in between (a generator's first step: from its launch, after the prefills before it)."""
        return now - self._landed - self._prefilling if self._landed is not None else now - st.t0

    def _observe(self, st: Launched, B: int, L: int, now: float, committed: int | None, queued: bool) -> None:
        """Tell the batch chooser what this step cost: the time since the previous read-back, minus prefill chunks run
        in between (`step_seconds`) and, for its price, its drafting (priced per option). committed: the tokens the
        step committed when an auto row drafted in it (the ledger's: `BatchAuto.credit`); queued: the next step was
        queued behind it before it was read back.

        A plain step's time prices plain steps only where the pipeline ran through it (queued behind the step before
        it and the next queued behind it) or ran through none of it: one read back with nothing queued behind it
        (`_cut`) is short of a step where queueing a step runs most of its forward, and the first one queued behind
        nothing long. A speculative stretch is measured as a whole (`Span`): the cut step before it, its steps and the
        plain steps after it; when it ends its plain steps' time beyond their price is its estimate's
        (`BatchAuto.charge`) and every step of it goes to the ledger (`BatchAuto.credit`)."""
        dt = self.step_seconds(st, now)
        plain_step = self.auto.step_cost(B, rows=B)  # before this step's time moves it
        self.auto.elapse(dt, spec=L > 1)
        built = self.auto.first_of(B, L)  # MLX built kernels for it: not what such a step costs (`BatchAuto.first_of`)
        cut, self._cut = self._cut, None
        span = self._span
        if L > 1:
            if not built:
                self.auto.observe(B * L, dt - st.drafting, spec=True, rows=B)
            if span is None:
                span = self._span = Span()
                if cut is not None:
                    span.steps.append((*cut, 1.0, True))
            span.n, span.rows, span.after = B * L, B, 0
            span.steps.append((dt, plain_step, None if committed is None else committed / B, False))
            span.credited |= committed is not None
            span.priced &= not built
            if len(span.steps) >= SPAN_MAX:  # steps that draft every time (a fixed-mode row's): booked in parts
                self._close_span()
                self._span = Span(n=span.n, rows=span.rows)  # ... the stretch goes on being measured
            return
        if span is not None:
            span.steps.append((dt, plain_step, 1.0, True))
            span.priced &= not built
            span.after += 1
            if span.after >= max(1, self.auto.span_after):
                self._close_span()
            return
        if built:
            return
        if st.chained and not queued:  # short of a step: whose it is, the next step says (a stretch's, or none's)
            self._cut = (dt, plain_step)
        elif st.chained == queued:  # the pipeline ran through it, or through none of it
            self.auto.observe(B, dt, spec=False, rows=B)
        # (queued behind nothing, the next queued behind it: its time has the next step's queueing in it)

    def _close_span(self) -> None:
        """The measured stretch is over (`Span`): to the chooser's books (`BatchAuto.book`)."""
        span, self._span = self._span, None
        if span is not None and span.priced:
            self.auto.book(span.steps, span.n, span.rows, span.credited)

    def _finish(self, row: Row) -> None:
        if row.req.auto:  # what its rounds taught, for the next process (`AutoDrafter.remember`: every few seconds)
            self.auto.close_row(row.here)
            self.auto.auto.remember()
        row.stats.generation_tokens = row.out.n
        if row.t_first is not None:
            row.stats.generation_time = time.perf_counter() - row.t_first
        row.stats.extra.update(row.stats_extra())
        for d in row.drafters:
            row.stats.extra.update(d.stats())
