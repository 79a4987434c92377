"""τ of DFlash v1 vs DFlash 2 trained on the same data (tests/dflash_training.py token-map target).
Usage: python benchmarks/dflash2_vs_v1.py EPOCHS BLOCK DATA_TEMP N_SEQS [SELECTOR_TOP_K]"""
import sys, time, tempfile
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import numpy as np, mlx.core as mx
import glimmer_mlx
from dflash_training import token_map_target
from glimmer_mlx.train.data import Sequence
from glimmer_mlx.train.loop import TrainConfig
from glimmer_mlx.train.recipes import acceptance, new_assistant_config, train_dflash, new_dflash2_config, new_dflash2
from glimmer_mlx.models.assistant import Assistant
from glimmer_mlx.speculative import DFlashDrafter
from glimmer_mlx.speculative.dflash2 import DFlash2Drafter
tmp = Path(tempfile.mkdtemp())
token_map_target(tmp / "t")
model, _ = glimmer_mlx.load(tmp / "t")
model.eos_token_ids = set()
DT = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
NS = int(sys.argv[4]) if len(sys.argv) > 4 else 24
r0 = np.random.RandomState(0)
raw = []
for i in range(NS):
    p = [int(x) for x in r0.randint(10, 48, size=8)]
    raw.append(p + glimmer_mlx.generate(model, p, max_tokens=40, temperature=DT, seed=i).tokens)
seqs = [Sequence(list(map(int, s)), [False] * 8 + [True] * (len(s) - 8)) for s in raw]
rng = np.random.RandomState(999)
held = [[int(x) for x in rng.randint(10, 48, size=8)] for _ in range(6)]
epochs = int(sys.argv[1]) if len(sys.argv) > 1 else 6
B = int(sys.argv[2]) if len(sys.argv) > 2 else 4
for v in ("v1", "v2"):
    kw = dict(layers=2, block_size=B, target_layer_ids=[1, 3], mask_token_id=8)
    mx.random.seed(0)
    if v == "v1":
        m = Assistant(new_assistant_config(model, None, **kw)); d = DFlashDrafter(m, model)
    else:
        c2 = new_dflash2_config(model, None, **kw); c2.selector_top_k = int(sys.argv[5]) if len(sys.argv) > 5 else 16; m = new_dflash2(c2); d = DFlash2Drafter(m, model)
    t0 = time.time()
    s = train_dflash(model, None, seqs, [], tmp / ("out" + v), assistant=m, cfg=TrainConfig(epochs=epochs, batch_size=16, lr=3e-3, save_every=0), anchors_per_seq=16)
    t1 = time.time()
    print(v, "train", round(t1 - t0, 1), "s", s["first_loss"], s["final_loss"], acceptance(model, d, held, None, max_tokens=40), round(time.time() - t1, 1), flush=True)
# diagnostics on the v2 drafter
v1path = DFlashDrafter(m, model)  # v2's network, v1's independent per-row drafts on the same draft logits
print("v2 net, v1 drafting", acceptance(model, v1path, held, None, max_tokens=40))
sel = m.candidate_selector
A, Bc = sel.predecessor_codebook, sel.successor_codebook
sel.predecessor_codebook = mx.zeros_like(A)
print("v2 unary-only selector", acceptance(model, d, held, None, max_tokens=40))
sel.predecessor_codebook = A
