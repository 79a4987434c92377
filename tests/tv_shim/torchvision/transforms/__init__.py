from . import functional, v2  # noqa: F401
from .functional import InterpolationMode  # noqa: F401
