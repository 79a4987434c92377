"""`python -m glimmer_mlx.cli` is `glimmer`."""

from .app import app

app()
