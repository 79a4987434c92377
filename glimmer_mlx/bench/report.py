"""Presenting a `glimmer bench` results dict: rich tables, a Markdown table, a PNG bar chart (Pillow only)."""

from __future__ import annotations

from pathlib import Path

from .settings import CONTROL


def _fmt(x, spec=".2f", none="–"):
    return none if x is None else format(x, spec)


def _speed_cell(d: dict) -> str:
    s = d["speedup"]
    if s["median"] is None:
        return "–"
    if len(s["values"]) > 1:
        return f"{s['median']:.2f}× ({s['min']:.2f}–{s['max']:.2f})"
    return f"{s['median']:.2f}×"


def learned_line(subject: str, restored: int, path: str | None = None) -> str:
    """Where `subject` (an auto) started from: the estimates an earlier process kept (`speculative.auto.learned`;
    `restored` of them) or its drafters' own; `path`: the file, where known."""
    if restored:
        return (f"{subject} started from what earlier runs learned ({restored} estimates"
                + (f", {path}" if path else "") + "; GLIMMER_MLX_AUTO_LEARNED=off for a cold start)")
    return (f"{subject} started from its drafters' own estimates "
            + (f"(kept for the next run: {path})" if path else "(no earlier runs kept)"))


def verdict(res: dict) -> list[str]:
    """One plain-language line per temperature: which mode is fastest here and why — what a round of the best
    speculative mode commits (τ) against what it costs in plain steps (τ / speedup, as measured), next to the
    calibrated cost of a verify — how often `auto` drafted, and whether `auto` fell below plain by more than this
    sitting's noise: below the worst repeat of plain decoding against itself (`CONTROL`), the promise it keeps."""
    ratio = {int(k): v for k, v in ((res.get("calibration") or {}).get("verify_cost_ratio") or {}).items()}
    lines = []
    for tkey, modes in res["results"].items():
        speed = {m: d["speedup"]["median"] for m, d in modes.items() if d["speedup"]["median"] is not None}
        low = {m: modes[m]["speedup"].get("min", speed[m]) for m in speed}
        # a mode that never drafted (τ 1.00: auto or an adaptive width that chose plain steps throughout) decoded
        # plainly: whatever its ratio, it is plain decoding measured twice, not a mode that wins
        plainly = sorted(m for m in speed if m != "ar" and modes[m].get("tau") is not None
                         and modes[m]["tau"] <= 1.0 + 1e-9)
        best = max((m for m in speed if m not in plainly and m != CONTROL), key=speed.get)
        # plain decoding against itself: this sitting's noise (the control's worst and best repeat)
        noise = (low[CONTROL], modes[CONTROL]["speedup"].get("max", speed[CONTROL])) if CONTROL in speed else None
        if best == "ar":
            line = f"{tkey}: plain decoding is the fastest mode here"
            if plainly and max(speed[m] for m in plainly) > 1.0:
                line += (f" ({', '.join(plainly)} decoded plainly too: τ 1.00, "
                         f"{', '.join(f'{speed[m]:.2f}×' for m in plainly)} is this sitting's noise)")
        elif low[best] > 1.0:  # faster than plain in every repeat, not just in the median
            line = f"{tkey}: {best} is the fastest mode here ({speed[best]:.2f}× plain in the median, " \
                   f"{low[best]:.2f}× at worst)"
        else:
            line = (f"{tkey}: no mode is measurably faster than plain decoding here ({best} {speed[best]:.2f}× in the "
                    f"median, but {low[best]:.2f}× in its worst repeat)")
        spec = [m for m, d in modes.items() if d.get("tau") and m in speed and m != "auto"
                and not m.endswith("-auto") and not m.startswith("mlx-lm")]  # the fixed-width modes
        if spec:
            m = max(spec, key=speed.get)
            tau = modes[m]["tau"]
            line += (f"; {m} commits τ {tau:.2f} tokens a round, and its round costs {tau / speed[m]:.1f} plain "
                     "steps")
            if 8 in ratio:
                line += f" (a verify of 8 drafts alone {ratio[8]:.1f})"
        if "auto" in speed:
            chosen = {}
            for per_cat in res.get("auto_choices", {}).get(tkey, {}).values():
                for key, v in per_cat.items():
                    chosen[key.startswith("plain")] = chosen.get(key.startswith("plain"), 0) + v
            total = sum(chosen.values())
            share = f", drafting in {100 * chosen.get(False, 0) / total:.0f} % of its rounds" if total else ""
            line += f"; auto {speed['auto']:.2f}× plain{share}"
            if noise:
                line += (f" — {'below plain by more than' if speed['auto'] < noise[0] else 'within'} this sitting's "
                         f"noise (plain against itself {noise[0]:.2f}–{noise[1]:.2f}×)")
        elif noise:
            line += f"; plain against itself {noise[0]:.2f}–{noise[1]:.2f}× (this sitting's noise)"
        lines.append(line)
    return lines


