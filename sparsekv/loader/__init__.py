"""Model loading: built-in names, GGUF files and HF folders -> Hugging Face state dicts.

See docs/internals.md ("Loader") for the interface and docs/models.md for the families.
"""

from sparsekv.loader.checkpoint import Checkpoint, load_checkpoint
from sparsekv.loader.convert import convert_gguf
from sparsekv.loader.resolve import resolve_model

__all__ = ["Checkpoint", "convert_gguf", "load_checkpoint", "resolve_model"]
