"""Images on an edge: the local layer store and the locally built ``base`` image."""

from dsec.edge.images.store import Image, ImageConfig, ImageStore

__all__ = ["Image", "ImageConfig", "ImageStore"]