def render_table(res: dict) -> list:
    """One rich Table per temperature: mode | tok/s (spread) | × plain | τ | TTFT | peak GB | × plain per category;
    then a note on skipped modes, the lossless check and the verify cost curve."""
    from rich.table import Table
    from rich.text import Text

    out = []
    m = res["machine"]
    cats = None
    for tkey, modes in res["results"].items():
        cats = cats or list(next(iter(modes.values()))["categories"])
        repeats = res["settings"].get("repeats_run", res["settings"]["repeats"])
        t = Table(title=f"{res['model']['target']} — {tkey}, {res['settings']['max_tokens']} tokens × {repeats} "
                        f"repeat(s) — {m.get('chip')}, mlx {m['mlx']}, BLAS {m['blas']}")
        for c in ("mode", "tok/s", "spread", "× plain", "τ", "TTFT ms", "peak GB", *cats):
            t.add_column(c, justify="left" if c == "mode" else "right", no_wrap=True)
        for mode, d in modes.items():
            t.add_row(mode, _fmt(d["tps"]["median"], ".1f"), f"{d['tps']['spread_pct']:.0f}%", _speed_cell(d),
                      _fmt(d["tau"]), _fmt(d["ttft_ms"]["median"], ".0f"), _fmt(d["peak_gb"], ".2f"),
                      *[_fmt(d["categories"].get(c, {}).get("speedup", {}).get("median"), ".2f") for c in cats])
        out.append(t)
    notes = []
    for mode, why in res.get("skipped", {}).items():
        notes.append(f"skipped {mode}: {why}")
    bad = {k: v for k, v in res.get("lossless_greedy", {}).items()
           if not k.startswith("mlx-lm") and v["identical_runs"] != v["runs"]}
    if res.get("lossless_greedy"):
        notes.append("greedy outputs identical to ar: " + ("all runs of every mode of ours" if not bad else
                     "; ".join(f"{k} {v['identical_runs']}/{v['runs']} (common prefix ≥ {v['min_common_prefix']})"
                               for k, v in bad.items())))
    cal = res.get("calibration")
    if cal:
        notes.append("verify cost vs one plain step, k drafts: " + ", ".join(
            f"k={k} {v:.2f}×" for k, v in list(cal["verify_cost_ratio"].items())[:17]) +
            f" ({'cached' if cal.get('cached') else 'measured now'}: {cal.get('path')})")
        kept = cal.get("learned")
        if kept:
            notes.append(learned_line("auto", kept["restored"], kept["path"]))
    for tkey, per_cat in res.get("auto_choices", {}).items():
        parts = []
        for c, ch in per_cat.items():
            tot = sum(ch.values()) or 1
            by = {}
            for key, v in ch.items():
                name = key.split(":")[0].split("@")[0]  # n-gram options are per matched size
                by[name] = by.get(name, 0) + v
            parts.append(f"{c}: " + " ".join(f"{n} {100 * v / tot:.0f}%" for n, v in sorted(by.items())))
        notes.append(f"auto's rounds by drafter, {tkey}: " + "; ".join(parts))
    if notes:
        out.append(Text("\n".join(notes), style="dim"))
    out.append(Text("\n".join(verdict(res)), style="bold"))
    return out


