import json, sys
from pathlib import Path
import mlx.core as mx
from mlx.utils import tree_flatten
from glimmer_mlx.embedded import embedded_path
from glimmer_mlx.models.glimmer import Model
src = Path(embedded_path("target")); out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
cfg = json.loads((src / "config.json").read_text())
t = cfg["text_config"]
t.update(hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
         vocab_size=32768, num_hidden_layers=12, layer_types=(t["layer_types"] * 2)[:12],
         layer_rope_theta=(t["layer_rope_theta"] * 2)[:12], dtype="bfloat16")
cfg["dtype"] = "bfloat16"
(out / "config.json").write_text(json.dumps(cfg))
from glimmer_mlx.loading import load_config
m = Model(load_config(out))
w = {k: (v * 0.02 if v.ndim == 2 else v).astype(mx.bfloat16) for k, v in tree_flatten(m.parameters())}
mx.save_safetensors(str(out / "model.safetensors"), w, metadata={"format": "mlx"})
print(sum(v.nbytes for v in w.values()) / 2**20, "MiB")
