"""`glimmer doctor`: the machine, the MLX build and each custom kernel's verdict and speed, for a bug report."""

from __future__ import annotations

import json

import typer

from ..doctor import diagnose, format_report
from .app import app, fail


@app.command("doctor")
def doctor_cmd(
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON instead of text."),
    speed: bool = typer.Option(True, "--speed/--no-speed", help="Time each kernel and its built-in path."),
    calls: int = typer.Option(50, "--calls", help="Calls per timing window (one evaluation per window)."),
    windows: int = typer.Option(5, "--windows", help="Timing windows (the median is reported)."),
):
    """Self-test every custom kernel now and report the machine, the MLX build, each kernel's verdict, the path
    the dispatchers use and its speed against the built-in MLX path — ready to paste into a bug report."""
    if calls < 1 or windows < 1:
        fail("--calls and --windows must be at least 1")
    rep = diagnose(speed=speed, calls=calls, windows=windows)
    print(json.dumps(rep, indent=2, default=str) if as_json else format_report(rep))
