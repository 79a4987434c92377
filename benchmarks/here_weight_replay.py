"""How well a request's rounds predict its next ones (`chooser.Option.rho`): the embedded model's DFlash drafter drafts
every round (block 8, T = 0 and T = 1) on the 20 shipped prompts under the chat template; each round's drafts
accepted are recorded, then replayed — the requests in a shuffled order, as a server sees them — through an
`AutoChooser` that learns from them as auto does (its estimates carried across requests, ρ within each). Printed:
the mean squared error of each round's predicted accepted drafts (by the estimates × ρ, before the round) against
what it accepted, with ρ's weight fixed at `chooser.HERE_WEIGHT` (as before the thirty-seventh session), measured
between requests (`Option.here_weight`), and with no ρ at all (the estimates alone). Timing plays no part: the
figures are the same on every machine for the same rounds.

    python benchmarks/here_weight_replay.py [MAX_TOKENS [ORDERS]]     (default 64 tokens, 20 shuffled orders)
"""
import random
import statistics
import sys

import ab_setup  # noqa: F401  (a cold auto: GLIMMER_MLX_AUTO_LEARNED=off)
from glimmer_mlx.bench.settings import load_prompts
from glimmer_mlx.generate import stream_generate
from glimmer_mlx.session import load_session
from glimmer_mlx.speculative.auto.chooser import HERE_WEIGHT, AutoChooser, expected_tokens

MAX_TOKENS = int(sys.argv[1]) if len(sys.argv) > 1 else 64
ORDERS = int(sys.argv[2]) if len(sys.argv) > 2 else 20
K = 7


def record(session, temperature: float) -> list[tuple[str, list[tuple[int, int]]]]:
    """[(category, [(tokens generated before the round, drafts accepted)])] of every shipped prompt."""
    out = []
    for cat, texts in load_prompts().items():
        for i, text in enumerate(texts):
            ids = session.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                        add_generation_prompt=True, tokenize=True)
            rounds, pos = [], None
            for chunk in stream_generate(session.model, ids, max_tokens=MAX_TOKENS, temperature=temperature,
                                         seed=i, drafter=session.drafters.dflash, block_size=K + 1):
                n = len(chunk.tokens)
                if pos is not None and n and chunk.finish_reason is None:
                    rounds.append((pos, min(n - 1, K)))
                pos = (pos or 0) + n
            out.append((cat, rounds))
    return out


def replay(requests, regime: str, rule: str, seed: int, tau: dict) -> float:
    """Mean squared error of the predicted accepted drafts per round over `requests` in a shuffled order."""
    ch = AutoChooser({L: 1.0 for L in range(1, K + 2)})
    opt = ch.add("dflash", K, "affine", draft_prior=(0.0, 0.0), measured_tau=tau)
    if rule == "fixed":
        opt.here_weight = lambda r: HERE_WEIGHT
    order = list(requests)
    random.Random(seed).shuffle(order)
    errors = []
    for _, rounds in order:
        if rule != "none":
            ch.new_context()
        for pos, accepted in rounds:
            ch.set_phase(pos)
            key = regime if ch.phase is None else f"{regime}#{ch.phase}"
            predicted = expected_tokens(opt.alphas(key)[:K]) - 1.0
            errors.append((predicted - accepted) ** 2)
            ch.update("dflash", K, accepted, regime)
    return statistics.mean(errors), opt.here_weight(regime)


def main():
    s = load_session(None)
    tau = s.drafters.dflash.measured_tau
    for temperature, regime in ((0.0, "greedy"), (1.0, "sampling")):
        requests = record(s, temperature)
        n = sum(len(r) for _, r in requests)
        by_cat = {}
        for cat, rounds in requests:
            by_cat.setdefault(cat, []).extend(a for _, a in rounds)
        print(f"T = {temperature:g}: {len(requests)} requests, {n} rounds; accepted drafts a round by category "
              + ", ".join(f"{c} {statistics.mean(v):.2f}" for c, v in by_cat.items() if v))
        for rule in ("none", "fixed", "measured"):
            got = [replay(requests, regime, rule, seed, tau) for seed in range(ORDERS)]
            print(f"  ρ {rule:8s}: mean squared error {statistics.mean(e for e, _ in got):.3f} "
                  f"(over {ORDERS} orders: {min(e for e, _ in got):.3f}-{max(e for e, _ in got):.3f}); weight at "
                  f"the end {statistics.mean(w for _, w in got):.1f}")


if __name__ == "__main__":
    main()
