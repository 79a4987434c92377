"""What the batch's `auto` chooser predicted for its speculative steps against what they did (issue 24): N auto rows
of the embedded model (the shipped prompts under the chat template, 64 tokens, greedy), RUNS runs in one process.
For every speculative step the chooser chose (by its mean estimates or to explore), grouped by batch size, the options
drafted and why: the step's realized seconds (its drafting and the rest) and committed tokens, the chooser's predicted
seconds (drafting and the verify step) and tokens for that plan (`StepChoice.cost`), and the plain step of as many
rows it was weighed against (`BatchAuto.step_cost`). A chooser whose speculative steps predict well but whose plain
price sits above what plain steps take speculates where plain steps would have been faster.

    python benchmarks/batch_predictions.py N RUNS        e.g. 2 30
    python benchmarks/batch_predictions.py 1,2 RUNS      RUNS runs at each N in turn, one chooser (as `glimmer bench
                                                         serve` runs its levels): each N's steps reported apart
"""
import collections
import statistics
import sys

from ab_setup import batch_prompts, second_auto

from glimmer_mlx.sampling import Sampler, SamplingParams
from glimmer_mlx.session import load_session
from glimmer_mlx.speculative.auto import batch as auto_batch
from glimmer_mlx.speculative.batch import BatchGenerator, BatchRequest

LEVELS, RUNS = [int(x) for x in sys.argv[1].split(",")], int(sys.argv[2])
N = LEVELS[0]
s = load_session(None)
m, tok = s.model, s.tokenizer
ids = batch_prompts(tok)
ba = auto_batch.BatchAuto(second_auto(s))
cur, recs, took = {}, [], collections.defaultdict(list)
choose, observe, plain_observe = auto_batch.BatchAuto.choose, BatchGenerator._observe, auto_batch.BatchAuto.observe


def predicted_choose(self, rows, fixed_rows, fixed_width, fixed_tokens, k_max):
    k, plan = choose(self, rows, fixed_rows, fixed_width, fixed_tokens, k_max)
    cur.pop("pred", None)
    if k > 0:
        step = auto_batch.StepChoice(self, rows, fixed_rows, fixed_width, fixed_tokens, k)
        grouped = [None] * len(step.groups)
        for row, g in enumerate(step.of):
            grouped[g] = plan[row]
        tokens, seconds = step.cost(grouped)
        verify = step.step_cost(max([fixed_width] + [p[1] + 1 for p in plan if p[0]]))
        B = len(rows) + fixed_rows
        cur["pred"] = (tokens, seconds, verify, self.step_cost(B, rows=B), self.exploring,
                       "+".join(sorted({p[0] for p in plan if p[0]})))
    return k, plan


def measured_observe(self, st, B, L, now, committed, queued):
    dt = self.step_seconds(st, now)
    observe(self, st, B, L, now, committed, queued)
    pred = cur.pop("pred", None)
    if L > 1 and pred is not None:
        recs.append((N, B, dt, st.drafting, committed or 0, pred))


def noted_plain(self, n, seconds, spec, rows=None):
    if not spec and rows and n == rows and seconds > 0:
        took[(N, rows)].append(seconds)
    plain_observe(self, n, seconds, spec, rows)


auto_batch.BatchAuto.choose, BatchGenerator._observe = predicted_choose, measured_observe
auto_batch.BatchAuto.observe = noted_plain
for N in LEVELS:
    for r in range(RUNS):
        g = BatchGenerator(m, auto=ba)
        for j in range(N):
            g.add(BatchRequest(ids[(r + j) % len(ids)], Sampler(SamplingParams(), j), 64, set(tok.eos_token_ids),
                               tok, auto=True))
        while len(g):
            g.step()
groups = collections.defaultdict(list)
for level, B, dt, drafting, committed, pred in recs:
    groups[(level, B, pred[5], "explore" if pred[4] else "mean")].append((dt, drafting, committed, pred))
print(f"N={sys.argv[1]}, {RUNS} runs each; priced plain steps took (mean): "
      + ", ".join(f"N={level} {B} rows {1e3 * statistics.mean(v):.2f} ms" for (level, B), v in sorted(took.items())))
for (level, B, options, why), v in sorted(groups.items()):
    mean = lambda f: statistics.mean(f(x) for x in v)  # noqa: E731
    print(f"N={level}: {B} rows, {options} ({why}), {len(v)} steps: took {1e3 * mean(lambda x: x[0]):.1f} ms (drafting "
          f"{1e3 * mean(lambda x: x[1]):.1f}), {mean(lambda x: x[2]):.2f} tokens | predicted "
          f"{1e3 * mean(lambda x: x[3][1]):.1f} ms (verify step {1e3 * mean(lambda x: x[3][2]):.1f}), "
          f"{mean(lambda x: x[3][0]):.2f} tokens | a plain step priced {1e3 * mean(lambda x: x[3][3]):.2f} ms")
