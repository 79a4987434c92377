"""Synthetic, well-formed conversations for the embedded model, built from the Python standard library's own source.

Every answer is true of the code it talks about: docstrings, signatures and source come from `ast` over the stdlib
files; arithmetic is computed; tool results are what the agent's tools return on a workspace made of those files.
Kinds: explain / signature / write-code / quote / summarise / JSON / arithmetic / greetings (plain chat), and agent
episodes (search → read → answer, list, read, patch, run, write) in the Muse tool-call format of
`chat_template.jinja`. Deterministic for a given seed and stdlib.
"""

from __future__ import annotations

import ast
import json
import random
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOOLS = json.loads((HERE / "tools.json").read_text())
AGENT_SYSTEM = (HERE / "agent_system.txt").read_text().strip()
NAMES = ["Ada", "Linus", "Grace", "Guido", "Barbara", "Ken", "Margaret", "Dennis", "Radia", "Alan", "Edsger",
         "Frances", "John", "Hedy", "Niklaus", "Sophie"]
CITIES = ["Paris", "Lagos", "Osaka", "Lima", "Oslo", "Pune", "Quito", "Tunis", "Perth", "Porto", "Cork", "Hanoi"]


@dataclass
class Func:
    module: str  # dotted module name
    rel: str  # path relative to the stdlib root
    name: str
    signature: str  # "name(a, b=1)"
    doc: str  # first sentence of the docstring
    source: str  # the def's source (≤ 30 lines)
    line: int  # 1-based line of the def


def first_sentence(doc: str) -> str:
    para = doc.strip().split("\n\n")[0]
    text = " ".join(para.split())
    for end in (". ", "; "):
        if end in text:
            text = text[: text.index(end) + 1]
            break
    return text if text.endswith(".") else text + "."


def index_functions(root: Path, files: list[Path]) -> list[Func]:
    out = []
    for f in files:
        try:
            src = f.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = src.splitlines()
        rel = str(f.relative_to(root))
        module = rel[:-3].replace("/", ".").removesuffix(".__init__")
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 20:
                continue
            seg = lines[node.lineno - 1 : node.end_lineno]
            if len(seg) > 30 or any(len(x) > 100 for x in seg):
                continue
            try:
                args = ast.unparse(node.args)
            except Exception:  # noqa: BLE001 - any unparse failure: skip the function
                continue
            out.append(Func(module, rel, node.name, f"{node.name}({args})", first_sentence(doc), "\n".join(seg),
                            node.lineno))
    return out


def msg(role, content):
    return {"role": role, "content": content}


def call(name, **arguments):
    return {"role": "assistant", "content": None,
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]}


def tool(name, content):
    return {"role": "tool", "name": name, "content": content}


def numbered(text: str, start: int = 1) -> str:
    return "\n".join(f"{i:>4}  {line}" for i, line in enumerate(text.splitlines(), start))


