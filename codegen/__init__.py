"""The generator: Variant -> Triton source (one template per family) -> cached module."""
from .cache import load, source_path
from .render import GENERATOR_VERSION, kernel_hash, render, template_hash, template_name
from .variant import Variant

__all__ = ["Variant", "render", "load", "source_path", "template_hash", "kernel_hash",
           "GENERATOR_VERSION", "template_name"]
