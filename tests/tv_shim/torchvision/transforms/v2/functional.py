"""torchvision 0.28's tensor kernels for resize / normalize / grayscale_to_rgb / to_dtype (CPU)."""

import platform

import torch
from torch.nn.functional import interpolate

from ..functional import InterpolationMode  # noqa: F401


def _native_uint8(mode: InterpolationMode) -> bool:
    if mode == InterpolationMode.BILINEAR:
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") or platform.machine() in ("aarch64",
                                                                                                      "arm64")
    return mode in (InterpolationMode.BICUBIC, InterpolationMode.LANCZOS)


def resize(image, size, interpolation=InterpolationMode.BILINEAR, max_size=None, antialias=True):
    if not isinstance(image, torch.Tensor):
        raise TypeError("torchvision shim: resize takes tensors only")
    mode = interpolation if isinstance(interpolation, InterpolationMode) else InterpolationMode(interpolation)
    antialias = False if antialias is None else antialias
    align_corners = None
    if mode in (InterpolationMode.BILINEAR, InterpolationMode.BICUBIC, InterpolationMode.LANCZOS):
        align_corners = False
        if mode == InterpolationMode.LANCZOS and not antialias:
            raise ValueError("InterpolationMode.LANCZOS requires antialias=True")
    else:
        antialias = False
    shape = image.shape
    C, H, W = shape[-3:]
    new_h, new_w = int(size[0]), int(size[1])
    if (new_h, new_w) == (H, W):
        return image
    dtype = image.dtype
    ok = [torch.float32, torch.float64]
    if mode in (InterpolationMode.NEAREST, InterpolationMode.NEAREST_EXACT):
        ok.append(torch.uint8)
    elif image.device.type == "cpu" and _native_uint8(mode):
        ok.append(torch.uint8)
    x = image.reshape(-1, C, H, W)
    cast = dtype not in ok
    if cast:
        x = x.to(torch.float32)
    x = interpolate(x, size=[new_h, new_w], mode=mode.value, align_corners=align_corners, antialias=antialias)
    if cast:
        if mode in (InterpolationMode.BICUBIC, InterpolationMode.LANCZOS) and dtype == torch.uint8:
            x = x.clamp_(min=0, max=255)
        if dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
            x = x.round_()
        x = x.to(dtype=dtype)
    return x.reshape(shape[:-3] + (C, new_h, new_w))


def normalize(image, mean, std, inplace=False):
    if not image.is_floating_point():
        raise TypeError(f"Input tensor should be a float tensor. Got {image.dtype}.")
    if not inplace:
        image = image.clone()
    mean = torch.as_tensor(mean, dtype=image.dtype, device=image.device)
    std = torch.as_tensor(std, dtype=image.dtype, device=image.device)
    if mean.ndim == 1:
        mean = mean.view(-1, 1, 1)
    if std.ndim == 1:
        std = std.view(-1, 1, 1)
    return image.sub_(mean).div_(std)


def grayscale_to_rgb(image):
    if image.shape[-3] >= 3:
        return image
    return image.expand(image.shape[:-3] + (3,) + image.shape[-2:]).clone()


def to_dtype(image, dtype=torch.float32, scale=False):
    if image.dtype == dtype:
        return image
    if not scale:
        return image.to(dtype)
    if image.is_floating_point():
        if dtype.is_floating_point:
            return image.to(dtype)
        return image.mul(torch.iinfo(dtype).max + 1.0 - 1e-3).to(dtype)
    if dtype.is_floating_point:
        return image.to(dtype).mul_(1.0 / torch.iinfo(image.dtype).max)
    raise NotImplementedError("torchvision shim: integer to integer to_dtype")
