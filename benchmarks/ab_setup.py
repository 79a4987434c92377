"""What the interleaved A/B scripts share (`auto_vs_plain_ab.py`, `auto_overhead.py`, `ngram_overlap_ab.py`): their
arguments T REPS [MAX_TOKENS], and the session and prompts — the embedded model with the first prompt of each shipped
category under the chat template, or with AB_SET=DIR the trained tiny set (`bench_tiny_set.py`: its target, DFlash
drafter and MTP layers; the prompts byte-encoded as `glimmer bench` does)."""
import os
import sys

from glimmer_mlx.bench.runner import encode_prompts
from glimmer_mlx.bench.settings import load_prompts
from glimmer_mlx.session import load_session


def args() -> tuple[float, int, int]:
    """(T, REPS, MAX_TOKENS) from the command line (REPS 4 and MAX_TOKENS 96 when not given)."""
    return (float(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 4,
            int(sys.argv[3]) if len(sys.argv) > 3 else 96)


def session_and_prompts():
    """(session, {category: prompt ids}, AB_SET or None)."""
    tiny = os.environ.get("AB_SET")
    prompts = load_prompts()
    if tiny:
        s = load_session(f"{tiny}/target", draft_model=f"{tiny}/dflash", mtp_model=f"{tiny}/mtp")
        encoded, _ = encode_prompts(prompts, None, s.model.args.vocab_size)
        return s, {c: encoded[c][0] for c in prompts}, tiny
    s = load_session(None)
    return s, {c: s.tokenizer.apply_chat_template([{"role": "user", "content": p[0]}], add_generation_prompt=True,
                                                  tokenize=True) for c, p in prompts.items()}, None
