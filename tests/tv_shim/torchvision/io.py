"""No decoding in the shim: the oracle passes PIL images."""


class ImageReadMode:
    RGB = "RGB"


def decode_image(*args, **kwargs):
    raise NotImplementedError("torchvision shim: decode_image is not available; pass PIL images")