def markdown_table(res: dict, tkey: str) -> str:
    """The table for one temperature as Markdown (BENCHMARKS.md)."""
    modes = res["results"][tkey]
    cats = list(next(iter(modes.values()))["categories"])
    lines = ["| mode | tok/s (median) | spread | × plain (min–max) | τ | TTFT ms | peak GB | " +
             " | ".join(cats) + " |", "|---|" + "---:|" * (6 + len(cats))]
    for mode, d in modes.items():
        s = d["speedup"]
        sp = "–" if s["median"] is None else f"{s['median']:.2f} ({s['min']:.2f}–{s['max']:.2f})"
        lines.append(f"| {mode} | {_fmt(d['tps']['median'], '.1f')} | {d['tps']['spread_pct']:.0f}% | {sp} | "
                     f"{_fmt(d['tau'])} | {_fmt(d['ttft_ms']['median'], '.0f')} | {_fmt(d['peak_gb'])} | " +
                     " | ".join(_fmt(d["categories"].get(c, {}).get("speedup", {}).get("median"))
                                for c in cats) + " |")
    return "\n".join(lines)


def write_chart(res: dict, path) -> Path:
    """Horizontal bars: speedup vs plain decoding per mode (median, with the min–max range as a whisker), one panel
    per temperature. Pillow's default font; no plotting library needed."""
    from PIL import Image, ImageDraw, ImageFont

    panels = list(res["results"].items())
    modes = list(dict.fromkeys(m for _, d in panels for m in d))
    row_h, left, width, pad, head = 22, 130, 460, 16, 34
    panel_h = head + row_h * len(modes) + 28
    W, H = left + width + 90, pad + panel_h * len(panels) + pad
    img = Image.new("RGB", (W, H), "white")
    g = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    top_val = max([d["speedup"]["max"] or 0 for _, ms in panels for d in ms.values()] + [1.0])
    top_val = max(1.5, top_val * 1.1)

    def x_of(v):
        return left + int(width * v / top_val)

    colors = {"ar": (120, 120, 120), CONTROL: (160, 160, 160), "auto": (200, 80, 30), "ngram": (60, 150, 60),
              "mlx-lm": (90, 90, 160), "mlx-lm-draft": (120, 110, 200)}
    y0 = pad
    for tkey, ms in panels:
        g.text((pad, y0), f"speedup vs plain decoding, {tkey} ({res['model']['target'][-40:]})", fill="black",
               font=font)
        base = y0 + head
        for j, mode in enumerate(modes):
            y = base + j * row_h
            g.text((pad, y + 4), mode, fill="black", font=font)
            d = ms.get(mode)
            if d is None or d["speedup"]["median"] is None:
                g.text((left + 4, y + 4), "skipped", fill=(150, 150, 150), font=font)
                continue
            s = d["speedup"]
            col = colors.get(mode, (40, 110, 190) if mode.startswith("dflash") else (30, 160, 170))
            g.rectangle([left, y + 3, x_of(s["median"]), y + row_h - 5], fill=col)
            mid = y + row_h // 2 - 1
            g.line([x_of(s["min"]), mid, x_of(s["max"]), mid], fill="black", width=1)
            label = f"{s['median']:.2f}x" + (f"  tau={d['tau']:.2f}" if d.get("tau") else "")
            g.text((x_of(max(s["median"], s["max"])) + 6, y + 4), label, fill="black", font=font)
        x1 = x_of(1.0)
        g.line([x1, base - 4, x1, base + row_h * len(modes)], fill=(200, 0, 0), width=1)
        g.text((x1 - 6, base + row_h * len(modes) + 4), "1.0", fill=(200, 0, 0), font=font)
        y0 += panel_h
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path
