"""The package's shape: every module imports in a fresh interpreter, the import graph (built from the package's own
`import` statements, function-level ones included) has no cycle, imports only point down the layering of README's
"Code map", and no private name (`_x`) is imported from another module."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "glimmer_mlx"

# README "Code map", bottom to top: a module may import its own layer (without a cycle) and the layers below
LAYERS = [
    ("config", "files", "machine", "quantization", "cache", "prompt_cache", "sampling", "kernels", "tokenizer",
     "image_processing",
     "multimodal", "tool_calls", "sandbox", "tools", "embedded"),
    ("models",),
    ("loading",),
    ("runtime",),
    ("speculative",),
    ("strategy",),
    ("generate", "session", "distributed", "follower"),
    ("", "chat", "agent", "serve", "convert", "info", "doctor", "train", "bench"),  # "": the package's public API
    ("cli",),
]


def modules() -> dict[str, Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        rel = f.relative_to(PKG.parent).with_suffix("")
        out[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = f
    return out


def imports(mods: dict[str, Path]) -> tuple[dict[str, set[str]], list[str]]:
    """(module -> the package modules it imports, every private name imported across modules)."""
    edges, private = {m: set() for m in mods}, []
    for m, f in mods.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                pairs = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = m.split(".")
                if node.level:
                    base = base[: len(base) - node.level + (f.name == "__init__.py")]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                pairs = [(f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target, a.name)
                         for a in node.names]
            else:
                continue
            for target, name in pairs:
                while target not in mods and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in mods and target != m:
                    edges[m].add(target)
                    if name and name.startswith("_") and not name.startswith("__"):
                        private.append(f"{m} imports {target}.{name}")
    return edges, private


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        x = stack.pop()
                        on.discard(x)
                        comp.append(x)
                        if x == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = counter[0]
                counter[0] += 1
                stack.append(w)
                on.add(w)
                work.append((w, iter(sorted(edges[w]))))
            elif w in on:
                low[v] = min(low[v], index[w])
    return out


def layer(module: str) -> int:
    rel = module[len("glimmer_mlx"):].lstrip(".")
    top = rel.split(".")[0]
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module} is in no layer of the code map")


def upward(edges: dict[str, set[str]]) -> list[str]:
    return [f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)})"
            for m, ts in sorted(edges.items()) for t in sorted(ts) if layer(t) > layer(m)]


def test_the_checks_catch_a_planted_cycle_and_a_planted_upward_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    edges, _ = imports(modules())
    edges["glimmer_mlx.runtime.plain"].add("glimmer_mlx.strategy")
    assert upward(edges) == ["glimmer_mlx.runtime.plain (layer 3) imports glimmer_mlx.strategy (layer 5)"]
    edges["glimmer_mlx.strategy"].add("glimmer_mlx.runtime.plain")
    assert any("glimmer_mlx.runtime.plain" in c and "glimmer_mlx.strategy" in c for c in cycles(edges))


def test_import_graph_is_acyclic_and_points_down():
    edges, private = imports(modules())
    assert cycles(edges) == []
    assert private == []
    assert upward(edges) == []
    assert not [m for m, ts in edges.items() if "glimmer_mlx" in ts]  # nothing inside imports the public API module


def test_every_module_imports_in_a_fresh_interpreter():
    names = sorted(m for m in modules() if not m.endswith(".__main__"))  # __main__ runs the CLI
    code = "import importlib, sys\nfor n in sys.argv[1:]:\n    importlib.import_module(n)\nprint(len(sys.argv) - 1)"
    r = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == str(len(names))
