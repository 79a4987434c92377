"""Host time per token outside the model's forward (issue 20): plain decoding and `auto` variants interleaved
(`glimmer_mlx.bench.runner.task_order`) on the first prompt of each shipped category under the chat template, the
embedded model, MAX_TOKENS tokens, REPS repeats. Per mode: seconds per token from the first chunk to the last, the
share spent inside `PlainDecoder.queue` (building the next step and `mx.async_eval`, which on MLX's CPU backend returns
only once most of the forward has run) and the rest — reading the token back, the engine's and auto's bookkeeping,
streaming. The rest is what a mode adds to a plain token on the host, measured without the forward's noise.

Modes: ar; auto (every drafter); dfauto (auto over the DFlash drafter alone: `dflash-auto`).

    python benchmarks/host_per_token.py T REPS [MAX_TOKENS [MODES]]     e.g. 1 10 32 ar,auto,dfauto
    AB_SET=DIR python benchmarks/host_per_token.py ...                   the trained tiny set (`ab_setup.py`)
"""
import sys
import time

import mlx.core as mx
from ab_setup import args, session_and_prompts

from glimmer_mlx.bench.runner import task_order
from glimmer_mlx.generate import stream_generate
from glimmer_mlx.runtime.plain import PlainDecoder
from glimmer_mlx.strategy import DecodeSpec

T, reps, n = args()
modes = (sys.argv[4] if len(sys.argv) > 4 else "ar,auto,dfauto").split(",")
s, ids, _ = session_and_prompts()
m = s.model
m.eos_token_ids = set()  # every run decodes n tokens
specs = {"ar": None, "auto": DecodeSpec("auto"), "dfauto": DecodeSpec("dflash", "auto")}

in_queue = [0.0]
queue = PlainDecoder.queue


def timed_queue(self, token=None):
    t = time.perf_counter()
    queue(self, token)
    in_queue[0] += time.perf_counter() - t


PlainDecoder.queue = timed_queue
res = {mo: [0.0, 0.0, 0] for mo in modes}  # seconds first to last token, of them in queue, tokens
for r in range(reps):
    for ci, c in enumerate(ids):
        for mo in task_order(modes, r * len(ids) + ci):
            drafter, block = (None, None) if specs[mo] is None else s.drafters.select(specs[mo])
            mx.clear_cache()
            stamps, tokens = [], 0
            for ch in stream_generate(m, ids[c], max_tokens=n, temperature=T, seed=1000 * r + ci,
                                      drafter=drafter, block_size=block):
                if not stamps:
                    in_queue[0] = 0.0
                else:
                    tokens += len(ch.tokens)  # the tokens after the first chunk's
                stamps.append(time.perf_counter())
            x = res[mo]
            x[0] += stamps[-1] - stamps[0]
            x[1] += in_queue[0]
            x[2] += tokens
base = res["ar"][0] / res["ar"][2] if "ar" in res else None
print(f"T {T} reps {reps} tokens {n}")
for mo, (tot, q, k) in res.items():
    vs = f", x plain {base / (tot / k):.3f}" if base else ""
    print(f"{mo}: {1e6 * tot / k:.0f} us a token, {1e6 * q / k:.0f} in queue, {1e6 * (tot - q) / k:.0f} outside{vs}")
