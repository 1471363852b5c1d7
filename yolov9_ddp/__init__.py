"""yolov9-ddp's runtime package, installed into a patched YOLOv9 clone beside the kit's entry points."""

# The kit's version: pyproject.toml reads it, and apply_patches.py records it in the trees it patches.
__version__ = '0.7.0'