class Generator:
    def __init__(self, funcs: list[Func], root: Path, files: list[Path], seed: int):
        self.funcs, self.root, self.files = funcs, root, files
        self.rng = random.Random(seed)
        self.dirs = sorted({str(f.relative_to(root).parent) for f in files if f.parent != root})

    # -- plain chat turns: (user, assistant) pairs --------------------------------------------------------------
    def explain(self):
        f = self.rng.choice(self.funcs)
        q = self.rng.choice(["What does `{m}.{n}` do?", "Explain `{m}.{n}`.", "What is `{n}` in `{m}` for?"])
        return q.format(m=f.module, n=f.name), f"`{f.module}.{f.signature}`: {f.doc}"

    def signature(self):
        f = self.rng.choice(self.funcs)
        q = self.rng.choice(["What is the signature of `{m}.{n}`?", "How do I call `{m}.{n}`?"])
        return q.format(m=f.module, n=f.name), f"```python\n{f.module}.{f.signature}\n```"

    def write_code(self):
        f = self.rng.choice(self.funcs)
        doc = f.doc[0].lower() + f.doc[1:]
        q = self.rng.choice([f"Write a Python function `{f.signature}` that does this: {doc}",
                             f"Show me the source of `{f.module}.{f.name}`."])
        return q, f"Here is `{f.name}` from `{f.rel}`:\n\n```python\n{f.source}\n```"

    def quote(self):
        f = self.rng.choice(self.funcs)
        lines = [x for x in f.source.splitlines() if x.strip()]
        a = self.rng.randrange(len(lines))
        chunk = "\n".join(lines[a : a + self.rng.randint(1, 4)])
        q = self.rng.choice(["Repeat exactly:\n{c}", "Quote this back to me:\n{c}", "Copy this code:\n{c}"])
        return q.format(c=chunk), chunk

    def summarise(self):
        f = self.rng.choice(self.funcs)
        return (f"Summarise what this function does:\n\n```python\n{f.source}\n```",
                f"`{f.name}`: {f.doc}")

    def json_record(self):
        r = self.rng
        name, age, city = r.choice(NAMES), r.randint(18, 90), r.choice(CITIES)
        keys = r.sample(["name", "age", "city"], 3)
        vals = {"name": name, "age": age, "city": city}
        desc = ", ".join(f"{k} {vals[k]}" for k in keys)
        return (f"Give me a JSON object with {desc}.",
                json.dumps({k: vals[k] for k in ("name", "age", "city")}))

    def arithmetic(self):
        r = self.rng
        a, b = r.randint(0, 99), r.randint(0, 99)
        op = r.choice(["+", "-", "*"])
        v = {"+": a + b, "-": a - b, "*": a * b}[op]
        return r.choice([f"What is {a} {op} {b}?", f"Compute {a} {op} {b}."]), f"{a} {op} {b} = {v}."

    def greeting(self):
        return self.rng.choice([
            ("Hi!", "Hello! I am glimmer-tiny, a small model that ships with glimmer-mlx. Ask me about Python's "
                    "standard library."),
            ("Who are you?", "I am glimmer-tiny, a small Muse Glimmer-architecture model trained on the Python "
                             "standard library. I am here so glimmer-mlx works out of the box."),
            ("What can you do?", "I can explain, quote and write functions from Python's standard library, do small "
                                 "sums, write JSON, and use tools to read, search and patch files."),
            ("Thanks!", "You're welcome."),
        ])

    def chat(self) -> list[dict]:
        kinds = [self.explain, self.signature, self.write_code, self.quote, self.summarise, self.json_record,
                 self.arithmetic, self.greeting]
        weights = [3, 2, 4, 2, 2, 1, 1, 1]
        msgs = []
        if self.rng.random() < 0.3:
            msgs.append(msg("system", self.rng.choice(["You are a helpful assistant.", "Answer briefly.",
                                                        "You are glimmer-tiny."])))
        for _ in range(self.rng.choice([1, 1, 1, 2, 3])):
            q, a = self.rng.choices(kinds, weights)[0]()
            msgs += [msg("user", q), msg("assistant", a)]
        return msgs

    # -- agent episodes ------------------------------------------------------------------------------------------
    def _listing(self, d: str) -> list[str]:
        base = self.root / d
        return sorted(p.name + ("/" if p.is_dir() else "") for p in base.iterdir()
                      if not p.name.startswith((".", "__pycache__")))[:40]

    def agent(self) -> list[dict]:
        r = self.rng
        kind = r.choices(["find", "list", "read", "patch", "run", "write"], [4, 2, 2, 2, 1, 1])[0]
        msgs = [msg("system", AGENT_SYSTEM)]
        f = r.choice(self.funcs)
        if kind == "find":
            msgs.append(msg("user", r.choice([f"Where is `{f.name}` defined?", f"Find the definition of {f.name}.",
                                              f"What does {f.name} do? Look it up in the code."])))
            msgs += [call("search", pattern=f"def {f.name}\\(", path="."),
                     tool("search", f"{f.rel}:{f.line}:{f.source.splitlines()[0]}")]
            end = f.line + len(f.source.splitlines()) - 1
            msgs += [call("read_file", path=f.rel, start_line=f.line, end_line=end),
                     tool("read_file", numbered(f.source, f.line))]
            msgs.append(call("final_answer", answer=f"`{f.name}` is defined in {f.rel} at line {f.line}. {f.doc}"))
        elif kind == "list":
            d = r.choice(self.dirs)
            items = self._listing(d)
            msgs.append(msg("user", r.choice([f"List the files in {d}.", f"What is in the folder {d}?"])))
            msgs += [call("list_files", path=d), tool("list_files", "\n".join(items) or "(empty)")]
            msgs.append(call("final_answer", answer=f"{d} holds {len(items)} entries: {', '.join(items[:8])}"
                                                    + (", …" if len(items) > 8 else ".")))
        elif kind == "read":
            lines = f.source.splitlines()
            msgs.append(msg("user", f"Show me the first line of `{f.name}` in {f.rel}."))
            msgs += [call("read_file", path=f.rel, start_line=f.line, end_line=f.line + min(4, len(lines) - 1)),
                     tool("read_file", numbered("\n".join(lines[:5]), f.line))]
            msgs.append(call("final_answer", answer=f"It starts with: `{lines[0].strip()}`"))
        elif kind == "patch":
            new = r.choice(["compute", "handle", "process", "run_step", "convert"]) + "_" + f.name
            first = f.source.splitlines()[0]
            msgs.append(msg("user", f"Rename the function `{f.name}` to `{new}` in {f.rel}."))
            msgs += [call("search", pattern=f"def {f.name}\\(", path=f.rel),
                     tool("search", f"{f.rel}:{f.line}:{first}")]
            old_line = first.strip()
            msgs += [call("patch_file", path=f.rel, old=old_line, new=old_line.replace(f"def {f.name}(", f"def {new}(", 1)),
                     tool("patch_file", f"patched {f.rel}: 1 replacement")]
            msgs.append(call("final_answer", answer=f"Renamed `{f.name}` to `{new}` in {f.rel}."))
        elif kind == "run":
            n_pass, n_fail = r.randint(1, 40), r.choice([0, 0, 0, 1, 2])
            cmd = r.choice(["python -m pytest -q", "python -m unittest", "python -m pytest -q tests"])
            out = f"{n_pass} passed" + (f", {n_fail} failed" if n_fail else "") + f" in {r.uniform(0.1, 9):.2f}s"
            msgs.append(msg("user", r.choice(["Run the tests.", "Do the tests pass?", "Run the test suite."])))
            msgs += [call("run", command=cmd), tool("run", f"exit code {1 if n_fail else 0}\n{out}")]
            verdict = "All tests passed" if not n_fail else f"{n_fail} test{'s' if n_fail > 1 else ''} failed"
            msgs.append(call("final_answer", answer=f"{verdict} ({out})."))
        else:
            name = f"{f.name}.py"
            msgs.append(msg("user", f"Create a file {name} with a function that does this: {f.doc}"))
            msgs += [call("write_file", path=name, content=f.source + "\n"),
                     tool("write_file", f"wrote {name} ({len(f.source) + 1} bytes)")]
            msgs.append(call("final_answer", answer=f"Created {name} with `{f.signature}`."))
        return msgs
