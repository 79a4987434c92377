"""`glimmer` command line (typer + rich). Commands parse arguments and call library functions; `app` holds what
they share (the decoding vocabulary, the model options, the one-line failure)."""

from . import generate, sessions, models, bench, doctor  # noqa: F401,I001  (each registers its commands on `app`, in this order)
from .app import app

__all__ = ["app"]
